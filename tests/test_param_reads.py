"""Params on NVMe read once a step where the host budget has room (issue #23 item 4): a
block's forward read is kept in RAM for its backward instead of read again."""

import jax
import numpy as np
import pytest
from equivalence import training_batches

from hetjax import memory
from hetjax.memory import Offload, Sizes, plan_host
from hetjax.runtime.streaming import StreamingRuntime

BLOCK = 10_000  # elements of a block slab


def _sizes(layers: int = 6) -> Sizes:
    return Sizes(
        num_layers=layers, embed=4_000, block=BLOCK, head=2_000, own_embed=4_000,
        own_block=BLOCK, own_head=2_000, compute_bytes=2, block_grad_bytes=2, state_kinds=2,
        boundary=1_000, working_set=0, kept={"all": 0}, grad_policy="release",
    )  # fmt: skip


def test_host_plan_keeps_blocks_for_backward_within_its_budget():
    s, one = _sizes(), 2 * BLOCK
    on_nvme = Offload(params="nvme", optimizer="nvme")
    # what the plan holds besides them and the state cache, with room for all it needs
    roomy = plan_host(s, on_nvme, 10**9)
    base = roomy.required - roomy.kept_params - roomy.cache
    assert memory.host_minimum(s, on_nvme).required <= base
    for room_blocks in (0, 1, 3):
        budget = base + room_blocks * one + one // 2
        plan = plan_host(s, on_nvme, budget)
        assert plan.kept_param_blocks == room_blocks, (room_blocks, plan)
        assert plan.kept_params == room_blocks * one
        assert plan.parts["params kept for backward"] == plan.kept_params
        assert plan.required <= budget
        assert plan.pinned >= plan.kept_params  # they are what moves to the device
    # every block fetched again for backward at most: not the ones kept on the device
    assert plan_host(s, on_nvme, 10**9).kept_param_blocks == 6
    kept_two = Offload(params="nvme", optimizer="nvme", keep_blocks=2)
    assert plan_host(s, kept_two, 10**9).kept_param_blocks == 4
    # no budget: the plan does not know the RAM (as for the state cache); params on
    # the host are read from RAM anyway
    assert plan_host(s, on_nvme, 0).kept_param_blocks == 0
    assert plan_host(s, Offload(params="host", optimizer="nvme"), 10**9).kept_param_blocks == 0
    # the state cache takes what is left after them
    assert roomy.kept_param_blocks == 6 and roomy.cache > 0


@pytest.mark.parametrize("budget", ["256MiB"])
def test_blocks_read_once_when_the_budget_has_room(tiny, budget):
    """Uses b0 b1 b2 b3 | b3 b2 b1 b0 with prefetch depth 1: b3's backward finds its
    device copy; b2, b1 and b0 were dropped and are read again from NVMe, unless the
    host plan keeps their forward reads. The step reads three blocks less, and trains
    the same params bit for bit."""
    model = dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32)
    offload = dict(mode="stream", optimizer="nvme", params="nvme", prefetch_depth=1)
    runs = {}
    for name, host_budget in (("read twice", 0), ("read once", budget)):
        config = tiny(model=model, offload=offload, memory=dict(host_budget=host_budget))
        runtime = StreamingRuntime(config)
        try:
            assert runtime.plan.prefetch_depth == 1 and runtime.plan.resident_blocks == 0
            reads = []  # the params' reads of each step (a budget caches state too)
            for batch in training_batches(config, 3):
                before = runtime.param_store.read_bytes
                runtime.train_step(batch)
                reads.append(runtime.param_store.read_bytes - before)
            layout = runtime.layouts["block"]
            runs[name] = (reads, runtime.params(), runtime.host_plan.kept_param_blocks)
        finally:
            runtime.close()
    assert runs["read twice"][2] == 0 and runs["read once"][2] == 4
    block_bytes = layout.padded_size * 4  # fp32 params, whole pages on disk
    for twice, once in zip(runs["read twice"][0][1:], runs["read once"][0][1:], strict=True):
        assert twice - once == 3 * block_bytes, (twice, once)
    jax.tree.map(np.testing.assert_array_equal, runs["read once"][1], runs["read twice"][1])
