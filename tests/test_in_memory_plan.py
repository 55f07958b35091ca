"""The planner plans ``offload.mode=none`` on many devices (``planning/in_memory.py``):
a device's share of the state at a data x model split is what the in-memory runtime
holds there (``parallel/in_memory.py``), counted by hand; the step's collectives
are priced from hand-counted bytes; and ``offload.mode=auto`` on 4 devices takes
``none`` at the split where a device's share fits its budget, training as an explicit
``none`` run at that split does.

The tiny GPT (conftest.tiny_config: L 2, D 32, F 4D = 128, V 256, 32 positions, 4
heads) has 34,688 params: the embedding's token table 256 x 32 = 8,192 and positions
32 x 32 = 1,024, each block 12,704 (2 norms 4 x 32 = 128; fused q|k|v 32 x 96 + 96 =
3,168; attention out 32 x 32 + 32 = 1,056; MLP in 32 x 128 + 128 = 4,224 and out
128 x 32 + 32 = 4,128), the tied head's norm 64. Megatron's split (tensor parallelism
M) divides the token table (by vocabulary), the attention-out kernel (by heads), the
MLP's kernels and its hidden bias (by hidden units) by M, and nothing else: a block's
split leaves hold 1,024 + 4,096 + 128 + 4,096 = 9,344 elements, so at M = 2 a device
holds 8,192 / 2 + 1,024 + 2 x (12,704 - 9,344 / 2) + 64 = 21,248.

The tiny mixture of experts (test_split.MOE: Llama, L 2, D 32, 4 experts of 48 hidden
units, untied head, V 256) has 59,808 params, of which the stacked experts' gate, up and
down kernels 3 x 2 x 4 x 32 x 48 = 36,864; under expert parallelism 2 they split over
the expert axis, the other 22,944 whole: a device holds 18,432 + 22,944 = 41,376. (The
planner does not offer offload.mode=none there, whose exchange it does not price:
hetjax/support.py; the share is what it would count.)"""

import jax
import pytest
from conftest import tiny_config
from equivalence import assert_gpt_training_equal, check_tokens
from test_split import MOE
from test_zero import SGD_CLIP

from hetjax.planning import auto
from hetjax.planning.cost import Candidate, in_memory_collective_bytes
from hetjax.planning.in_memory import in_memory_device_parts, mesh_share
from hetjax.planning.split import tensor_degrees
from hetjax.planning.workload import Workload
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.train import train
from models import build_model

NONE = dict(mode="none")
WHOLE, HALF = 34_688, 21_248  # params a device holds: replicated; at tensor parallelism 2
MOE_DENSE, MOE_EP2 = 22_944, 41_376  # the MoE's leaves besides its experts; a device's at EP 2
SPLITS = {  # data x expert x model: the model and the params a device holds, by hand
    (2, 1, 1): ({}, WHOLE),
    (1, 1, 2): ({}, HALF),
    (2, 1, 2): ({}, HALF),
    (1, 2, 1): (MOE, MOE_EP2),
}


def _held_bytes(tree, device) -> int:
    """Bytes of ``tree``'s array leaves (scalars aside) whose shards ``device`` holds."""
    leaves = [a for a in jax.tree.leaves(tree) if a.ndim]
    return sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)


@pytest.mark.slow  # ~1-11 s each: builds the in-memory runtime on the mesh
@pytest.mark.parametrize("split", list(SPLITS), ids=lambda s: "x".join(map(str, s)))
def test_planner_counts_a_devices_share_of_in_memory_state_as_the_runtime_holds_it(split):
    """At data x expert x model 2 x 1 x 1, 1 x 1 x 2, 2 x 1 x 2 (the GPT) and 1 x 2 x 1
    (the MoE) the planner's params, gradients and optimizer state of offload.mode=none
    on a device (SGD with momentum: fp32 master, gradient and momentum, 4 bytes an
    element each) are the hand-counted share, and the built runtime holds exactly those
    params and that momentum on each device."""
    data, expert, tensor = split
    model, held = SPLITS[split]
    config = tiny_config(
        model=model, optimizer=SGD_CLIP, offload=NONE,
        distributed=dict(data_parallel=data, expert_parallel=expert, tensor_parallel=tensor),
    )  # fmt: skip
    devices = data * expert * tensor
    share = mesh_share(config, devices, tensor)
    assert share.params == held
    w = Workload.from_config(config, devices=devices, tensor=tensor)
    parts = in_memory_device_parts(w, share, remat=False)
    assert parts["params"] == parts["gradients"] == parts["optimizer"] == 4 * held
    runtime = InMemoryRuntime(config)
    for device in runtime.mesh_shardings.mesh.devices.flat:
        assert _held_bytes(runtime.state.params, device) == parts["params"]
        assert _held_bytes(runtime.state.opt_state, device) == parts["optimizer"]


def test_in_memory_collectives_are_the_hand_counted_bytes():
    """The bytes a device sends in an offload.mode=none step (one micro-batch of 4 rows,
    16 tokens, D 32, fp32): the gradients' ring all-reduce over data, 2(d-1)/d of its
    fp32 share (d = 2: the share once; 1: none); Megatron's at tensor parallelism 2, 2
    all-reduces a block forward and 2 backward (4 with model.remat: its forward's
    again) of a (b, 16, 32) fp32 activation, b the data group's rows, each 2(2-1)/2 of
    it, over 2 blocks. Under expert parallelism 2 (the MoE, one data row) the experts,
    split over the expert axis, are reduced over no device; the other leaves over the 2
    devices: their share once. (Under 2 s: shapes only.)"""
    activation = lambda rows: rows * 16 * 32 * 4
    expected = {  # (data, tensor): (gradients' all-reduce, Megatron's all-reduces)
        (2, 1): (4 * WHOLE, 0),
        (1, 2): (0, 2 * (2 + 2) * activation(4)),
        (2, 2): (4 * HALF, 2 * (2 + 2) * activation(2)),
    }
    for (data, tensor), (grads, megatron) in expected.items():
        config = tiny_config(optimizer=SGD_CLIP, offload=NONE)
        share = mesh_share(config, data * tensor, tensor)
        w = Workload.from_config(config, devices=data * tensor, tensor=tensor)
        c = Candidate(mode="none", share=share)
        assert in_memory_collective_bytes(w, c) == (grads, megatron), (data, tensor)
        remat = in_memory_collective_bytes(w, Candidate(mode="none", remat=True, share=share))
        assert remat == (grads, megatron * 6 // 4), (data, tensor)
    moe = tiny_config(model=MOE, distributed=dict(data_parallel=1, expert_parallel=2))
    share = mesh_share(moe, 2)
    assert share.expert == 2 and share.params == MOE_EP2
    assert 4 * share.allreduced == 4 * MOE_DENSE


def _auto(budget: str, **sections):
    """``offload.mode=auto`` on 4 devices (data_parallel=4) with a per-device budget."""
    return tiny_config(
        optimizer=SGD_CLIP, offload=dict(mode="auto"),
        memory=dict(page_size="4KiB", device_budget=budget, host_budget="8MiB"),
        distributed=dict(data_parallel=4), **sections,
    )  # fmt: skip


def _need(config, tensor: int, remat: bool) -> int:
    """The planner's device bytes of none at data x model 4/tensor x tensor."""
    w = Workload.from_config(config, devices=4, tensor=tensor)
    return sum(in_memory_device_parts(w, mesh_share(config, 4, tensor), remat).values())


@pytest.mark.slow  # ~6-12 s: a dozen workloads from shapes
def test_auto_takes_none_at_the_least_split_that_fits_each_device():
    """The decision, from shapes: a budget every split holds without
    recomputing takes data x model 4 x 1; one only tensor parallelism 4 holds takes
    that split; one that only holds the blocks recomputing takes model.remat at the
    least split that fits; one nothing holds plans the streaming runtime (None here)."""
    config = _auto("64MiB")
    assert tensor_degrees(config, 4) == [1, 2, 4]
    need = {(t, r): _need(config, t, r) for t in (1, 2, 4) for r in (False, True)}
    # a device's share shrinks with the split (the state 1/M, its rows' split layers)
    assert need[4, False] < need[1, False] and need[4, True] < need[2, True] < need[1, True]
    logs: list[str] = []

    def fits(budget: int):  # the config auto trains, or None: it streams
        config = _auto(str(budget))
        sections = auto._fits_in_memory(config, 4, [1, 2, 4], logs.append)
        return config.replace(**sections) if sections is not None else None

    roomy = fits(need[1, False])
    assert roomy.offload.mode == "none" and not roomy.model.remat
    assert roomy.distributed.data_parallel == 4 and roomy.distributed.tensor_parallel == 1
    tight = fits(need[4, False])  # before any split recomputes
    assert tight.distributed.tensor_parallel == 4 and not tight.model.remat, logs
    assert tight.distributed.data_parallel == 1
    least = fits(need[4, True])
    assert least.model.remat and least.distributed.tensor_parallel == 4, logs
    assert fits(need[4, True] - 1) is None
    assert "does not fit" in logs[-1]


@pytest.mark.slow  # ~42 s: two 4-device in-memory runs; a streamed plan measures the machine
def test_auto_on_4_devices_trains_none_where_it_fits_and_streams_where_not(tmp_path):
    """offload.mode=auto on 4 devices with a per-device budget that holds a device's
    share of the state without recomputing only at data x model 1 x 4 (600 KiB; the
    planner's need with 4 KiB pages: 4 x 1 859 KiB, 2 x 2 652 KiB, 1 x 4 526 KiB): it
    trains offload.mode=none at 1 x 4, equal to an explicit none run at 1 x 4 (SGD,
    fp32, 1e-5). Under a budget that no split's share fits (but the streaming runtime
    does), auto plans the streaming runtime, as before."""
    config = _auto("600KiB")
    assert _need(config, 4, False) <= 600 * 1024 < _need(config, 2, False)
    planned, plan = auto.plan_auto(config, tmp_path / "plan", lambda s: None)
    assert plan is None and planned.offload.mode == "none" and not planned.model.remat
    assert planned.distributed.tensor_parallel == 4 and planned.distributed.data_parallel == 1
    result = train(config, tmp_path / "auto", verbose=False)
    explicit = tiny_config(
        optimizer=SGD_CLIP, offload=NONE, distributed=dict(data_parallel=1, tensor_parallel=4)
    )
    expected = train(explicit, tmp_path / "none", verbose=False)
    assert_gpt_training_equal(result, expected, build_model(config.model), check_tokens())

    tight = _auto("280KiB")  # 1 x 4 with model.remat: 289 KiB
    assert _need(tight, 4, True) > 280 * 1024
    planned, plan = auto.plan_auto(tight, tmp_path / "stream", lambda s: None)
    assert plan is not None and planned.offload.mode == "stream"
