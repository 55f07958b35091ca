"""Gradient buffers bounded by memory.host_budget (hetjax/gradients.py): released once
updated when nothing can redo the update, spilled to NVMe when clipping keeps them."""

import pytest
from equivalence import assert_gpt_training_equal, check_tokens

from hetjax.config import ConfigError
from hetjax.memory import in_flight_slabs, plan_gradients
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from models import build_model

EIGHT = dict(num_layers=8, d_model=32, num_heads=4, max_seq_len=32)  # 8 blocks of 64 KiB
PAGES = dict(page_size="16KiB")
STEPS = dict(steps=3, batch_size=4, seq_len=16, eval_batches=1, log_every=1)


def _config(tiny, clip: float, memory: dict):
    return tiny(
        model=EIGHT,
        train=STEPS,
        optimizer=dict(grad_clip=clip),
        offload=dict(mode="stream", optimizer="nvme"),
        memory=dict(PAGES, **memory),
    )


def _others_and_grads(config):
    """Host bytes besides the gradient buffers, and each stage's gradient slab bytes."""
    probe = StreamingRuntime(config)  # no host budget
    plan = probe.host_plan
    others = plan.param_slabs + plan.optimizer_state + plan.optimizer_io
    sizes = {n: probe.sizes.grad_bytes(n) for n in probe.update_order}
    probe.close()
    return others, sizes


def test_plan_gradients_bounds_releases_and_spills_the_first_produced():
    blocks = [f"b{i}" for i in range(9, -1, -1)]
    order = ["head", *blocks, "embed"]  # backward order
    sizes = dict(head=4, embed=8, **dict.fromkeys(blocks, 10))  # 112 in all
    window = lambda keep: 8 + in_flight_slabs(keep) * 10
    everything = plan_gradients(sizes, order, "keep", None, spill=True)
    assert everything.ram_bytes == 112 and not everything.bounded
    assert plan_gradients(sizes, order, "keep", 112, spill=True) == everything
    released = plan_gradients(sizes, order, "release", 111, spill=False)
    assert released.bounded and released.ram_bytes == window(False) < 112
    for room in (None, 112):  # no budget, or room for all: backward never waits
        free = plan_gradients(sizes, order, "release", room, spill=False)
        assert not free.bounded and free.ram_bytes == 112
    # keep: the last-produced stages stay in RAM, the first-produced ones spill.
    room = window(True) + 25
    kept = plan_gradients(sizes, order, "keep", room, spill=True)
    assert kept.bounded and kept.ram_stages == ("b1", "b0", "embed")
    assert kept.spilled == ("head", *blocks[:-2]) and kept.spill_bytes == 4 + 8 * 10
    assert kept.ram_bytes == window(True) + 20 <= room
    # No NVMe: all of them in RAM (the caller reports the shortfall).
    assert plan_gradients(sizes, order, "keep", room, spill=False) == everything
    for policy, times in (("accumulate", 1), ("lockfree", 2)):
        assert plan_gradients(sizes, order, policy, 10, spill=True).ram_bytes == times * 112


@pytest.mark.slow  # the spill tests below train within a host budget too
def test_no_clipping_releases_gradients_within_a_budget_below_all_of_them(tiny, tmp_path):
    """grad_clip=0: each gradient is dropped once its update consumed it, so a host budget
    smaller than the minimum with every gradient buffer trains, equal to offload.mode=none."""
    config = _config(tiny, 0.0, {})
    others, sizes = _others_and_grads(config)
    window = sizes["embed"] + in_flight_slabs(False) * max(sizes["block0"], sizes["head"])
    assert window < sum(sizes.values())
    budget = others + window
    config = _config(tiny, 0.0, dict(host_budget=budget))
    runtime = StreamingRuntime(config)
    plan = runtime.host_plan
    runtime.close()
    assert plan.grads.bounded and plan.gradients == window
    assert plan.required <= budget < others + sum(sizes.values())
    with pytest.raises(ConfigError, match="host is short by"):  # in-flight stages do count
        StreamingRuntime(config.replace(memory=dict(PAGES, host_budget=budget - 1)))

    ref = train(_config(tiny, 0.0, {}).replace(offload=dict(mode="none")), tmp_path / "ref", False)
    result = train(config, tmp_path / "stream", verbose=False)
    assert_gpt_training_equal(result, ref, build_model(config.model), check_tokens())
    for record in result.records:
        assert record["host_bytes"] <= budget


@pytest.mark.parametrize(
    "speculation",  # adaptive is the default; always runs with -m slow
    [pytest.param("always", marks=pytest.mark.slow), "adaptive"],
)
def test_clipping_redo_reads_gradients_spilled_to_nvme(tiny, tmp_path, speculation):
    """A clip norm small enough to bind every step, and a host budget with room for one
    kept block gradient: the other stages' gradients go to NVMe after their speculative
    update and come back for the redo; training equals offload.mode=none. ``adaptive``
    speculates in the first step only: the next two keep their gradients (spilled the
    same way) and update once, after backward."""
    clip = 0.05
    ssd = tmp_path / "ssd"
    config = _config(tiny, clip, dict(nvme_path=str(ssd)))
    others, sizes = _others_and_grads(config)
    slab = max(sizes["block0"], sizes["head"])
    budget = others + sizes["embed"] + in_flight_slabs(True) * slab + sizes["block0"]
    config = _config(tiny, clip, dict(host_budget=budget, nvme_path=str(ssd)))
    config = config.replace(optimizer=dict(speculation=speculation))
    runtime = StreamingRuntime(config)
    grads = runtime.host_plan.grads
    assert grads.ram_stages == ("block0", "embed")
    assert grads.spilled == ("head", *(f"block{i}" for i in range(7, 0, -1)))
    assert grads.spill_bytes == sum(sizes.values()) - sizes["block0"] - sizes["embed"]
    assert runtime.host_plan.required <= budget
    runtime.close()

    ref = train(_config(tiny, clip, {}).replace(offload=dict(mode="none")), tmp_path / "ref", False)
    result = train(config, tmp_path / "stream", verbose=False)
    assert_gpt_training_equal(result, ref, build_model(config.model), check_tokens())
    redo = [r["optimizer_redo"] for r in result.records]
    deferred = [r["optimizer_deferred"] for r in result.records]
    if speculation == "always":
        assert redo == [1, 2, 3] and deferred == [0, 0, 0]  # every step redone
    else:
        assert redo == [1, 1, 1] and deferred == [0, 1, 2]
    state = sum(runtime.optimizer.state_bytes(runtime.layout_name(n)) for n in sizes)
    assert runtime.host_plan.cached_stages == ()  # all state streams from disk
    for step, record in enumerate(result.records):
        assert record["host_bytes"] <= budget
        assert record["nvme_bytes"] == 2 * state + grads.spill_bytes  # 2 copies
        # A redone step reads and writes the state twice (speculative update, redo); a
        # deferred one once. Either writes the spilled gradients once and reads them
        # back once, for the update after backward.
        passes = 2 if speculation == "always" or step == 0 else 1
        moved = passes * state + grads.spill_bytes
        assert record["nvme_write_bytes"] == record["nvme_read_bytes"] == moved
    spilled = ssd / "gradients" / "float32"
    assert (spilled / "zarr.json").is_file()
    chunks = [p for p in spilled.rglob("*") if p.is_file() and p.name != "zarr.json"]
    pages = grads.spill_bytes // (16 << 10)
    assert len(chunks) == pages and sum(p.stat().st_size for p in chunks) >= grads.spill_bytes


def test_clipping_without_nvme_needs_every_gradient_in_ram(tiny):
    config = tiny(
        model=EIGHT,
        optimizer=dict(grad_clip=1.0),
        offload=dict(mode="stream", optimizer="host"),
        memory=PAGES,
    )
    probe = StreamingRuntime(config)
    need = probe.host_plan.required
    probe.close()
    config = config.replace(memory=dict(PAGES, host_budget=need - 1))
    with pytest.raises(ConfigError, match=r"spill to NVMe\) or optimizer.grad_clip=0"):
        StreamingRuntime(config)


def test_disk_check_counts_the_spilled_gradients(tiny, tmp_path, monkeypatch):
    import collections
    import re

    import hetjax.storage.nvme

    ssd = tmp_path / "ssd"
    config = _config(tiny, 1.0, dict(nvme_path=str(ssd)))
    others, sizes = _others_and_grads(config)
    budget = others + sizes["embed"] + in_flight_slabs(True) * sizes["block0"]
    config = _config(tiny, 1.0, dict(host_budget=budget, nvme_path=str(ssd)))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(hetjax.storage.nvme.shutil, "disk_usage", lambda path: usage(0, 0, 1 << 20))
    spilled = sum(sizes.values()) - sizes["embed"]  # every stage but the embed
    with pytest.raises(
        ConfigError,
        match=rf"memory.nvme_path '{re.escape(str(ssd))}' for the optimizer state and spilled "
        rf"gradients needs .* \(\d+ bytes: the optimizer state .*, spilled gradients "
        rf"{spilled / 1024:.2f} KiB\) on disk but only 1.00 MiB is free",
    ):
        StreamingRuntime(config)
