"""Params on NVMe read once a step where the host budget has room (issue #23 item 4): a
block's forward read is kept in RAM for its backward instead of read again."""

import jax
import numpy as np
import pytest
from equivalence import training_batches

from hetjax import memory_host
from hetjax.memory import Sizes
from hetjax.memory_host import plan_host
from hetjax.placement import Placement
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import StateFormat

BLOCK = 10_000  # elements of a block slab
ADAM = StateFormat.fp32(["mu", "nu"])


def _sizes(layers: int = 6) -> Sizes:
    return Sizes(
        num_layers=layers, embed=4_000, block=BLOCK, head=2_000, own_embed=4_000,
        own_block=BLOCK, own_head=2_000, compute_bytes=2, block_grad_bytes=2,
        state_format=ADAM,
        boundary=1_000, working_set=0, kept={"all": 0}, grad_policy="release",
    )  # fmt: skip


def test_host_plan_keeps_blocks_for_backward_within_its_budget():
    s, one = _sizes(), 2 * BLOCK
    on_nvme = Placement(params="nvme", optimizer="nvme")
    # what the plan holds besides them and the state cache, with room for all it needs
    roomy = plan_host(s, on_nvme, 10**9)
    base = roomy.required - roomy.kept_params - roomy.cache
    assert memory_host.host_minimum(s, on_nvme).required <= base
    # The room above the base: 1/2, 3/2, 7/2 and 11/2 blocks' params (10, 30, 70 and
    # 110 kB). The state cache takes it first (it saves writes too): a stage's state in
    # it is held twice (old and new) at 12 bytes an element, 48 kB the head's, 96 kB the
    # embed's, 240 kB a block's, so the head's alone fits from 70 kB on; the kept blocks
    # (20 kB each) get what it leaves: 10 // 20, 30 // 20, (70 - 48) // 20, (110 - 48) // 20.
    for room_blocks, cache, expected in ((0, 0, 0), (1, 0, 1), (3, 48_000, 1), (5, 48_000, 3)):
        budget = base + room_blocks * one + one // 2
        plan = plan_host(s, on_nvme, budget)
        assert plan.cache == cache, (room_blocks, plan)
        assert plan.kept_param_blocks == expected, (room_blocks, plan)
        assert plan.kept_params == expected * one
        assert plan.parts["params kept for backward"] == plan.kept_params
        assert plan.required <= budget
        assert plan.pinned >= plan.kept_params  # they are what moves to the device
    # every block fetched again for backward at most: not the ones kept on the device
    assert plan_host(s, on_nvme, 10**9).kept_param_blocks == 6
    kept_two = Placement(params="nvme", optimizer="nvme", keep_blocks=2)
    assert plan_host(s, kept_two, 10**9).kept_param_blocks == 4
    # no budget: the plan does not know the RAM (as for the state cache); params on
    # the host are read from RAM anyway
    assert plan_host(s, on_nvme, 0).kept_param_blocks == 0
    assert plan_host(s, Placement(params="host", optimizer="nvme"), 10**9).kept_param_blocks == 0
    # with room for every stage's state, every block's params too
    assert roomy.kept_param_blocks == 6 and len(roomy.cached_stages) == 6 + 2
    # some blocks kept beside the state cache: the room it left
    plan = plan_host(s, on_nvme, base + 3 * one + one // 2)
    assert plan.cache == 48_000 and plan.kept_param_blocks == 1  # head's state (2 x 24 kB)


def test_host_plan_keeps_published_params_where_the_budget_has_room():
    """Params on NVMe: embed, head and the first 1 + prefetch depth blocks keep their
    published params to their next read, counted in the plan, first of what the
    budget's room holds; none below that room (the minimum does not need them), none
    with params in RAM."""
    s, on_nvme = _sizes(), Placement(params="nvme", optimizer="nvme", prefetch_depth=1)
    stages = ("embed", "head", "block0", "block1")
    assert memory_host.kept_published(s, on_nvme) == stages
    published = 2 * (4_000 + 2_000 + 2 * BLOCK)
    unlimited = plan_host(s, on_nvme, 0)
    assert unlimited.published_stages == stages and unlimited.published == published
    # the working set besides them, the state cache and the kept forward reads
    roomy = plan_host(s, on_nvme, 10**9)
    base = roomy.required - roomy.published - roomy.cache - roomy.kept_params
    assert plan_host(s, on_nvme, base).published == 0  # it still fits, without them
    assert memory_host.host_minimum(s, on_nvme).published == 0
    just = plan_host(s, on_nvme, base + published)
    assert just.published == published and just.cache == just.kept_params == 0
    assert just.required == base + published and just.pinned >= published
    assert just.parts["params kept to their next read"] == published
    assert plan_host(s, Placement(params="host", optimizer="nvme"), 0).published == 0


@pytest.mark.parametrize("budget", ["256MiB"])
def test_blocks_read_once_when_the_budget_has_room(tiny, budget):
    """Uses b0 b1 b2 b3 | b3 b2 b1 b0 with prefetch depth 1: b3's backward finds its
    device copy; b2, b1 and b0 were dropped and are read again from NVMe, unless the
    host plan keeps their forward reads. Each step reads three blocks less, and trains
    the same params bit for bit. In bf16, so the params have files of their own (fp32
    ones are the master, read from the state's: tests/test_master_params.py)."""
    model = dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="bfloat16")
    offload = dict(mode="stream", optimizer="nvme", params="nvme", prefetch_depth=1)
    runs = {}
    for name, host_budget in (("read twice", 0), ("read once", budget)):
        config = tiny(model=model, offload=offload, memory=dict(host_budget=host_budget))
        runtime = StreamingRuntime(config)
        try:
            assert runtime.plan.prefetch_depth == 1 and runtime.plan.resident_blocks == 0
            store = runtime.param_store
            stage_at = {first: stage for stage, (first, _) in store.stage_pages.items()}
            read: list[str] = []  # the stages read from disk, as the reads start
            for disk in store.disk:  # (reads land in the store's pooled slabs)
                disk.read_into = lambda k, first, out, r=disk.read_into, log=read, at=stage_at: (
                    log.append(at[first]) or r(k, first, out)
                )
            blocks_read = []
            for batch in training_batches(config, 3):
                # the last step's writes landed: no stage is served from the data being
                # written (the store's landing path, which reads nothing)
                store.wait()
                read.clear()
                runtime.train_step(batch)
                blocks_read.append(sorted(n for n in read if n.startswith("block")))
            kept = runtime.host_plan.kept_param_blocks
            runs[name] = (blocks_read, runtime.params(), kept)
        finally:
            runtime.close()
    assert runs["read twice"][2] == 0 and runs["read once"][2] == 4
    twice = sorted(["block0", "block1", "block2", "block3"] + ["block0", "block1", "block2"])
    assert runs["read twice"][0] == [twice] * 3
    assert runs["read once"][0] == [["block0", "block1", "block2", "block3"]] * 3
    jax.tree.map(np.testing.assert_array_equal, runs["read once"][1], runs["read twice"][1])


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]
)  # fp32: the state's master; bf16: files of their own
def test_resident_stages_and_the_first_blocks_are_not_read_back(tiny, dtype):
    """The head, the embedding and the blocks the forward's window takes first (block0
    and block1 at prefetch depth 1), published by the host optimizer during the step,
    are handed to their first read after the commit from RAM
    (``memory_host.kept_published``): the refresh of the resident stages reads nothing,
    and those blocks are read once a step, for their backward (no budget: no forward
    read is kept for backward), not for the next forward too."""
    model = dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32, compute_dtype=dtype)
    offload = dict(mode="stream", optimizer="nvme", params="nvme", prefetch_depth=1)
    config = tiny(model=model, offload=offload)
    runtime = StreamingRuntime(config)
    try:
        assert runtime.plan.resident_blocks == 0 and runtime.host_plan.kept_param_blocks == 0
        store = runtime.param_store
        assert store.keep_published == {"embed", "head", "block0", "block1"}
        for batch in training_batches(config, 3):
            before = store.stage_reads.copy()
            runtime.train_step(batch)
            reads = store.stage_reads - before
            assert reads["embed"] == reads["head"] == 0, reads
            assert reads["block0"] == reads["block1"] == 1, reads
    finally:
        runtime.close()
