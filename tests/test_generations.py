"""One NVMe generation written in place (``hetjax/generations.py``): which
configs get it, and that a run killed with SIGKILL while its tier holds a step half
written in place, or while a checkpoint is being saved, resumes to exactly the params of
an uninterrupted run (the crash harness of ``tests/test_checkpoint.py``)."""

import filecmp
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config
from test_checkpoint import NVME, STEPS, config, launch, saved_params

from hetjax.config import ConfigError
from hetjax.generations import nvme_generations
from hetjax.placement import Placement
from hetjax.train import train

# every update waits for the global norm: nothing written is ever dropped
IN_PLACE = dict(optimizer=dict(warmup_steps=2, lr=3e-3, speculation="never"))


def test_generations_follow_what_can_drop_an_update():
    base = tiny_config(offload=NVME)
    assert nvme_generations(base).count == 2  # clipping with speculative updates
    assert nvme_generations(base.replace(optimizer=dict(speculation="never"))).count == 1
    no_drops = base.replace(optimizer=dict(grad_clip=0.0), train=dict(on_nonfinite="stop"))
    assert nvme_generations(no_drops).count == 1
    # a non-finite step that is skipped drops the updates written before it
    assert nvme_generations(base.replace(optimizer=dict(grad_clip=0.0))).count == 2
    lockfree = base.replace(optimizer=dict(mode="lockfree", speculation="never"))
    assert nvme_generations(lockfree).count == 2
    forced = base.replace(memory=dict(nvme_generations=2), optimizer=dict(speculation="never"))
    assert nvme_generations(forced).count == 2
    with pytest.raises(ConfigError, match="grad_clip=1.0 with optimizer.speculation=adaptive"):
        nvme_generations(base.replace(memory=dict(nvme_generations=1)))
    # the plan says which, why, and what one copy takes
    line = nvme_generations(base.replace(optimizer=dict(speculation="never"))).describe(1 << 20)
    assert line.startswith("NVMe generations: 1 (written in place): auto: optimizer.speculation")
    assert "saves 1.00 MiB of files" in line
    # the memory model counts one copy of the state's files
    two = Placement.from_config(base)
    one = Placement.from_config(base.replace(optimizer=dict(speculation="never")))
    assert (two.generations, one.generations) == (2, 1)


@pytest.fixture(scope="module")
def uninterrupted_in_place(tmp_path_factory):
    return train(config(NVME, **IN_PLACE), tmp_path_factory.mktemp("ref"), verbose=False)


def _differing_pages(a: Path, b: Path) -> tuple[int, int]:
    """(pages that differ, pages equal) between two page arrays' chunk files."""
    pages = sorted(p.relative_to(a) for p in a.glob("c/*/0"))
    same = sum(filecmp.cmp(a / p, b / p, shallow=False) for p in pages)
    return len(pages) - same, same


@pytest.mark.parametrize(  # a torn step in the default run (~40 s), torn saves slow
    "fault, checkpoint",
    [
        # the step waits for the save: the kill tears step 5 over step 4's checkpoint
        ("kill_mid_update@5", dict(async_save=False)),
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
    """speculation=never (one generation) trains bit for bit as the default (two, with a
    clipping redo in these steps), with half the state's files on disk."""
    two = train(tiny_config(offload=NVME), tmp_path / "two", verbose=False)
    one = train(tiny_config(offload=NVME, **IN_PLACE), tmp_path / "one", verbose=False)
    assert sum(r["optimizer_redo"] for r in two.records) > 0  # the redo path was taken
    np.testing.assert_array_equal(one.losses, two.losses)
    jax.tree.map(np.testing.assert_array_equal, one.params, two.params)
    assert 2 * one.records[-1]["nvme_bytes"] == two.records[-1]["nvme_bytes"]
