"""One run per directory: an advisory lock held for the whole run.

Two runs on one workdir would write over each other's checkpoints, metrics and NVMe
state; two on one ``memory.nvme_path`` over each other's optimizer state. A run holds
an exclusive ``fcntl.flock`` on ``<dir>/hetjax.lock`` in each directory it writes (its
workdir, and ``memory.nvme_path`` when it places state there) from start-up to exit,
and writes who it is into the file: host, pid, start time, command line. A second run
refuses at once with a :class:`~hetjax.config.ConfigError` naming the directory and
that holder; ``--overwrite`` does not get past a live holder.

The kernel drops a flock when the process holding it dies, however it dies (SIGKILL,
out of memory, a node reboot for local disks), so a lock left by a dead run is simply
taken by the next one, which overwrites the stale holder in the file. The file itself
is never deleted (deleting a lock file races with a run opening it). On network file
systems the lock is as good as their flock: NFSv4 and Lustre mounted with ``-o flock``
honour it across hosts; where the file system refuses locks, the run goes on unlocked
and says so.

This module imports nothing else from hetjax but the config errors.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hetjax.config_values import ConfigError

LOCK_NAME = "hetjax.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLocks:
    """Exclusive locks on directories, held until :meth:`release` (or the process
    ends). Use as a context manager."""

    def __init__(self):
        self._held: dict[str, int] = {}  # real path of the lock file -> its descriptor
        self.started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")

    def hold(self, directory: str | Path, what: str, fix: str, name: str = LOCK_NAME) -> None:
        """Locks ``directory`` (creating it) for this run; ``what`` names it in errors
        (e.g. ``workdir runs/x``), ``fix`` says what to do instead. Raises ConfigError
        when another live process holds it. Where the file system does not support
        locks, says so on stderr and goes on unlocked."""
        directory = Path(directory)
        path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            key = os.path.realpath(path)
            if key in self._held:  # the same directory under two names (flock would refuse)
                return
            fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(
                f"{what}: cannot create the lock file {path} ({e.strerror}); {fix}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            holder = _read_holder(fd) if busy else ""
            os.close(fd)
            if not busy and e.errno in _UNSUPPORTED:
                print(
                    f"hetjax: warning: {what}: the file system does not support locks "
                    f"({e.strerror}); nothing stops a second run from using it too",
                    file=sys.stderr,
                )
                return
            if not busy:
                raise ConfigError(f"{what}: cannot lock {path} ({e.strerror}); {fix}") from None
            raise ConfigError(
                f"{what} is in use by another run ({holder or 'holder not recorded'}; lock "
                f"file {path}): two runs in one directory would overwrite each other's state. "
                f"Wait for that run to end or stop it, or {fix}. --overwrite does not take "
                "over a directory a live run holds"
            ) from None
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started,
            "command": " ".join(sys.argv),
        }
        data = (json.dumps(me) + "\n").encode()
        os.ftruncate(fd, 0)  # a dead holder's record goes
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._held[key] = fd

    def release(self) -> None:
        """Clears the holder records and drops every lock."""
        for fd in self._held.values():
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # drops the flock
        self._held.clear()

    def __enter__(self) -> RunLocks:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """``host H, pid P, started T`` from a held lock file. The holder writes its record
    right after taking the lock, so an empty file is read again for up to a second."""
    for _ in range(20):
        raw = os.pread(fd, 4096, 0)
        if raw.strip():
            break
        time.sleep(0.05)
    try:
        rec = json.loads(raw)
        return f"host {rec['host']}, pid {rec['pid']}, started {rec['started']}"
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace").strip()
