"""What a batch costs (planning/batch.py, issue #58 item 4): on a workload and machine of
round numbers, the tokens per step at which each lane is hidden behind compute and the
suggested batch, against values solved by hand; ``--plan`` prints them."""

import dataclasses

import pytest

from hetjax import launch
from hetjax.memory import window_wait_lag
from hetjax.memory_host import host_minimum
from hetjax.placement import Placement
from hetjax.planning.cost import Candidate
from hetjax.planning.hardware import Hardware
from hetjax.planning.search import _evaluate, plan_batch_cost
from hetjax.planning.workload import Workload, memory_sizes
from hetjax.state_format import StateFormat

# 10 blocks of 1M params, embed and head 1M each (12M params, bf16 compute, fp32 master
# and Adam moments: 12 bytes a param on NVMe); micro-batches of `rows` rows of 100 tokens;
# a block's forward 2 FLOPs a param a token, the head's the same
L, BLOCK, TOKENS_PER_ROW = 10, 1_000_000, 100
HW = Hardware(
    name="hand", description="round numbers", source="test", num_devices=1,
    device_memory=1 << 34, device_flops=1e12, host_memory=1 << 36, h2d_bw=1e8, d2h_bw=1e9,
    nvme_read_bw=1e9, nvme_write_bw=1e9, nvme_capacity=10**12, optimizer_params_per_s=1e8,
)  # fmt: skip
PLACEMENT = Placement(params="host", optimizer="nvme", activations="device", prefetch_depth=0)


def hand(rows: int, working_set: int = 100) -> Workload:
    """The workload at ``rows`` rows a micro-batch, one micro-batch a step (sized here,
    not by planning/batch.py's resize), ``working_set`` device bytes a token."""
    tokens = rows * TOKENS_PER_ROW
    return Workload(
        name="hand", num_layers=L, embed_params=BLOCK, block_params=BLOCK, head_params=BLOCK,
        compute_bytes=2, block_grad_bytes=2, state_format=StateFormat.fp32(["mu", "nu"]),
        micro_batches=1, tokens_per_step=tokens, flops_per_step=6 * 12 * BLOCK * tokens,
        boundary=10 * tokens, working_set=working_set * tokens, kept={"all": 100 * tokens},
        recompute_flops={"all": 0.0}, block_fwd_flops=2 * BLOCK * tokens,
        head_fwd_flops=2 * BLOCK * tokens,
    )  # fmt: skip


def _limits(rows: int = 100, working_set: int = 100) -> dict[str, int]:
    """Budgets: the host's least for the placement (no optimizer state cached in RAM),
    and a device budget that holds micro-batches of ``rows`` rows with no block resident
    (its room left over is less than one more block's slab)."""
    o = PLACEMENT
    host = sum(host_minimum(memory_sizes(hand(10)), o).parts.values())
    lag = window_wait_lag(True)
    w = hand(rows, working_set)
    found = _evaluate(
        w, HW, {"device": 1 << 40, "host": host, "nvme": 10**12}, Candidate(placement=o)
    )
    device = found[0][3]  # all blocks resident with room to spare: take the parts' fixed part
    fixed = sum(v for k, v in device.items() if k != "blocks")
    return {"device": fixed + 2 * BLOCK * lag, "host": host, "nvme": 10**12}


def _planned(rows: int, limit: dict[str, int], working_set: int = 100):
    found = _evaluate(hand(rows, working_set), HW, limit, Candidate(placement=PLACEMENT))
    return found[0] if found else None


def test_hidden_at_and_the_suggested_batch_are_the_hand_solved_ones():
    limit = _limits()
    chosen = _planned(10, limit)
    assert chosen is not None and chosen[6] == 0  # no optimizer state cached in RAM
    assert chosen[2].placement.resident_blocks == 0
    cost = plan_batch_cost(hand(10), HW, limit, chosen, rows=10)
    # Compute per token: forward 10 blocks x 2 x 1M FLOPs, backward 3x it (recomputing),
    # the head's backward 3 x 2 x 1M: (80M + 6M) FLOPs / 1e12 FLOP/s = 86 us a token.
    per_token = (4 * L * 2 * BLOCK + 3 * 2 * BLOCK) / 1e12
    # Each micro-batch streams the 10 blocks' bf16 params in, forward and backward:
    # 2 x 10 x 2 MB at 0.1 GB/s = 0.4 s. The NVMe reads and writes the fp32 master and
    # moments of 12M params: 2 x 144 MB at 1 GB/s = 0.288 s. The host optimizer updates
    # 12M params at 1e8 a second: 0.12 s.
    assert cost.hidden_at["host->device"] == pytest.approx(0.4 / per_token, rel=1e-9)
    assert cost.hidden_at["nvme"] == pytest.approx(0.288 / per_token, rel=1e-9)
    assert cost.hidden_at["optimizer"] == pytest.approx(0.12 / per_token, rel=1e-9)
    assert cost.per_micro_batch == ("host->device",)  # accumulating streams them again
    # At one micro-batch of r rows (f = r / 10): forward max(0.02 f, 0.2 s) (its compute,
    # the params' copy), then backward with the update: max(0.066 f, 0.2, 0.12, 0.288).
    step = lambda r: max(0.02 * r / 10, 0.2) + max(0.066 * r / 10, 0.288)
    fraction = lambda r: 0.086 * r / 10 / step(r)
    assert cost.compute_fraction == pytest.approx(fraction(10), rel=1e-9)
    assert cost.bound == "host->device"  # its 0.4 s a step, the busiest lane
    # 0.086 f / (0.2 + 0.066 f) >= 0.9 from f = 0.18 / 0.0266 = 6.77: 68 rows
    assert fraction(68) >= 0.9 > fraction(67)
    batch, accum, got = cost.suggested
    assert (batch, accum) == (68, 1) and got == pytest.approx(fraction(68), rel=1e-9)
    for rows in (67, 68):  # the planner's own step there agrees (no block resident)
        at = _planned(rows, limit)
        assert at[2].placement.resident_blocks == 0
        assert at[7]["compute"] / at[0] == pytest.approx(fraction(rows), rel=1e-9)
    # the largest micro-batch within the budgets: the planner's footprint says so
    assert cost.most_rows >= 100 and _planned(cost.most_rows, limit) is not None
    assert _planned(cost.most_rows + 1, limit) is None
    text = "\n".join(cost.lines())
    assert (
        "train.batch_size=68 train.grad_accum=1" in text
        and "bound by the host->device link" in text
    )


def test_no_batch_reaches_it_where_the_budget_stops_it():
    """Micro-batches of 1 MB of working set a row and a device budget that holds 40 rows:
    68 are needed, and more micro-batches do not help (each streams the params again)."""
    big = 10_000  # working set bytes a token
    limit = _limits(40, big)
    chosen = _planned(10, limit, big)
    cost = plan_batch_cost(hand(10, big), HW, limit, chosen, rows=10)
    assert 40 <= cost.most_rows < 68 and _planned(cost.most_rows + 1, limit, big) is None
    assert cost.suggested is None
    assert "no batch reaches 90%" in "\n".join(cost.lines())


@pytest.mark.slow  # plans the 175B model (~5 s)
def test_plan_prints_the_batch_cost(capsys):
    """gpt175b on one A100-80GB is compute-bound at batch 16 (the plan's lanes: compute
    112 s, NVMe 82.5 s): ``--plan``'s new lines say so and suggest a batch no larger.
    (tests/test_planner.py's Fuyou test checks the plan's numbers in the default run.)"""
    assert launch.main(["--config", "gpt175b", "--plan", "--hardware", "a100-80g"]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "batch cost:" in s)
    assert "16,384 tokens/step gets 100% of the compute bound" in line
    assert "bound by compute" in line
    assert "hidden behind compute from" in out and "the host optimizer" in out
    suggested = int(out.split("train.batch_size=")[1].split()[0])
    assert suggested <= 16


def test_resized_keeps_what_does_not_grow():
    """A resized workload: FLOPs and activations by the factor, params unchanged."""
    from hetjax.planning.batch import resized

    w = hand(10)
    v = resized(w, 3.0, 2)
    expected = dataclasses.replace(
        hand(30), micro_batches=2, tokens_per_step=6000, flops_per_step=2 * hand(30).flops_per_step
    )
    assert v == expected
