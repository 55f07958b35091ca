"""One NVMe copy written in place (``hetjax/nvme_copies.py``): which
configs get it, and that a run killed with SIGKILL while its tier holds a step half
written in place, or while a checkpoint is being saved, resumes to exactly the params of
an uninterrupted run (the crash harness of ``tests/test_checkpoint.py``)."""

import filecmp
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config
from test_checkpoint import NVME, STEPS, config, launch, saved_params

from hetjax.cli_config import saved_config
from hetjax.config import ConfigError
from hetjax.launch import main as launch_main
from hetjax.nvme_copies import nvme_copies
from hetjax.placement import Placement
from hetjax.state_format import StateFormat
from hetjax.storage.nvme_states import NvmeStateStore
from hetjax.train import train

# every update waits for the global norm: nothing written is ever dropped
IN_PLACE = dict(optimizer=dict(warmup_steps=2, lr=3e-3, speculation="never"))


def test_copies_follow_what_can_drop_an_update():
    base = tiny_config(offload=NVME)
    assert nvme_copies(base).count == 2  # clipping with speculative updates
    assert nvme_copies(base.replace(optimizer=dict(speculation="never"))).count == 1
    no_drops = base.replace(optimizer=dict(grad_clip=0.0), train=dict(on_nonfinite="stop"))
    assert nvme_copies(no_drops).count == 1
    # a non-finite step that is skipped drops the updates written before it
    assert nvme_copies(base.replace(optimizer=dict(grad_clip=0.0))).count == 2
    lockfree = base.replace(optimizer=dict(mode="lockfree", speculation="never"))
    assert nvme_copies(lockfree).count == 2
    forced = base.replace(memory=dict(nvme_copies=2), optimizer=dict(speculation="never"))
    assert nvme_copies(forced).count == 2
    with pytest.raises(ConfigError, match="grad_clip=1.0 with optimizer.speculation=adaptive"):
        nvme_copies(base.replace(memory=dict(nvme_copies=1)))
    # the plan says which, why, and what one copy takes
    line = nvme_copies(base.replace(optimizer=dict(speculation="never"))).describe(1 << 20)
    assert line.startswith("NVMe copies: 1 (written in place): auto: optimizer.speculation")
    assert "saves 1.00 MiB of files" in line
    # the memory model counts one copy of the state's files
    two = Placement.from_config(base)
    one = Placement.from_config(base.replace(optimizer=dict(speculation="never")))
    assert (two.copies, one.copies) == (2, 1)


def test_the_old_key_nvme_generations_is_refused_naming_the_new_one(tmp_path, capsys):
    """``memory.nvme_generations`` is ``memory.nvme_copies`` now ("generation" means text
    generation only): on a command line or in replace() the old key is refused naming the
    new one; a run's config.json written before the rename still reads, value kept."""
    for call in (
        lambda: tiny_config().override({"memory.nvme_generations": "1"}),
        lambda: tiny_config().replace(memory=dict(nvme_generations=1)),
    ):
        with pytest.raises(ConfigError, match="'memory.nvme_generations' was renamed "
                           "'memory.nvme_copies'.*write memory.nvme_copies instead"):  # fmt: skip
            call()
    assert launch_main(["--config", "gpt_tiny", "--config.memory.nvme_generations=2"]) == 2
    assert "was renamed 'memory.nvme_copies'" in capsys.readouterr().err
    saved = tiny_config(offload=NVME).to_dict()
    saved["memory"]["nvme_generations"] = saved["memory"].pop("nvme_copies") + 1
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert saved_config(tmp_path / "config.json").memory.nvme_copies == 1


@pytest.fixture(scope="module")
def uninterrupted_in_place(tmp_path_factory):
    return train(config(NVME, **IN_PLACE), tmp_path_factory.mktemp("ref"), verbose=False)


def _differing_pages(a: Path, b: Path) -> tuple[int, int]:
    """(pages that differ, pages equal) between two page arrays' chunk files."""
    pages = sorted(p.relative_to(a) for p in a.glob("c/*/0"))
    same = sum(filecmp.cmp(a / p, b / p, shallow=False) for p in pages)
    return len(pages) - same, same


@pytest.mark.parametrize(  # ~30-40 s each: slow (the default run has the store's guard
    # below, and test_checkpoint's SIGKILL tests of the same harness)
    "fault, checkpoint",
    [
        # the step waits for the save: the kill tears step 5 over step 4's checkpoint
        pytest.param("kill_mid_update@5", dict(async_save=False), marks=pytest.mark.slow),
        pytest.param("kill_saving@4", {}, marks=pytest.mark.slow),
        # copied, not hard-linked: the in-place writes wait for the copy of their pages
        pytest.param("kill_saving@4", dict(link_nvme=False), marks=pytest.mark.slow),
    ],
    ids=["mid-step", "during-background-save", "during-copying-save"],
)
def test_one_generation_sigkill_then_resume_equals_uninterrupted(
    fault, checkpoint, uninterrupted_in_place, tmp_path
):
    cfg = config(NVME, **IN_PLACE)
    cfg = cfg.replace(checkpoint=checkpoint) if checkpoint else cfg
    launch(cfg, tmp_path, faults=fault, expect_rc=-9)
    tier = tmp_path / "nvme" / "optimizer"
    assert (tier / "gen0").is_dir() and not (tier / "gen1").exists()  # one copy, in place
    if fault.startswith("kill_mid_update"):
        # the kill left step 5 half written over the files step 4's checkpoint linked:
        # the first stage updated differs from it, the others not yet
        ckpt = tmp_path / "checkpoints" / "4" / "state" / "proc0" / "master"
        differ, same = _differing_pages(tier / "gen0" / "master", ckpt)
        assert differ > 0 and same > 0, (differ, same)
    resumed = train(cfg, tmp_path, verbose=False)
    assert 0 < len(resumed.losses) < STEPS  # it did resume, not start over
    np.testing.assert_array_equal(
        resumed.losses, uninterrupted_in_place.losses[-len(resumed.losses) :]
    )
    jax.tree.map(np.testing.assert_array_equal, resumed.params, uninterrupted_in_place.params)
    state, meta = saved_params(tmp_path)
    assert meta["step"] == STEPS
    jax.tree.map(np.testing.assert_array_equal, state.params(), uninterrupted_in_place.params)


@pytest.mark.slow  # ~25 s: two runs
def test_in_place_equals_two_generations_and_keeps_half_the_files(tmp_path):
    """speculation=never (one copy) trains bit for bit as the default (two, with a
    clipping redo in these steps), with half the state's files on disk."""
    two = train(tiny_config(offload=NVME), tmp_path / "two", verbose=False)
    one = train(tiny_config(offload=NVME, **IN_PLACE), tmp_path / "one", verbose=False)
    assert sum(r["optimizer_redo"] for r in two.records) > 0  # the redo path was taken
    np.testing.assert_array_equal(one.losses, two.losses)
    jax.tree.map(np.testing.assert_array_equal, one.params, two.params)
    assert 2 * one.records[-1]["nvme_bytes"] == two.records[-1]["nvme_bytes"]


@pytest.mark.slow  # ~30 s: two runs with a rollback each
def test_in_place_rollback_over_a_torn_step_equals_two_generations(tmp_path, monkeypatch):
    """No clipping and train.on_nonfinite=rollback: one copy (auto), and a
    rollback over a non-finite step trains exactly as with two. (The fault's NaN reaches
    the head's gradient first, so no stage is submitted before the step is dropped: a
    stage torn in place is the store-level test below.)"""
    monkeypatch.setenv("HETJAX_FAULTS", "nan@3")
    cfg = config(NVME, optimizer=dict(grad_clip=0.0))
    cfg = cfg.replace(train=dict(steps=STEPS, eval_batches=1, on_nonfinite="rollback"))
    assert nvme_copies(cfg).count == 1
    one = train(cfg, tmp_path / "one", verbose=False)
    assert [r["step"] for r in one.records] == [1, 2, 3, 3, 4, 5, 6]  # rolled back once
    monkeypatch.setenv("HETJAX_FAULTS", "nan@3")
    two = train(cfg.replace(memory=dict(nvme_copies=2)), tmp_path / "two", verbose=False)
    assert not (tmp_path / "one" / "nvme" / "optimizer" / "gen1").exists()
    np.testing.assert_array_equal(one.losses, two.losses)
    jax.tree.map(np.testing.assert_array_equal, one.params, two.params)


def test_a_stage_written_in_place_by_a_dropped_step_is_refused_until_restored(tmp_path):
    """The store's guard (one copy): a step that wrote a stage in place and was
    then dropped leaves that stage refused (read, checkpoint) until a restore rewrites
    it; a stage the step did not write stays readable."""
    fmt = StateFormat.fp32(["mu", "nu"])
    P = 1024  # page elements (4 KiB of fp32)
    pages = {"a": (0, 2), "b": (2, 2)}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    store = NvmeStateStore(
        tmp_path, fmt, pages, P, cached=[], sharding=sharding, io_slots=2, copies=1
    )
    for stage in pages:
        store.init_stage(stage, {k: np.full(2 * P, 1.0, np.float32) for k in fmt.kinds}, [])
    store.wait_init()
    slabs, scalars = store.get("a")
    store.put("a", {k: np.asarray(v) + 1 for k, v in slabs.items()}, scalars)
    store.abort()  # e.g. a non-finite step with train.on_nonfinite=rollback
    with pytest.raises(RuntimeError, match="written in place"):
        store.freeze("a")
    with pytest.raises(RuntimeError, match="written in place"):
        store.prefetch("a")
    np.testing.assert_array_equal(store.committed("b")[0]["mu"], 1.0)
    store.init_stage("a", {k: np.full(2 * P, 3.0, np.float32) for k in fmt.kinds}, [])
    store.wait_init()
    np.testing.assert_array_equal(store.committed("a")[0]["nu"], 3.0)
    assert not (tmp_path / "gen1").exists()
