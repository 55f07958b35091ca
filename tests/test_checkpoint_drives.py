"""Checkpoints of pages striped over several drives (``hetjax/checkpoint_drives.py``):
each drive's pages hard-linked in a checkpoint directory on that drive, found again at
restore, removed with their checkpoint; a missing one is a clear error."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import training_batches

from hetjax.checkpoint import Checkpointer
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from hetjax.types import CheckpointError

NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def _committed(runtime: StreamingRuntime) -> dict:
    return {s: runtime.states.committed(s)[0] for s in runtime.stage_names}


def _assert_restores(ckpt: Checkpointer, step: int, expected: dict) -> None:
    state, meta = ckpt.restore(step)
    assert meta["step"] == step
    for stage, slabs in expected.items():
        size = state.size(stage)
        for kind, slab in slabs.items():
            np.testing.assert_array_equal(state.read(stage, kind, 0, size), slab[:size])


def _saves(drive) -> list:
    """The per-drive save directories under a drive's ``checkpoints/<namespace>/``."""
    return sorted(p for folder in (drive / "checkpoints").glob("*") for p in folder.iterdir())


def test_striped_pages_link_on_their_drive_and_go_with_their_checkpoint(tmp_path):
    """Pages striped over drives a and b (4 KiB pages), saved at step 2: each page file
    in b's save directory is the tier's own file there (same inode, two links), the
    checkpoint's page directories link to a's or b's; nothing is written or copied. After
    two more steps it restores the state of step 2; with b's save directory gone it is a
    CheckpointError naming it, and put back it restores again. Saved at step 4 with
    ``keep=1``, step 2's save directories go from both drives; the checkpoint directory
    moved elsewhere still restores step 4."""
    drives = [tmp_path / "a", tmp_path / "b"]
    config = tiny_config(
        offload=NVME,
        memory=dict(page_size="4KiB", nvme_path=",".join(map(str, drives))),
    )
    batches = training_batches(config, 4)
    runtime = StreamingRuntime(config)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1)
    try:
        for batch in batches[:2]:
            runtime.train_step(batch)
        expected = _committed(runtime)
        ckpt.save(2, runtime.save_state(), {"step": 2})
        ckpt.wait()
        report = ckpt.report
        state_bytes = sum(a.nbytes for s in expected.values() for a in s.values())
        assert report.linked_bytes == state_bytes, report
        assert report.written_bytes == report.copied_bytes == 0, report

        (save_a,), (save_b,) = _saves(drives[0]), _saves(drives[1])
        tier_b = {f.stat().st_ino: f for f in (drives[1] / "optimizer").rglob("*") if f.is_file()}
        on_b = [f for f in save_b.rglob("*") if f.is_file()]
        assert len(on_b) > 4
        for f in on_b:
            st = f.stat()
            assert st.st_ino in tier_b and st.st_nlink == 2, f
            assert f.name == "0" and f.parent.parent.name == "c"
        # the checkpoint's own arrays: every page directory a link to a's or b's
        proc = tmp_path / "checkpoints" / "2" / "state" / "proc0"
        pages = [d for d in (proc / "master" / "c").iterdir()]
        assert pages and all(d.is_symlink() for d in pages)
        assert {d.readlink().parents[2] for d in pages} == {save_a, save_b}
        index = json.loads((proc / "index.json").read_text())
        assert index["drives"] == sorted([str(save_a), str(save_b)])

        for batch in batches[2:]:  # the tier rewrites its files
            runtime.train_step(batch)
        _assert_restores(ckpt, 2, expected)

        away = tmp_path / "away"
        os.replace(save_b, away)
        with pytest.raises(CheckpointError, match=str(save_b)):
            ckpt.restore(2)
        os.replace(away, save_b)
        _assert_restores(ckpt, 2, expected)

        expected = _committed(runtime)
        ckpt.save(4, runtime.save_state(), {"step": 4})
        ckpt.wait()
        assert not save_a.exists() and not save_b.exists()
        assert [p.name.split(".")[0] for d in drives for p in _saves(d)] == ["4", "4"]
        _assert_restores(ckpt, 4, expected)
    finally:
        ckpt.close()
        runtime.close()
    shutil.move(tmp_path / "checkpoints", tmp_path / "moved")
    moved = Checkpointer(tmp_path / "moved", writing=False)
    try:
        _assert_restores(moved, 4, expected)
    finally:
        moved.close()


@pytest.mark.slow  # ~6 s alone, ~25 s at load 14 (four tiny runs); the test above: default run
def test_resume_from_drives_equals_uninterrupted_and_a_missing_drive_is_refused(tmp_path):
    """Checkpoints every 2 steps of a run striped over drives a and b, stopped after
    step 2: resuming with b's save directory moved away stops with a CheckpointError
    naming it, before anything is built; put back, the resumed run's losses and params
    equal those of an uninterrupted run bit for bit."""

    def config(drives, steps):
        return tiny_config(
            offload=NVME,
            memory=dict(page_size="4KiB", nvme_path=",".join(map(str, drives))),
            train=dict(steps=steps, eval_batches=0),
            checkpoint=dict(every_steps=2),
        )

    drives = [tmp_path / "a", tmp_path / "b"]
    whole = train(config([tmp_path / "c", tmp_path / "d"], 4), tmp_path / "whole", verbose=False)
    first = train(config(drives, 2), tmp_path / "run", verbose=False)
    (save_b,) = _saves(drives[1])
    away = tmp_path / "away"
    os.replace(save_b, away)
    with pytest.raises(CheckpointError, match=str(save_b)):
        train(config(drives, 4), tmp_path / "run", verbose=False)
    os.replace(away, save_b)
    rest = train(config(drives, 4), tmp_path / "run", verbose=False)
    np.testing.assert_array_equal(first.losses + rest.losses, whole.losses)
    jax.tree.map(np.testing.assert_array_equal, rest.params, whole.params)
