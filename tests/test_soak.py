"""A long run that must not leak (hetjax/bench/soak.py, ``python -m hetjax.bench soak``):
1,000 steps of a small GPT with params and optimizer state on NVMe under a host budget,
a checkpoint every 50 steps, sampled every 25 steps from outside the training process
(``/proc/<pid>``, the NVMe and checkpoint directories)."""

import numpy as np
import pytest

from hetjax.bench.soak import TREND, plot, run_soak, verdicts


@pytest.mark.slow  # ~50 s: 1,000 training steps in a child process
@pytest.mark.alone  # its step-time trend is a measured bound: the machine to itself (.ci/run)
def test_soak_1000_steps_rss_descriptors_files_and_step_time_stay_flat(tmp_path):
    # 1,000 steps, not the 300 the issue allows: a leak must show against this machine's
    # drifts of 5-10 s, and over 300 steps one covers half the run (soak._rise)
    samples, records = run_soak(tmp_path / "run", steps=1000)
    assert [s["step"] // 25 for s in samples] == list(range(1, 41))  # every 25 steps
    assert len(records) == 1000
    assert all(s["nvme_bytes"] > 0 and s["nvme_files"] > 0 for s in samples)  # state on NVMe
    result = verdicts(samples, records, warmup=100)
    # the bounds (#45): flat within 5% after warm-up, a constant file count
    assert result["rss_bytes_growth"] <= 0.05, samples
    assert result["fds_growth"] <= 0.05, samples
    assert result["nvme_files_constant"], samples
    assert result["step_time_rise"] < TREND, result  # no upward trend (the floor)
    assert plot(samples, records, tmp_path / "soak.png").stat().st_size > 0


def _synthetic(step_ms) -> tuple[list[dict], list[dict]]:
    """A soak's samples (flat) and records with each step's time ``step_ms(step)``, a
    checkpoint's slower steps and the noise of a shared machine on some steps."""
    rng = np.random.default_rng(0)
    records = [
        {
            "step": s,
            "step_time_s": step_ms(s) * (1 + rng.exponential(0.3) * (rng.random() < 0.4)) / 1e3,
        }
        for s in range(1, 1001)
    ]
    flat = dict(rss_bytes=500 << 20, fds=9, threads=40, nvme_files=32)
    return [{"step": s, **flat} for s in range(25, 1001, 25)], records


def test_the_soak_sees_a_leak_of_every_step_and_not_a_drift_of_the_machine():
    """The step-time verdict on synthetic runs: a step 15% slower by the end of the run
    (a leak: every step) is an upward trend; a stretch of 225 steps 40% slower, at the
    start of the last 250 or before them, is not; nor is a flat run."""
    leak = verdicts(*_synthetic(lambda s: 30 * (1 + 0.15 * (s - 100) / 900)), warmup=100)
    assert leak["step_time_rise"] >= TREND, leak
    assert leak["step_time_rise"] == pytest.approx(0.15, abs=0.03), leak
    for start in (500, 751):
        episode = lambda s, a=start: 30 * (1.4 if a <= s < a + 225 else 1.0)  # noqa: E731
        drift = verdicts(*_synthetic(episode), warmup=100)
        assert abs(drift["step_time_rise"]) < 0.02, (start, drift)
    flat = verdicts(*_synthetic(lambda s: 30.0), warmup=100)
    assert abs(flat["step_time_rise"]) < 0.02, flat
