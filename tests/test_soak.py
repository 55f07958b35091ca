"""A long run that must not leak (hetjax/bench/soak.py, ``python -m hetjax.bench soak``
runs 1,000 steps): 300 steps of a small GPT with params and optimizer state on NVMe
under a host budget, a checkpoint every 50 steps, sampled every 25 steps from outside
the training process (``/proc/<pid>``, the NVMe and checkpoint directories)."""

import pytest

from hetjax.bench.soak import plot, run_soak, verdicts


@pytest.mark.slow  # ~100 s: 300 training steps in a child process
@pytest.mark.alone  # its step-time trend is a measured bound: the machine to itself (.ci/run)
def test_soak_300_steps_rss_descriptors_files_and_step_time_stay_flat(tmp_path):
    samples, records = run_soak(tmp_path / "run", steps=300)
    assert [s["step"] // 25 for s in samples] == list(range(1, 13))  # every 25 steps
    assert len(records) == 300
    assert all(s["nvme_bytes"] > 0 and s["nvme_files"] > 0 for s in samples)  # state on NVMe
    result = verdicts(samples, records, warmup=100)
    # the bounds (#45): flat within 5% after warm-up, a constant file count
    assert result["rss_bytes_growth"] <= 0.05, samples
    assert result["fds_growth"] <= 0.05, samples
    assert result["nvme_files_constant"], samples
    assert result["step_time_rise"] < 0.10, result  # no upward trend (the floor)
    assert plot(samples, records, tmp_path / "soak.png").stat().st_size > 0
