"""The data x model split a plan prints (hetjax/planning/split.py): Megatron's
tensor-parallel all-reduce volume against bytes counted by hand."""

import pytest
from conftest import tiny_config

from hetjax.placement import Placement
from hetjax.planning.hardware import PROFILES
from hetjax.planning.search import make_plan
from hetjax.planning.split import tensor_allreduce_bytes
from hetjax.planning.workload import Workload


def test_megatron_all_reduce_bytes_by_hand():
    """The tiny GPT (2 blocks, d 32, fp32), a global batch of 16 x 16 on 8 devices: a
    device's rows are 2; at 2 devices a model group its data group's 4 rows make a (4,
    16, 32) activation of 8,192 B, and each recomputing block all-reduces it 6 times a
    micro-batch (2 forward, 2 recomputed, 2 backward), each sending 2(t-1)/t of it:
    2 x 6 x 8,192 = 98,304 B; at 4: 8 rows, 16,384 B, 2 x 6 x 1.5 x 16,384 = 294,912 B;
    a kept block all-reduces 4 times (no recomputed forward)."""
    config = tiny_config(train=dict(batch_size=16, seq_len=16))
    w = Workload.from_config(config, devices=8)
    streamed = Placement()
    assert tensor_allreduce_bytes(w, streamed, 1) == 0
    assert tensor_allreduce_bytes(w, streamed, 2) == pytest.approx(98_304)
    assert tensor_allreduce_bytes(w, streamed, 4) == pytest.approx(294_912)
    kept = Placement(keep_blocks=1)  # one block of the two: 6 + 4 all-reduces
    assert tensor_allreduce_bytes(w, kept, 2) == pytest.approx(10 * 8_192)


@pytest.mark.slow  # ~4 s: a plan on the profile
def test_plan_on_eight_gpus_says_its_split_and_why():
    """--plan on Angel-PTM's 8 x A100-40G names the split it takes (8 x 1), prices the
    all-reduces of each tensor-parallel degree over the profile's links, and says why
    it does not take them."""
    config = tiny_config(train=dict(batch_size=16, seq_len=16))
    plan = make_plan(config, PROFILES["angel-a100-40g"])
    line = plan.split
    assert line.startswith("data x model: 8 x 1") and "save no device memory" in line
    w = Workload.from_config(config, devices=8, backend="gpu")
    at2 = tensor_allreduce_bytes(w, plan.placement, 2) / PROFILES["angel-a100-40g"].interconnect_bw
    assert f"{at2:.3g} s/step at 2" in line
    assert line in plan.table()
