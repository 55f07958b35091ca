"""Preemption, one run per directory, and checkpoint writes that fail part-way
(hetjax/preemption.py, hetjax/run_lock.py, the loop in hetjax/train.py,
hetjax/checkpoint.py).

As in tests/test_checkpoint.py, runs that are stopped run in a child process
(``python -m hetjax.launch``); ``HETJAX_FAULTS`` (``hetjax/faults.py``) sends the signal
while a chosen step runs, and a resumed run must end with exactly the losses and
params of an uninterrupted one."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require
from test_checkpoint import NVME, ROOT, config, launch, saved_params
from test_zero import _free_port, _launch_args, _spawn

from hetjax.checkpoint import Checkpointer
from hetjax.config import ConfigError
from hetjax.preemption import PREEMPTED_EXIT_STATUS, StopSignals
from hetjax.run_lock import LOCK_NAME, RunLocks
from hetjax.train import train

# Inodes of the small tmpfs in the write-failure test. Measured: checkpoint 2 (and the
# writer's temporary files) fails to fit in 30 and fits in 38; checkpoint 4 then fails
# in 38 to 50 and fits in 55. In between, with room to spare both ways:
TMPFS_INODES = 46


def require_unshare() -> None:
    works = (
        shutil.which("unshare") is not None
        and not subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode
    )
    require(
        works,
        "unshare -Urm (util-linux, with unprivileged user namespaces enabled: "
        "sysctl kernel.unprivileged_userns_clone=1) for a private tmpfs",
    )


def in_private_tmpfs(mnt: Path, options: str, script: str, timeout: float = 300) -> str:
    """Runs bash ``script`` with a tmpfs (mount ``options``) at ``mnt`` in a private
    mount namespace; returns its output. Past ``timeout`` it kills the lot and fails."""
    mnt.mkdir()
    proc = subprocess.Popen(
        ["unshare", "-Urm", "bash", "-c", f"mount -t tmpfs -o {options} tmpfs {mnt} && {script}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout} s: {proc.communicate()[0][-3000:]}")


def steps_logged(workdir: Path) -> list[int]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def start(cfg, workdir: Path) -> subprocess.Popen:
    """``python -m hetjax.launch`` in the background, output in ``<workdir>.log``."""
    args = [sys.executable, "-m", "hetjax.launch", "--workdir", str(workdir)]
    for section, fields in cfg.to_dict().items():
        args += [f"--config.{section}.{k}={v}" for k, v in fields.items()]
    log = open(f"{workdir}.log", "w")  # noqa: SIM115 (closed with the process)
    env = dict(os.environ, HETJAX_FAULTS="")
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, log: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        tail = Path(log).read_text()[-3000:]
        assert proc.poll() is None, tail  # it ended before getting there
        assert time.monotonic() < deadline, tail
        time.sleep(0.2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: in memory, never stopped; checkpoints at steps 2, 4 and 6."""
    workdir = tmp_path_factory.mktemp("ref")
    return train(config(), workdir, verbose=False), workdir


# -- preemption ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sig, offload",
    [
        ("SIGTERM", None),
        pytest.param("SIGUSR1", NVME, marks=pytest.mark.slow),
        # Ctrl-C: the same stop (its handler's own part is checked in the default run below)
        pytest.param("SIGINT", None, marks=pytest.mark.slow),
    ],
    ids=["sigterm", "sigusr1-stream-nvme", "sigint"],
)
def test_signal_stops_between_steps_with_a_checkpoint(sig, offload, uninterrupted, tmp_path):
    """The signal arrives while step 3 runs: step 3 finishes, step 4 never starts, a
    checkpoint of step 3 (periodic ones are at 2, 4, 6) is complete when the process
    exits with the preempted status, and resuming ends exactly like the run never
    stopped."""
    cfg = config(offload)
    proc = launch(cfg, tmp_path, faults=f"{sig.lower()}@3", expect_rc=PREEMPTED_EXIT_STATUS)
    out = proc.stdout + proc.stderr
    assert f"preempted ({sig}) at step 3: checkpoint of step 3 complete" in out, out[-3000:]
    assert f"{sig}: stopped at step 3; its checkpoint is complete, " in proc.stdout
    assert steps_logged(tmp_path) == [1, 2, 3]
    assert saved_params(tmp_path)[1]["step"] == 3
    if offload is None:
        reference = uninterrupted[0]
    else:
        reference = train(cfg, tmp_path / "ref", verbose=False)
    resumed = train(cfg, tmp_path, verbose=False)
    np.testing.assert_array_equal(resumed.losses, reference.losses[3:])
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)


CTRL_C = """
import os, signal, sys, time
from hetjax.preemption import StopSignals
with StopSignals() as stop:
    print(signal.getsignal(signal.SIGINT) is not signal.default_int_handler, flush=True)
    while stop.received is None:  # a step in flight
        time.sleep(0.01)
    print(stop.received, signal.getsignal(signal.SIGINT) is signal.SIG_DFL, flush=True)
    if sys.argv[1:] == ["once"]:
        sys.exit(0)
    time.sleep(60)  # the checkpoint being written, when the second Ctrl-C comes
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_is_a_preemption_and_a_second_stops_at_once(presses):
    """Ctrl-C (SIGINT) is recorded like SIGTERM, with a line on stderr saying so and
    what a second does; the second ends the process at once, by the signal (the
    status a shell shows as 130), without a traceback. (The whole stop, checkpoint and
    exact resume: test_signal_stops_between_steps_with_a_checkpoint[sigint].)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, "once" if presses == 1 else "twice"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "True\n"  # the handler is installed
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "SIGINT True\n"  # recorded; the next one ends it
        if presses == 2:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == (0 if presses == 1 else -signal.SIGINT), err
    assert "Traceback" not in err
    note = [line for line in err.splitlines() if line.strip()]
    assert len(note) == 1 and "Ctrl-C again stops at once" in note[0], err
    assert f"exit status {PREEMPTED_EXIT_STATUS}" in note[0]


def test_ignored_ctrl_c_stays_ignored():
    """A process started with SIGINT ignored (a script's background job) keeps it so."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow  # one more child process; the test above sends the signal from inside
def test_sigterm_from_outside_checkpoints_the_step_reached(tmp_path):
    """SIGTERM from another process at whatever step the run has reached (no periodic
    checkpoints: the one found is the preemption's)."""
    cfg = config(train=dict(steps=100_000, eval_batches=0), checkpoint=dict(every_steps=0))
    run = start(cfg, tmp_path / "run")
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(
            lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3,
            run,
            f"{tmp_path / 'run'}.log",
        )
        run.send_signal(signal.SIGTERM)
        rc = run.wait(timeout=120)  # the bound is a step and two checkpoint writes
    finally:
        run.kill()
    log = (tmp_path / "run.log").read_text()
    assert rc == PREEMPTED_EXIT_STATUS, log[-3000:]
    reached = steps_logged(tmp_path / "run")[-1]
    assert f"preempted (SIGTERM) at step {reached}: checkpoint of step {reached}" in log
    assert saved_params(tmp_path / "run")[1]["step"] == reached


@pytest.mark.slow  # two processes compile everything anew
def test_processes_stop_together_when_one_is_signalled(tmp_path, monkeypatch):
    """Two processes training one model (ZeRO-3 over gloo); only process 1 gets SIGTERM,
    while step 3 runs. The flags are combined between steps, so both stop after step 3
    with the preempted status and one checkpoint of step 3."""
    port = _free_port()
    args = _launch_args(tmp_path, "train.steps=6", "checkpoint.at_end=true")
    procs = []
    for k, faults in ((0, ""), (1, "sigterm@3")):
        monkeypatch.setenv("HETJAX_FAULTS", faults)
        procs.append(_spawn(args, k, port, tmp_path / f"log{k}"))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"log{k}").read_text() for k in (0, 1)]
    assert codes == [PREEMPTED_EXIT_STATUS] * 2, [log[-3000:] for log in logs]
    assert "a signal to another process: stopped at step 3; its checkpoint is" in logs[0]
    assert "preempted (SIGTERM) at step 3: checkpoint of step 3 complete" in logs[1]
    assert steps_logged(tmp_path) == [1, 2, 3]
    assert saved_params(tmp_path)[1]["step"] == 3


def test_checkpoint_every_minutes(tmp_path):
    """A checkpoint by time, between steps: with a limit of 60 us every step outlasts
    it, so each step but the last is saved (periodic and final checkpoints are off)."""
    cfg = config(
        train=dict(steps=3, eval_batches=0),
        checkpoint=dict(every_steps=0, every_minutes=1e-6, at_end=False, keep=10),
    )
    train(cfg, tmp_path, verbose=False)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    try:
        assert ckpt.steps() == [1, 2]
    finally:
        ckpt.close()


# -- one run per directory ----------------------------------------------------------------


HOLD = (
    "import sys, time; from hetjax.run_lock import RunLocks; locks = RunLocks(); "
    "locks.hold(sys.argv[1], 'workdir ' + sys.argv[1], 'use another --workdir'); "
    "print('held', flush=True); time.sleep(600)"
)


def test_run_lock_names_a_live_holder_and_passes_from_a_dead_one(tmp_path):
    """A lock held by a live process refuses with its host, pid and start time; once
    that process is SIGKILLed the lock is free and its stale record is overwritten."""
    what = f"workdir {tmp_path}"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        named = (
            rf"{re.escape(what)} is in use by another run \(host {re.escape(socket.gethostname())}"
            rf", pid {holder.pid}, started \d{{4}}-\d\d-\d\dT.*; lock file "
            rf"{re.escape(str(tmp_path / LOCK_NAME))}\).* or use another --workdir"
        )
        with pytest.raises(ConfigError, match=named):
            RunLocks().hold(tmp_path, what, "use another --workdir")
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid  # stale
    with RunLocks() as locks:
        locks.hold(tmp_path, what, "use another --workdir")
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: no holder recorded


@pytest.mark.slow  # ~14 s (the default run's time, 2026-11-27)
def test_second_run_refused_while_the_first_lives_then_resumes(tmp_path):
    """A run holds its workdir and its memory.nvme_path: a second run on either refuses
    at once naming the holder, --overwrite (checkpoint.overwrite) included. After the
    holder is SIGKILLed, a new run takes the lock and resumes from its checkpoint.
    (offload.mode=auto may place state under memory.nvme_path, so it is locked; the tiny
    model then trains in memory.)"""
    ssd = tmp_path / "ssd"
    cfg = config(memory=dict(nvme_path=str(ssd)), train=dict(steps=100_000, eval_batches=0))
    assert cfg.offload.mode == "auto"
    first = start(cfg, tmp_path / "a")
    try:
        # a checkpoint saved (any: at a few ms a step, older ones are rotated away between
        # two looks, so waiting for step 2's could wait forever)
        saved = lambda: any(p.name.isdigit() for p in (tmp_path / "a" / "checkpoints").glob("*"))
        wait_for(saved, first, f"{tmp_path}/a.log")
        holder = rf"\(host {re.escape(socket.gethostname())}, pid {first.pid}, started "
        busy = rf"workdir {re.escape(str(tmp_path / 'a'))} is in use by another run {holder}"
        with pytest.raises(ConfigError, match=busy):
            train(cfg, tmp_path / "a", verbose=False)
        overwrite = cfg.replace(checkpoint=dict(resume="never", overwrite=True))
        with pytest.raises(ConfigError, match=busy + ".*--overwrite does not take over"):
            train(overwrite, tmp_path / "a", verbose=False)
        busy = rf"memory.nvme_path {re.escape(str(ssd))} is in use by another run {holder}"
        with pytest.raises(ConfigError, match=busy + ".*point memory.nvme_path at another"):
            train(cfg, tmp_path / "b", verbose=False)
    finally:
        first.kill()
        first.wait()
    reached = saved_params(tmp_path / "a")[1]["step"]
    longer = cfg.replace(train=dict(steps=reached + 2))
    assert len(train(longer, tmp_path / "a", verbose=False).losses) == 2  # resumed


# -- a checkpoint write failing part-way --------------------------------------------------


@pytest.mark.slow  # ~13 s (the default run's time, 2026-11-27)
def test_write_failing_part_way_keeps_the_earlier_checkpoint(uninterrupted, tmp_path):
    """A real disk-full error in the middle of a checkpoint's write, after the free-space
    check passed: a tmpfs with megabytes to spare but few inodes (``nr_inodes``), in a
    private mount namespace (``unshare -Urm``), runs out part-way through a checkpoint
    (usually 4's; orbax's file count varies a little with timing, so it may be 6's). The
    run stops with that write's error, not the free-space refusal, the checkpoints before
    it are listed complete, and the newest restores equal to the uninterrupted run's."""
    require_unshare()
    mnt, copy = tmp_path / "small", tmp_path / "copy"
    cfg = config(checkpoint=dict(dir=str(mnt), keep=10))
    args = " ".join(
        f"'--config.{s}.{k}={v}'" for s, f in cfg.to_dict().items() for k, v in f.items()
    )
    script = (
        f"{sys.executable} -m hetjax.launch --workdir {tmp_path / 'run'} {args}; "
        f"echo rc=$?; {sys.executable} -m hetjax.checkpoint --workdir x --dir {mnt}; "
        f"cp -a {mnt} {copy}"  # the tmpfs goes with the namespace
    )
    out = in_private_tmpfs(mnt, f"size=64m,nr_inodes={TMPFS_INODES}", script)
    assert "rc=1" in out, out[-3000:]
    assert "not enough space" not in out, out[-3000:]  # the free-space check passed
    failed = re.search(
        r"writing the checkpoint of step (\d) to \S+ failed \(No space left on device\); "
        r"the checkpoints already complete there are intact",
        out,
    )
    assert failed and int(failed[1]) in (4, 6), out[-3000:]
    complete = list(range(2, int(failed[1]), 2))  # every_steps=2
    assert f"complete checkpoints at steps {complete}" in out, out[-3000:]  # on the full disk
    ckpt = Checkpointer(copy)  # removes the partial checkpoint, as the next run would
    try:
        assert ckpt.steps() == complete
        saved, meta = ckpt.restore(complete[-1])
    finally:
        ckpt.close()
    reference, _ = saved_params(uninterrupted[1], complete[-1])
    assert meta["step"] == complete[-1]
    jax.tree.map(np.testing.assert_array_equal, saved.stages, reference.stages)


SAVE_ON_A_FULL_DISK = """
import os, sys
import numpy as np
from hetjax.checkpoint import Checkpointer
from hetjax.types import CheckpointError, RuntimeState

directory = sys.argv[1]
tree = {"w": np.ones((64, 8), np.float32)}
state = RuntimeState({"embed": {"master": tree}}, {"embed": [np.zeros((), np.int32)]})
ckpt = Checkpointer(directory, keep=10)
ckpt.save(2, state, {"step": 2})
ckpt.wait()
try:  # use up the inodes: checkpoint 4 cannot even make its directories
    for n in range(10**6):
        open(os.path.join(directory, f"filler{n}"), "w").close()
except OSError:
    pass
try:
    ckpt.save(4, state, {"step": 4})
    ckpt.wait()
except CheckpointError as e:
    print(e)
ckpt.close()
"""


def test_failed_write_does_not_hold_up_the_exit(tmp_path):
    """When a checkpoint cannot even make its directories, the error comes at once and
    the process exits: orbax's background threads would otherwise wait 300 s for those
    directories (hence ``create_directories_asynchronously=False``)."""
    require_unshare()
    mnt = tmp_path / "small"
    script = f"{sys.executable} -c '{SAVE_ON_A_FULL_DISK}' {mnt}; echo rc=$?"
    out = in_private_tmpfs(mnt, "size=64m,nr_inodes=200", script, timeout=120)
    assert "writing the checkpoint of step 4" in out and "(No space left on device)" in out, out
    assert "rc=0" in out, out[-3000:]
