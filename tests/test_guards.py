"""The loss-spike guard (``train.spike_factor``, hetjax/guards.py and the loop in
hetjax/train.py): a spike is injected with ``HETJAX_FAULTS=loss_spike@N`` (step N's
loss, as the guard sees it, 1000 times larger); the step must update nothing and then
be skipped, rolled back or stopped on exactly as a non-finite one is. References are
runtimes trained on a chosen list of batches, with no guard and no checkpoints."""

import math

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_gpt_training_equal, training_batches

from hetjax.checkpoint import Checkpointer
from hetjax.guards import SpikeGuard
from hetjax.train import build_runtime, train
from hetjax.types import TrainingError

STEPS = 6
NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def config(on_nonfinite="skip", window=3, **sections):
    cfg = tiny_config(
        train=dict(
            steps=STEPS,
            eval_batches=1,
            spike_factor=10.0,
            spike_window=window,
            on_nonfinite=on_nonfinite,
        ),
        checkpoint=dict(every_steps=2, at_end=True, keep=3),
    )
    return cfg.replace(**sections) if sections else cfg


def trained_on(cfg, batch_numbers: list[int], workdir):
    """A runtime of ``cfg`` trained on the given training batches (0-based) in order:
    (losses, params)."""
    batches = training_batches(cfg, max(batch_numbers) + 1)
    runtime = build_runtime(cfg, workdir)
    try:
        losses = [runtime.train_step(batches[i]).loss for i in batch_numbers]
        return losses, runtime.params()
    finally:
        runtime.close()


def test_spike_guard_limit_is_the_factor_times_the_running_median():
    guard = SpikeGuard(10.0, window=3)
    assert guard.limit() == math.inf  # no window yet
    guard.add(1.0)
    guard.add(5.0)
    assert guard.limit() == math.inf  # never before the window is full
    guard.add(2.0)
    assert guard.limit() == 20.0  # 10 x median(1, 5, 2)
    guard.add(4.0)  # the window slides: (5, 2, 4)
    assert guard.limit() == 40.0
    assert SpikeGuard(0.0, window=1).limit() == math.inf  # off


def test_spike_is_skipped_without_updating(tmp_path, monkeypatch):
    """spike@5 with a window of 3 (full from step 4): step 5 updates nothing and the run
    goes on with batch 6; equal bit for bit to a runtime trained on batches 1-4 and 6."""
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@5")
    cfg = config("skip")
    result = train(cfg, tmp_path / "a", verbose=False)
    assert [r["step"] for r in result.records if r.get("loss_spike")] == [5]
    assert result.records[4]["loss_spikes"] == 1
    losses, params = trained_on(cfg, [0, 1, 2, 3, 5], tmp_path / "ref")
    np.testing.assert_array_equal(result.losses[:4] + result.losses[5:], losses)
    jax.tree.map(np.testing.assert_array_equal, result.params, params)


@pytest.mark.slow  # ~5 s: the skip test is the default run's check
def test_spike_before_the_window_is_full_is_trained_through(tmp_path, monkeypatch):
    """spike@3 with a window of 3 (two updating steps before it): no limit yet, so the
    step updates as usual: the params equal an uninjected run's."""
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@3")
    cfg = config("stop")
    result = train(cfg, tmp_path / "a", verbose=False)
    assert not any(r.get("loss_spike") for r in result.records)
    assert result.losses[2] > 100 * result.losses[3]  # the injected loss was reported
    _, params = trained_on(cfg, list(range(STEPS)), tmp_path / "ref")
    jax.tree.map(np.testing.assert_array_equal, result.params, params)


@pytest.mark.slow  # ~5 s
def test_spike_rolls_back_and_skips_the_bad_batch(tmp_path, monkeypatch):
    """rollback: step 5 spikes, the run restores the checkpoint of step 4 and goes on
    with the batch after the spiking one (batches 1-4, then 6 and 7)."""
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@5")
    cfg = config("rollback")
    result = train(cfg, tmp_path / "a", verbose=False)
    assert [r["step"] for r in result.records] == [1, 2, 3, 4, 5, 5, 6]
    assert result.records[4]["loss_spike"]
    losses, params = trained_on(cfg, [0, 1, 2, 3, 5, 6], tmp_path / "ref")
    np.testing.assert_array_equal(result.losses[:4] + result.losses[5:], losses)
    jax.tree.map(np.testing.assert_array_equal, result.params, params)


@pytest.mark.slow  # ~3 s
def test_spike_stops_the_run_when_told(tmp_path, monkeypatch):
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@5")
    with pytest.raises(
        TrainingError, match=r"step 5: loss spike: loss .* > train.spike_factor 10 x .*stop"
    ):
        train(config("stop"), tmp_path, verbose=False)
    ckpt = Checkpointer(tmp_path / "checkpoints", writing=False)
    try:
        assert ckpt.steps() == [2, 4]  # nothing after the spike
    finally:
        ckpt.close()


@pytest.mark.slow  # ~25 s
def test_streaming_runtime_skips_a_spike_as_the_in_memory_one(tmp_path, monkeypatch):
    """The streaming runtime (state on NVMe, speculative updates dropped at the spike)
    skips step 5 as the in-memory runtime does."""
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@5")
    stream = train(config("skip", offload=NVME), tmp_path / "s", verbose=False)
    monkeypatch.setenv("HETJAX_FAULTS", "loss_spike@5")
    memory = train(config("skip"), tmp_path / "m", verbose=False)
    assert [r["step"] for r in stream.records if r.get("loss_spike")] == [5]
    assert_gpt_training_equal(stream, memory)
