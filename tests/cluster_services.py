"""A one-node SLURM cluster (munged, slurmctld, slurmd) and an sshd on localhost, for
the tests that run ``launch/slurm.sh`` and ``launch/ssh.sh`` against the real things
(tests/test_launch_cluster.py).

Each service runs in the foreground of a process this module starts, with every file it
writes (configuration, keys, state, logs, pid files, sockets) in a folder of its own, on
ports picked free at start; :meth:`stop` ends those processes (by their pids) and
nothing else. The system's own configuration is not read or changed: the SLURM commands
find the cluster through ``SLURM_CONF`` (:meth:`Slurm.env`), ssh through ``-F`` and the
options of :meth:`Sshd.ssh_options`. Outside the folders, sshd needs its privilege
separation directory, ``/run/sshd``, which is made if missing.

Missing programs are installed with apt-get (Debian packages ``slurm-wlm``, ``munge``,
``openssh-server``, ``openssh-client``; 7 s on the 2-core Debian 12 development
machine, 15 s with it loaded, package lists fresh), which needs root:
:func:`missing_prerequisite` says what is missing where that cannot be done.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "openssh-server", "openssh-client")
PROGRAMS = {  # program -> the Debian package that has it
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "srun": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "scancel": "slurm-wlm",
    "sinfo": "slurm-wlm",
    "squeue": "slurm-wlm",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
}
SBIN = ("/usr/sbin", "/sbin")  # munged, slurmd, sshd: often not on a non-root PATH


def which(program: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return shutil.which(program, path=path)


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if which(p) is None]


def missing_prerequisite() -> str | None:
    """None when the services can run here (the programs are installed, or can be: root
    with apt-get); else what is missing and how to get it, for a skip or a CI failure."""
    missing = missing_programs()
    if not missing:
        return None
    packages = " ".join(sorted({PROGRAMS[p] for p in missing}))
    if os.geteuid() != 0:
        return f"{', '.join(missing)} (as root: apt-get install {packages}; not root here)"
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} (Debian packages {packages}; no apt-get here)"
    return None


def install() -> float:
    """Installs the missing packages with apt-get (root); the seconds it took (0 when
    nothing was missing). Raises with apt-get's output when it fails."""
    if not missing_programs():
        return 0.0
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # stale package lists: update them once and retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0 or missing_programs():
        raise RuntimeError(
            f"apt-get install {' '.join(PACKAGES)} failed:\n{out.stdout}{out.stderr}"
        )
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} not ready within {timeout} s\n{tail}")
        time.sleep(0.2)


class _Daemons:
    """Processes started in the foreground, stopped (SIGTERM, then SIGKILL) by pid."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()


class Slurm(_Daemons):
    """A one-node SLURM cluster: munged, slurmctld and slurmd on this machine, with
    ``cpus`` CPUs in one partition (``debug``), no accounting, no cgroups."""

    def __init__(self, root: Path, cpus: int = 2):
        super().__init__(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"

    def env(self, base: dict | None = None) -> dict[str, str]:
        """``base`` (default: this environment) with ``SLURM_CONF`` set: the SLURM
        commands then use this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def start(self) -> Slurm:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.spawn(
            [which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
             f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
            munge / "munged.out",
        )  # fmt: skip
        _wait(self.munge_socket.exists, 30, "munged", munge / "munged.log")
        for d in ("state", "spool"):
            (self.root / d).mkdir(exist_ok=True)
        ctld_port, slurmd_port = free_port(), free_port()
        user = getpass.getuser()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=hetjaxtest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    f"SlurmUser={user}",
                    f"SlurmdUser={user}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd.log'}",
                    "ProctrackType=proctrack/pgid",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    "KillWait=10",
                    "MinJobAge=600",  # a finished job's record (its exit code) stays 10 min
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        env = self.env()
        self.spawn(
            [which("slurmctld"), "-D", "-i", "-f", str(self.conf)], self.root / "slurmctld.out", env
        )
        self.spawn(
            [which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node],
            self.root / "slurmd.out",
            env,
        )
        _wait(self._node_ready, 60, "slurmd (node idle)", self.root / "slurmctld.log")
        return self

    def stop(self) -> None:
        """Cancels this cluster's jobs that are left (a failed test's), waits up to 30 s
        for their processes to end, then stops the daemons."""
        if self.processes and self.conf.exists():
            env, squeue = self.env(), [which("squeue"), "-h", "-o", "%i"]
            jobs = subprocess.run(squeue, env=env, capture_output=True, text=True).stdout.split()
            if jobs:
                subprocess.run([which("scancel"), "--signal=KILL", "--full", *jobs], env=env)
                deadline = time.monotonic() + 30
                while (
                    time.monotonic() < deadline
                    and subprocess.run(
                        squeue, env=env, capture_output=True, text=True
                    ).stdout.split()
                ):
                    time.sleep(0.5)
        super().stop()

    def _node_ready(self) -> bool:
        out = subprocess.run(
            [which("sinfo"), "-h", "-N", "-o", "%T"],
            env=self.env(), capture_output=True, text=True,
        )  # fmt: skip
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...) of a job."""
        out = subprocess.run(
            [which("scontrol"), "show", "job", "-o", job_id],
            env=self.env(), capture_output=True, text=True, check=True,
        )  # fmt: skip
        fields = {}
        for item in out.stdout.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Waits until the job has ended; its fields."""
        end = (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "PREEMPTED",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        )
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in end:
                return fields
            if time.monotonic() > deadline:
                subprocess.run([which("scancel"), job_id], env=self.env())
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(1)


class Sshd(_Daemons):
    """An sshd on 127.0.0.1 at a free port that lets this user in with a key of its own;
    :meth:`ssh_options` are the ssh client options that reach it."""

    def start(self) -> Sshd:
        keygen = which("ssh-keygen")
        for name in ("host_key", "client_key"):
            subprocess.run(
                [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / name)], check=True
            )
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        self.port = free_port()
        (self.root / "sshd_config").write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.root / 'host_key'}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",  # the keys live in a temporary folder
                    "",
                ]
            )
        )
        (self.root / "ssh_config").write_text(
            "\n".join(
                [
                    "Host *",
                    "  HostName 127.0.0.1",
                    f"  Port {self.port}",
                    f"  IdentityFile {self.root / 'client_key'}",
                    "  IdentitiesOnly yes",
                    "  BatchMode yes",
                    "  StrictHostKeyChecking no",
                    f"  UserKnownHostsFile {self.root / 'known_hosts'}",
                    "  LogLevel ERROR",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation
        self.spawn(
            [which("sshd"), "-D", "-e", "-f", str(self.root / "sshd_config")],
            self.root / "sshd.log",
        )
        _wait(self._accepts, 30, "sshd", self.root / "sshd.log")
        return self

    def ssh_options(self) -> str:
        return f"-F {self.root / 'ssh_config'}"

    def _accepts(self) -> bool:
        out = subprocess.run(
            [which("ssh"), *self.ssh_options().split(), "localhost", "true"],
            capture_output=True, timeout=30,
        )  # fmt: skip
        return out.returncode == 0
