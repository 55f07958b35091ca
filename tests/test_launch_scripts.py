"""launch/*.sh: every script parses (``bash -n``), and each, run as
docs/guide/distributed.md shows it with ``srun``, ``ssh`` and the Python it starts
replaced by recording shims, starts the processes the docs promise: how many, the
coordinator's address, each one's process id, and ``python -m hetjax.launch`` with the
user's arguments (quoted through ssh's remote shell). A failing process stops the
others (local.sh, ssh.sh; SIGKILL for those that ignore SIGTERM), and --max-restarts
starts them all again; a failing SLURM task cancels its job step. No SLURM or sshd is
needed: the runs against the real things are tests/test_launch_cluster.py's, local.sh's
real two-process run tests/test_readme.py's, a real restart tests/test_launch_restarts.py's.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetjax.config import DistributedConfig
from hetjax.distributed import process_group

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
# the docs' arguments, and one with a space and a '$' that ssh's remote shell must not split
USER_ARGS = [
    "--config", "gpt1p3b", "--config.offload.mode=stream",
    "--config.distributed.data_parallel=0", "--workdir", "runs/a b$HOME",
]  # fmt: skip

# Stands in for `python`: records how it was called (argv[0]), its arguments, working
# directory and the process-group variables into $LAUNCH_RECORD/python.<pid>.json. With
# FAKE_FAIL_PROCESS=k, process k exits FAKE_FAIL_STATUS (default 3) once every process
# has recorded itself, saying why on stderr as a Python without JAX would (but not with
# 75, preempted), and the
# others run until they are stopped (SIGTERM, or their ssh shim killed: a real ssh -tt
# session's remote process gets SIGHUP then), leaving stopped.<process id>; they give up
# after 60 s. With FAKE_FAIL_ONCE set too, only the first start fails: once process k
# has failed (it leaves failed.<k>), every process started later succeeds. With
# FAKE_STUCK, the others ignore SIGTERM (as one stuck in a collective with a dead peer);
# with FAKE_TERM_STATUS, SIGTERM makes them exit with it (default 143).
RECORDER = """#!{python}
import json, os, signal, sys, time

record = os.environ["LAUNCH_RECORD"]
me = os.environ.get("HETJAX_PROCESS_ID")


def stopped(*_):
    open(os.path.join(record, f"stopped.{{me}}"), "w").close()
    sys.exit(int(os.environ.get("FAKE_TERM_STATUS", "143")))


# the handlers go in before this process records itself: a failing process waits for
# every record and then its launcher stops the others at once
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_STUCK") else stopped)
signal.signal(signal.SIGHUP, stopped)
fail = os.environ.get("FAKE_FAIL_PROCESS")
# a restart is a start after the failure, seen before recording: the failing process
# waits for this record, so a first start cannot see its failure yet
restart = fail is not None and os.path.exists(os.path.join(record, f"failed.{{fail}}"))
env = {{k: v for k, v in os.environ.items() if k.startswith(("HETJAX_", "SLURM_"))}}
env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS")
with open(os.path.join(record, f"python.{{os.getpid()}}.json"), "w") as f:
    json.dump(dict(exe=sys.argv[0], argv=sys.argv[1:], cwd=os.getcwd(), env=env), f)
if fail is None or (os.environ.get("FAKE_FAIL_ONCE") and restart):
    sys.exit(0)
n = int(os.environ["HETJAX_NUM_PROCESSES"])
deadline = time.monotonic() + 60
if me == fail:
    # fail once this start's n processes have all recorded (every start's n: a restart's
    # others would otherwise be stopped before they record)
    starts = 1 + sum(p.startswith(f"failed.{{me}}.") for p in os.listdir(record))
    while sum(p.startswith("python.") for p in os.listdir(record)) < n * starts:
        time.sleep(0.05)
    open(os.path.join(record, f"failed.{{me}}"), "w").close()
    open(os.path.join(record, f"failed.{{me}}.{{os.getpid()}}"), "w").close()
    status = int(os.environ.get("FAKE_FAIL_STATUS", "3"))
    if status != 75:  # (75: preempted, nothing wrong)
        cause = "ModuleNotFoundError: No module named 'jax'"
        print("Traceback ...", cause, sep="\\n", file=sys.stderr)
    sys.exit(status)

parent = os.getppid()
while time.monotonic() < deadline:
    if os.getppid() != parent:
        stopped()
    time.sleep(0.05)
"""

# ssh HOST COMMAND: records its arguments into $LAUNCH_RECORD/ssh.<pid>, then runs the
# remote command here as sshd does, in a shell (ssh joins its arguments with spaces).
SSH = """#!/usr/bin/env bash
printf '%s\\0' "$@" >"$LAUNCH_RECORD/ssh.$$"
[[ $1 == -tt ]] && shift
shift  # the host
exec bash -c "$*"
"""

# srun [OPTIONS] COMMAND...: records its arguments and its pid, then, as srun does, runs
# COMMAND once per task with SLURM_PROCID set and the step's node list.
SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" >"$LAUNCH_RECORD/srun"
echo $$ >"$LAUNCH_RECORD/srun.pid"
while [[ $1 == -* ]]; do shift; done
export SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_ID=0
for ((k = 0; k < SLURM_NTASKS; k++)); do
  SLURM_PROCID=$k "$@" || exit
done
"""

# scancel ARGS: records them into $LAUNCH_RECORD/scancel.
SCANCEL = """#!/usr/bin/env bash
printf '%s\\0' "$@" >"$LAUNCH_RECORD/scancel"
"""


@pytest.mark.parametrize("script", sorted(p.name for p in LAUNCH.glob("*.sh")))
def test_launch_script_parses(script):
    out = subprocess.run(["bash", "-n", LAUNCH / script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_documented_script_is_parsed():
    assert {p.name for p in LAUNCH.glob("*.sh")} >= {"common.sh", "local.sh", "slurm.sh", "ssh.sh"}


def _shims(tmp_path: Path) -> tuple[Path, Path]:
    """A bin folder with `ssh`, `srun` and `python3` shims, and the record folder."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in (("ssh", SSH), ("srun", SRUN), ("scancel", SCANCEL), ("python3", RECORDER)):
        text = text.format(python=sys.executable) if name == "python3" else text
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, record


def _env(bin_dir: Path, record: Path, **extra: str) -> dict[str, str]:
    """This environment without any process-group or XLA variable, the shims first on
    PATH."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETJAX_", "SLURM_"))
        and k not in ("XLA_FLAGS", "PYTHON", "VIRTUAL_ENV")
    }
    path = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"
    return {**base, "PATH": path, "LAUNCH_RECORD": str(record), **extra}


def _run(argv: list, env: dict, cwd: Path, timeout: float = 60) -> tuple[int, float, int]:
    """Runs a launch script: its exit status, seconds taken and pid."""
    start = time.monotonic()
    proc = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env)
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - start, proc.pid


def _pythons(record: Path) -> dict[int, dict]:
    """The recorded `python` processes by HETJAX_PROCESS_ID (or SLURM_PROCID)."""
    runs = [json.loads(p.read_text()) for p in record.glob("python.*.json")]
    key = lambda r: int(r["env"].get("HETJAX_PROCESS_ID", r["env"].get("SLURM_PROCID", -1)))
    by_id = {key(r): r for r in runs}
    assert len(by_id) == len(runs), runs  # no process id twice
    return by_id


def _argv(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def test_slurm_script_runs_one_launch_per_task(tmp_path):
    """slurm.sh as sbatch runs it on 4 nodes: it becomes srun (exec: SLURM's SIGUSR1 to
    the batch shell reaches srun, which forwards it), without --kill-on-bad-exit, and
    each task runs a bash wrapper that runs `python3 -m hetjax.launch ARGS`; hetjax
    reads 4 processes, task k's id k and the coordinator gpu07:12355 (the first node,
    the default port) off the variables it gets."""
    bin_dir, record = _shims(tmp_path)
    slurm = dict(SLURM_NTASKS="4", SLURM_JOB_NODELIST="gpu[07-09],login2", SLURM_JOB_ID="1")
    env = _env(bin_dir, record, **slurm)
    code, _, pid = _run([LAUNCH / "slurm.sh", *USER_ARGS], env, tmp_path)
    assert code == 0
    assert int((record / "srun.pid").read_text()) == pid  # exec'd
    srun = _argv(record / "srun")
    assert srun[:3] == ["--kill-on-bad-exit=0", "bash", "-c"]
    assert srun[4:] == ["python3", *USER_ARGS]  # the wrapper's $0 and arguments
    tasks = _pythons(record)
    assert sorted(tasks) == [0, 1, 2, 3]
    for k, task in tasks.items():
        assert task["argv"] == ["-m", "hetjax.launch", *USER_ARGS]
        assert task["env"]["HETJAX_COORDINATOR_PORT"] == "12355"
        group = process_group(DistributedConfig(), task["env"])
        assert (group.coordinator, group.num_processes, group.process_id) == ("gpu07:12355", 4, k)


def test_slurm_script_keeps_the_users_port(tmp_path):
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1,n2",
               HETJAX_COORDINATOR_PORT="23456")  # fmt: skip
    assert _run([LAUNCH / "slurm.sh", "--config", "gpt_tiny"], env, tmp_path)[0] == 0
    for task in _pythons(record).values():
        assert process_group(DistributedConfig(), task["env"]).coordinator == "n1:23456"


HOSTS = (
    "# the first host is process 0 and the coordinator\n"
    "node-a \t\n"  # trailing blanks
    "\n"
    "node-b\n"
    "   # an indented comment\n"
    "node-c"  # no newline at the end
)


def test_ssh_script_runs_one_launch_per_host(tmp_path):
    """ssh.sh over a host file with comments, a blank line and trailing blanks: one `ssh -tt HOST
    COMMAND` per host; the command, run by a shell as sshd runs it, changes to the
    repository (HETJAX_REMOTE_DIR, here with a space in it) and runs
    .venv/bin/python -m hetjax.launch with the user's arguments unchanged,
    HETJAX_COORDINATOR=node-a:12355, 3 processes and the host's line number among the
    hosts as its process id."""
    bin_dir, record = _shims(tmp_path)
    remote = tmp_path / "remote repo"
    (remote / ".venv" / "bin").mkdir(parents=True)
    (remote / ".venv" / "bin" / "python").symlink_to(bin_dir / "python3")
    (tmp_path / "hosts.txt").write_text(HOSTS)
    env = _env(bin_dir, record, HETJAX_REMOTE_DIR=str(remote))
    code, _, _ = _run([LAUNCH / "ssh.sh", tmp_path / "hosts.txt", *USER_ARGS], env, tmp_path)
    assert code == 0
    hosts = ["node-a", "node-b", "node-c"]
    assert sorted(_argv(p)[:2] for p in record.glob("ssh.*")) == [["-tt", h] for h in hosts]
    processes = _pythons(record)
    assert sorted(processes) == [0, 1, 2]
    for k, process in processes.items():
        assert process["argv"] == ["-m", "hetjax.launch", *USER_ARGS]
        assert process["cwd"] == str(remote)
        assert process["env"]["HETJAX_COORDINATOR"] == "node-a:12355"
        assert process["env"]["HETJAX_NUM_PROCESSES"] == "3"
        assert process["env"]["HETJAX_PROCESS_ID"] == str(k)
    ssh_by_host = {_argv(p)[1]: _argv(p)[2] for p in record.glob("ssh.*")}
    assert all(f"HETJAX_PROCESS_ID={k}" in ssh_by_host[h] for k, h in enumerate(hosts))


def test_ssh_script_refuses_a_host_file_without_hosts(tmp_path):
    bin_dir, record = _shims(tmp_path)
    (tmp_path / "hosts.txt").write_text("# none yet\n\n")
    out = subprocess.run(
        [LAUNCH / "ssh.sh", tmp_path / "hosts.txt", "--config", "gpt_tiny"],
        env=_env(bin_dir, record), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "no hosts" in out.stderr, out.stderr
    assert not list(record.iterdir())


def _repository(tmp_path: Path, bin_dir: Path, venv: bool) -> Path:
    """A copy of the repository's launch scripts, with a ``.venv/bin/python`` (the
    recording shim) when ``venv``, as the README's set-up makes one."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    for script in LAUNCH.glob("*.sh"):
        (repo / "launch" / script.name).write_bytes(script.read_bytes())
        (repo / "launch" / script.name).chmod(0o755)
    if venv:
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").symlink_to(bin_dir / "python3")
    return repo


@pytest.mark.parametrize("venv", [True, False])
def test_local_script_runs_n_processes_on_this_machine(tmp_path, venv):
    """local.sh 3 with HETJAX_DEVICES_PER_PROCESS=2 and no XLA_FLAGS: three processes
    with ids 0-2, the coordinator localhost:HETJAX_PORT, 2 virtual CPU devices each
    (XLA_FLAGS), the user's arguments; processes 1 and 2 log to <workdir>/proc<k>.log.
    Without PYTHON each runs the repository's .venv/bin/python where there is one (a
    fresh machine's python3 has no JAX), else python3."""
    bin_dir, record = _shims(tmp_path)
    repo = _repository(tmp_path, bin_dir, venv)
    env = _env(bin_dir, record, HETJAX_DEVICES_PER_PROCESS="2", HETJAX_PORT="23457")
    args = ["--workdir", "runs/w", "--config.offload.mode=stream"]
    assert _run([repo / "launch" / "local.sh", "3", *args], env, tmp_path)[0] == 0
    processes = _pythons(record)
    assert sorted(processes) == [0, 1, 2]
    python = f"{repo}/launch/../.venv/bin/python" if venv else str(bin_dir / "python3")
    for process in processes.values():
        assert process["exe"] == python
        assert process["argv"] == ["-m", "hetjax.launch", *args]
        assert process["env"]["HETJAX_COORDINATOR"] == "localhost:23457"
        assert process["env"]["HETJAX_NUM_PROCESSES"] == "3"
        assert process["env"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert sorted(p.name for p in (tmp_path / "runs" / "w").iterdir()) == ["proc1.log", "proc2.log"]


def test_slurm_script_runs_the_submit_directory_s_venv(tmp_path):
    """slurm.sh submitted from a directory with a .venv (sbatch runs a copy of the
    script there) runs its .venv/bin/python on every task."""
    bin_dir, record = _shims(tmp_path)
    repo = _repository(tmp_path, bin_dir, venv=True)
    env = _env(bin_dir, record, SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1,n2")
    assert _run([LAUNCH / "slurm.sh", "--config", "gpt_tiny"], env, repo)[0] == 0
    assert _argv(record / "srun")[4] == ".venv/bin/python"
    assert [p["exe"] for p in _pythons(record).values()] == [".venv/bin/python"] * 2


def test_a_failed_process_is_named_with_its_log(tmp_path):
    """Process 1 of 2 fails, its cause in its log (not on the terminal): local.sh names
    the log and shows its last lines, the cause among them."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="1", PYTHON=str(bin_dir / "python3"))
    out = subprocess.run(
        [LAUNCH / "local.sh", "2", "--workdir", "runs/w"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "launch/local.sh: process 1 failed (exit status 3)" in out.stderr, out.stderr
    assert "its output is in runs/w/proc1.log, which ends:\n" in out.stderr, out.stderr
    assert "    ModuleNotFoundError: No module named 'jax'\n" in out.stderr, out.stderr


@pytest.mark.parametrize("script", ["local.sh", "ssh.sh"])
def test_one_failed_process_stops_the_others(tmp_path, script):
    """Process 1 of 3 exits 3 while the others run on (they would for 60 s): the script
    exits 3 within seconds and every other process is stopped."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="1", PYTHON=str(bin_dir / "python3"))
    if script == "local.sh":
        argv = [LAUNCH / "local.sh", "3", "--workdir", tmp_path / "run"]
    else:
        (tmp_path / "hosts.txt").write_text("a\nb\nc\n")
        argv = [LAUNCH / "ssh.sh", tmp_path / "hosts.txt", "--config", "gpt_tiny"]
    code, seconds, _ = _run(argv, env, tmp_path, timeout=120)
    assert code == 3 and seconds < 30, (code, seconds)
    deadline = time.monotonic() + 10
    while len(list(record.glob("stopped.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(p.name for p in record.glob("stopped.*")) == ["stopped.0", "stopped.2"]


@pytest.mark.parametrize("status", [3, 75])
def test_slurm_task_that_fails_cancels_the_step(tmp_path, status):
    """A task whose hetjax exits 3 says so and cancels the job step (scancel
    --signal=KILL JOB.STEP), so the other tasks end at once; one that exits 75
    (preempted: the others stop at the same step) cancels nothing. Either way the task
    exits with hetjax's status."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, SLURM_NTASKS="1", SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="42",
               FAKE_FAIL_PROCESS="0", FAKE_FAIL_STATUS=str(status),
               HETJAX_PROCESS_ID="0", HETJAX_NUM_PROCESSES="1")  # fmt: skip
    out = subprocess.run(
        [LAUNCH / "slurm.sh", "--config", "gpt_tiny"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == status, out.stderr
    if status == 75:
        assert not (record / "scancel").exists() and not out.stderr, out.stderr
    else:
        assert _argv(record / "scancel") == ["--signal=KILL", "42.0"]
        assert "launch/slurm.sh: task 0 on " in out.stderr, out.stderr
        assert "failed (exit status 3); ending the other tasks" in out.stderr, out.stderr


def _launch(script: str, tmp_path: Path, bin_dir: Path, *options: str) -> list:
    """local.sh or ssh.sh (over hosts a, b, c) for 3 processes, with ``options``."""
    if script == "local.sh":
        return [LAUNCH / "local.sh", "3", *options, "--workdir", tmp_path / "run"]
    (tmp_path / "hosts.txt").write_text("a\nb\nc\n")
    return [LAUNCH / "ssh.sh", tmp_path / "hosts.txt", *options, "--config", "gpt_tiny"]


@pytest.mark.parametrize("script", ["local.sh", "ssh.sh"])
def test_max_restarts_starts_every_process_again(tmp_path, script):
    """--max-restarts 2, process 1 of 3 failing (exit 3) at its first start only: the
    others are stopped, the script says it restarts, starts all three again (each
    process id twice, the same arguments, without --max-restarts) and exits 0."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="1", FAKE_FAIL_ONCE="1",
               PYTHON=str(bin_dir / "python3"))  # fmt: skip
    argv = _launch(script, tmp_path, bin_dir, "--max-restarts", "2")
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in record.glob("stopped.*")) == ["stopped.0", "stopped.2"]
    runs = [json.loads(p.read_text()) for p in record.glob("python.*.json")]
    assert sorted(int(r["env"]["HETJAX_PROCESS_ID"]) for r in runs) == [0, 0, 1, 1, 2, 2]
    assert all("--max-restarts" not in r["argv"] and "2" not in r["argv"] for r in runs)
    launcher = f"launch/{script}"
    assert f"{launcher}: process 1" in out.stderr, out.stderr
    assert "failed (exit status 3); stopping the other 2" in out.stderr, out.stderr
    assert f"{launcher}: restart 1 of 2: starting all 3 processes again" in out.stderr, out.stderr
    assert "restart 2" not in out.stderr, out.stderr


@pytest.mark.parametrize("status", [3, 2])
def test_max_restarts_gives_up(tmp_path, status):
    """Process 1 failing at every start: with --max-restarts=1 local.sh starts the
    processes twice, then exits with the failure's status 3; a bad config's status 2 is
    not restarted (it would fail alike)."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="1", FAKE_FAIL_STATUS=str(status),
               PYTHON=str(bin_dir / "python3"))  # fmt: skip
    argv = _launch("local.sh", tmp_path, bin_dir, "--max-restarts=1")
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == status, out.stderr
    starts = 2 if status == 3 else 1
    assert len(list(record.glob("python.*.json"))) == 3 * starts
    assert ("giving up: 1 restart(s) used" in out.stderr) == (status == 3), out.stderr


@pytest.mark.parametrize("value", ["x", "-1", ""])
def test_max_restarts_must_be_a_number(tmp_path, value):
    bin_dir, record = _shims(tmp_path)
    argv = _launch("local.sh", tmp_path, bin_dir, f"--max-restarts={value}")
    out = subprocess.run(argv, env=_env(bin_dir, record), cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "--max-restarts takes a number" in out.stderr, out.stderr
    assert not list(record.iterdir())


@pytest.mark.slow  # ~10 s: the grace period before SIGKILL
def test_processes_that_ignore_sigterm_are_killed(tmp_path):
    """Process 1 of 3 exits 3 and the others ignore SIGTERM (stuck, as in a collective
    with a dead peer): local.sh kills them (SIGKILL) 10 s after its SIGTERM and exits 3;
    none is left running."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="1", FAKE_STUCK="1",
               PYTHON=str(bin_dir / "python3"))  # fmt: skip
    code, seconds, _ = _run(_launch("local.sh", tmp_path, bin_dir), env, tmp_path, timeout=120)
    assert code == 3 and 10 <= seconds < 30, (code, seconds)
    assert not list(record.glob("stopped.*"))
    for path in record.glob("python.*.json"):
        pid = int(path.name.split(".")[1])
        assert not Path(f"/proc/{pid}").exists(), pid  # killed and reaped


def test_sigterm_to_local_sh_reaches_every_process_and_is_not_restarted(tmp_path):
    """SIGTERM to local.sh (a scheduler preempting it) while 3 processes run: each gets
    SIGTERM, checkpoints and exits 75 (as hetjax does; here the shim), and local.sh
    exits 75 once they have, without restarting them despite --max-restarts 2."""
    bin_dir, record = _shims(tmp_path)
    env = _env(bin_dir, record, FAKE_FAIL_PROCESS="-1", FAKE_TERM_STATUS="75",
               PYTHON=str(bin_dir / "python3"))  # fmt: skip
    argv = _launch("local.sh", tmp_path, bin_dir, "--max-restarts", "2")
    proc = subprocess.Popen([str(a) for a in argv], cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while len(list(record.glob("python.*.json"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert sorted(p.name for p in record.glob("stopped.*")) == [f"stopped.{k}" for k in range(3)]
    assert len(list(record.glob("python.*.json"))) == 3 and b"restart" not in err, err
