"""launch/local.sh --max-restarts with real processes: one of two processes killed
(SIGKILL) mid-run, every process is stopped and started again, resumes from the newest
checkpoint, and the run ends with the losses of an uninterrupted one; SIGTERM to the
script instead stops both with a checkpoint (exit 75, no restart). The scripts' restart
logic (which statuses restart, how many times, the messages, ssh.sh too) is
tests/test_launch_scripts.py's, with shims.
"""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_launch_cluster import TINY, _env, _hetjax_processes, _logged_step, _losses

ROOT = Path(__file__).resolve().parent.parent
STEPS = 60  # ~40 ms a step: the kill lands well before the end
KILL_AFTER = 14  # logged steps; checkpoints every 5 steps, so it resumes from 10 or later
ARGS = [*TINY, f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=5"]


def _local(workdir: Path, *options: str) -> subprocess.Popen:
    argv = [ROOT / "launch" / "local.sh", "2", *options, "--workdir", workdir, *ARGS]
    return subprocess.Popen(
        [str(a) for a in argv], cwd=ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow  # ~190 s on 2 loaded cores: two 2-process runs, one of them started twice
def test_local_restart_after_a_killed_process_trains_like_an_uninterrupted_run(tmp_path):
    """local.sh 2 --max-restarts 1; once step 14 is logged, process 1 gets SIGKILL. The
    script says so, stops process 0, starts both again (logged), they resume from a
    checkpoint of step >= 10 (so steps up to the kill are trained twice) and finish:
    exit 0, and every step's loss and the validation loss equal, exactly, those of the
    same run uninterrupted (a resume restores the state bit for bit)."""
    workdir = tmp_path / "restarted"
    proc = _local(workdir, "--max-restarts", "1")
    try:
        deadline = time.monotonic() + 240
        while _logged_step(workdir) < KILL_AFTER:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        ones = [
            p
            for p, e in _hetjax_processes(str(workdir)).items()
            if e.get("HETJAX_PROCESS_ID") == "1"
        ]
        assert len(ones) == 1, _hetjax_processes(str(workdir))
        killed_at_step = _logged_step(workdir)
        subprocess.run(["kill", "-9", str(ones[0])], check=True)
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert killed_at_step < STEPS
    failed = "launch/local.sh: process 1 failed (exit status 137: killed by SIGKILL)"
    assert f"{failed}; stopping the other 1" in err, err[-3000:]
    assert "launch/local.sh: restart 1 of 1: starting all 2 processes again" in err, err[-3000:]
    restored = [line for line in out.splitlines() if line.startswith("restoring checkpoint step ")]
    assert len(restored) == 1 and int(restored[0].split()[3]) >= 10, out[-3000:]

    reference = _local(tmp_path / "uninterrupted")
    ref_out, ref_err = reference.communicate(timeout=400)
    assert reference.returncode == 0, ref_out[-3000:] + ref_err[-3000:]
    losses, val_loss = _losses(workdir)
    expected, expected_val = _losses(tmp_path / "uninterrupted")
    assert len(losses) == STEPS
    np.testing.assert_array_equal(losses, expected)
    np.testing.assert_array_equal(val_loss, expected_val)
    print(f"killed after step {killed_at_step}; {restored[0]}", file=sys.stderr)


@pytest.mark.slow  # ~60 s on 2 loaded cores: one 2-process run
def test_local_sigterm_stops_every_process_with_a_checkpoint(tmp_path):
    """SIGTERM to local.sh 2 --max-restarts 1 mid-run (a scheduler preempting it): both
    processes get it, stop at the same step with its checkpoint complete, and local.sh
    exits 75 without restarting them."""
    workdir = tmp_path / "run"
    argv = [ROOT / "launch" / "local.sh", "2", "--max-restarts", "1", "--workdir", workdir]
    endless = [*TINY, "--config.train.steps=1000000"]
    proc = subprocess.Popen(
        [str(a) for a in [*argv, *endless]], cwd=ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while _logged_step(workdir) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.terminate()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, out[-3000:] + err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("SIGTERM: stopped at step ")]
    assert len(stopped) == 1, out[-3000:]  # process 0's log; process 1's is proc1.log
    step = int(stopped[0].split()[4].rstrip(";"))
    assert f"preempted (SIGTERM) at step {step}:" in (workdir / "proc1.log").read_text()
    assert (workdir / "checkpoints" / str(step)).is_dir()
    assert "restart" not in err, err
