"""launch/slurm.sh and launch/ssh.sh against the real things: a one-node SLURM cluster
(munged, slurmctld, slurmd; 2 CPUs, two tasks) and an sshd on localhost, started by
tests/cluster_services.py (installed with apt-get first where missing: root on Debian;
skipped elsewhere, failing under CI=true). Each launch runs two processes of a tiny
model on one virtual CPU device each; checked: they train as one process does, a task
killed with SIGKILL stops them all with a message naming it, and SLURM's signal before
the time limit (slurm.sh's own ``#SBATCH --signal``) ends the job with a checkpoint and
exit status 75, from which a requeued job resumes.

Timings on the 2-core development machine (Debian 12), which other sessions loaded
(load average ~20): installing the packages 7-15 s, once; starting SLURM ~1.5 s and sshd
~0.5 s; the one-process reference 21 s; the tests, each noted below; the module 5.3 min.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster_services
import numpy as np
import pytest
from conftest import require

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
# The tiny GPT of conftest.tiny_config as command-line keys, ZeRO-3 over every device
TINY = [
    "--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.num_heads=4",
    "--config.model.max_seq_len=32", "--config.model.attention_block=8",
    "--config.train.batch_size=4", "--config.train.seq_len=16", "--config.train.log_every=1",
    "--config.train.eval_batches=2", "--config.optimizer.warmup_steps=2",
    "--config.optimizer.lr=3e-3", "--config.data.corpus_bytes=200000",
    "--config.data.shuffle=false", "--config.offload.mode=stream",
    "--config.distributed.data_parallel=0",
]  # fmt: skip
STEPS = 4  # the equivalence runs
# long enough that only a signal or a kill ends it (~40 ms a step here)
ENDLESS = "--config.train.steps=1000000"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed():
    """The SLURM, munge and OpenSSH programs, installed with apt-get once when missing;
    the seconds that took (printed with -s)."""
    missing = cluster_services.missing_prerequisite()
    require(missing is None, missing or "")
    seconds = cluster_services.install()
    print(f"\ncluster_services: packages installed in {seconds:.1f} s", file=sys.stderr)
    return seconds


@pytest.fixture(scope="module")
def slurm(installed, tmp_path_factory):
    cluster = cluster_services.Slurm(tmp_path_factory.mktemp("slurm"), cpus=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def sshd(installed, tmp_path_factory):
    server = cluster_services.Sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server.start()
    finally:
        server.stop()


def _env(**extra: str) -> dict[str, str]:
    """This environment without conftest's device count or any process-group variable:
    one CPU device per process, this Python, a free coordinator port."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("HETJAX_", "SLURM_"))
    }
    port = str(cluster_services.free_port())
    return {
        **base,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "PYTHON": sys.executable,
        "HETJAX_COORDINATOR_PORT": port,  # slurm.sh
        "HETJAX_PORT": port,  # ssh.sh, local.sh
        **extra,
    }


def _losses(workdir: Path) -> tuple[list[float], float]:
    """A run's per-step losses (metrics.jsonl; a step logged twice, by a run and by its
    resumption, counts as the later) and validation loss (summary.json)."""
    by_step = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]
    assert sorted(by_step) == list(range(1, len(by_step) + 1)), sorted(by_step)
    val = json.loads((workdir / "summary.json").read_text())["val_loss"]
    return [by_step[s] for s in sorted(by_step)], val


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[list[float], float]:
    """The losses of one process on one device with the launches' arguments."""
    workdir = tmp_path_factory.mktemp("one") / "run"
    argv = [sys.executable, "-m", "hetjax.launch", "--workdir", str(workdir), *TINY]
    out = subprocess.run(
        [*argv, f"--config.train.steps={STEPS}"], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and "cpu x1;" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return _losses(workdir)


def _hetjax_processes(marker: str) -> dict[int, dict[str, str]]:
    """The running `python -m hetjax.launch` processes whose command line holds
    ``marker`` (a run's workdir): pid -> their HETJAX_/SLURM_ environment."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile, or not ours to read
        if argv[1:3] == [b"-m", b"hetjax.launch"] and marker.encode() in argv:
            pairs = (e.decode(errors="replace").partition("=") for e in environ)
            found[int(proc.name)] = {
                k: v for k, _, v in pairs if k.startswith(("HETJAX_", "SLURM_"))
            }
    return found


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.2)
    return value


def _logged_step(workdir: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first)."""
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _kill_process(workdir: Path, variable: str, process_id: str) -> float:
    """Once the run has logged a step, SIGKILLs its process whose ``variable`` is
    ``process_id``; the monotonic time of the kill."""
    _wait_for(lambda: _logged_step(workdir) >= 2, 240, "the run's second step")
    pids = [
        p for p, env in _hetjax_processes(str(workdir)).items() if env.get(variable) == process_id
    ]
    assert len(pids) == 1, _hetjax_processes(str(workdir))
    os.kill(pids[0], signal.SIGKILL)
    return time.monotonic()


def _sbatch(slurm, tmp_path: Path, *options: str, args=()) -> str:
    """Submits launch/slurm.sh for two tasks on the one node with ``options``; the job
    id. Its output goes to tmp_path/job.out."""
    argv = [
        "sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
        f"--output={tmp_path / 'job.out'}", f"--chdir={ROOT}", *options,
        str(LAUNCH / "slurm.sh"), "--workdir", str(tmp_path / "run"), *TINY, *args,
    ]  # fmt: skip
    out = subprocess.run(argv, env=slurm.env(_env()), capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


# -- SLURM ----------------------------------------------------------------------------------


def test_slurm_two_tasks_train_as_one_process(slurm, one_process, tmp_path):
    """~60 s. sbatch launch/slurm.sh as two tasks on the node: the job completes, the
    processes report 2 devices over 2 processes, and the per-step and validation losses
    (the validation loss is of the final params) equal one process's within 1e-5
    (tests/test_zero.py's two-process bound)."""
    job = _sbatch(slurm, tmp_path, args=[f"--config.train.steps={STEPS}"])
    fields = slurm.wait_job(job, 400)
    log = (tmp_path / "job.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "zero-3: 2 devices (2 processes)" in log, log[-3000:]
    losses, val_loss = _losses(tmp_path / "run")
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, one_process[0], rtol=1e-5)
    np.testing.assert_allclose(val_loss, one_process[1], rtol=1e-5)


def test_slurm_killed_task_stops_the_job(slurm, tmp_path):
    """~65 s. SIGKILL to task 1's hetjax mid-run: the job ends within 60 s (not after
    distributed.timeout_s, 300 s), failed, and its output names the task and why."""
    job = _sbatch(slurm, tmp_path, "--time=5", args=[ENDLESS])
    killed_at = _kill_process(tmp_path / "run", "SLURM_PROCID", "1")
    fields = slurm.wait_job(job, 120)
    ended_in = time.monotonic() - killed_at
    log = (tmp_path / "job.out").read_text()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", fields
    assert "launch/slurm.sh: task 1 on" in log, log[-3000:]
    assert "failed (exit status 137: killed by SIGKILL); ending the other tasks" in log, log[-3000:]
    assert ended_in < 60, ended_in
    assert not _hetjax_processes(str(tmp_path / "run"))


def test_slurm_signals_before_the_time_limit_and_the_run_checkpoints(slurm, tmp_path):
    """~135-170 s. A 4-minute job of slurm.sh as written (#SBATCH --signal=B:USR1@120) and
    --requeue, training endlessly: SLURM's SIGUSR1 reaches both processes at least a
    minute before the time limit, each stops at the same step with its checkpoint
    complete, and the job exits 75 (not cancelled at the limit, no task killed).
    `scontrol requeue` then runs the job again, which resumes from that checkpoint."""
    job = _sbatch(slurm, tmp_path, "--time=4", "--requeue", args=[ENDLESS])
    fields = slurm.wait_job(job, 400)
    log = (tmp_path / "job.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "75:0"), log[-3000:]
    minutes, seconds = map(int, fields["RunTime"].split(":")[-2:])
    assert minutes * 60 + seconds < 4 * 60 - 60, fields["RunTime"]
    stopped = [line for line in log.splitlines() if line.startswith("hetjax: preempted (SIGUSR1)")]
    assert len(stopped) == 2 and stopped[0] == stopped[1], log[-3000:]  # both, the same step
    step = int(stopped[0].split(" at step ")[1].split(":")[0])
    assert (tmp_path / "run" / "checkpoints" / str(step)).is_dir()
    assert "Exited with exit code 75" in log and "Killed" not in log, log[-3000:]

    subprocess.run(["scontrol", "requeue", job], env=slurm.env(), check=True)
    # SLURM holds a requeued job for two minutes before it may start again: not here. A
    # start within the second of the requeue finds the job's credential revoked
    # ("Killing non-startable batch job"), hence 5 s.
    subprocess.run(
        ["scontrol", "update", f"JobId={job}", "StartTime=now+5"], env=slurm.env(), check=True
    )
    resumed = f"restoring checkpoint step {step} "
    _wait_for(lambda: resumed in (tmp_path / "job.out").read_text(), 240, resumed)
    subprocess.run(["scancel", job], env=slurm.env(), check=True)
    slurm.wait_job(job, 120)


# -- ssh ------------------------------------------------------------------------------------


def _ssh_launch(sshd, tmp_path: Path, *args: str) -> subprocess.Popen:
    """launch/ssh.sh over sshd with the host file `localhost` twice."""
    (tmp_path / "hosts.txt").write_text("localhost\nlocalhost\n")
    env = _env(HETJAX_SSH_OPTIONS=sshd.ssh_options(), HETJAX_REMOTE_DIR=str(ROOT))
    argv = [LAUNCH / "ssh.sh", tmp_path / "hosts.txt", "--workdir", tmp_path / "run", *TINY]
    return subprocess.Popen(
        [str(a) for a in [*argv, *args]], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_ssh_two_processes_train_as_one_process(sshd, one_process, tmp_path):
    """~60 s. launch/ssh.sh with two processes over sshd (each in the login's
    environment: one CPU device): it succeeds and the losses equal one process's within
    1e-5."""
    proc = _ssh_launch(sshd, tmp_path, f"--config.train.steps={STEPS}")
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "zero-3: 2 devices (2 processes)" in out, out[-3000:]
    losses, val_loss = _losses(tmp_path / "run")
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, one_process[0], rtol=1e-5)
    np.testing.assert_allclose(val_loss, one_process[1], rtol=1e-5)


def test_ssh_killed_process_stops_the_others(sshd, tmp_path):
    """~55 s. SIGKILL to process 1 (started by sshd) mid-run: ssh.sh exits non-zero
    within 60 s, saying which process failed and that it stopped the other, and no
    process of the run is left."""
    proc = _ssh_launch(sshd, tmp_path, ENDLESS)
    try:
        killed_at = _kill_process(tmp_path / "run", "HETJAX_PROCESS_ID", "1")
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert time.monotonic() - killed_at < 60
    assert proc.returncode != 0
    assert "launch/ssh.sh: process 1 (localhost) failed (" in err, err[-3000:]
    assert "; stopping the other 1" in err, err[-3000:]
    _wait_for(lambda: not _hetjax_processes(str(tmp_path / "run")), 30, "every process gone")
