"""Fault injection for the crash and failure tests, from the environment:
``HETJAX_FAULTS="nan@3,kill_saving@4"``, a comma-separated list of ``<kind>@<step>``
with the kinds of :data:`KINDS`. Each fault fires once (a step redone after a rollback
runs clean).

The training loop (``train.py``) parses the list (:meth:`Faults.from_env`, the one
parsing place) and acts on its own faults (:meth:`Faults.hit`). The faults of
:data:`IN_RUNTIME` happen inside the runtime's own work, on whatever thread runs it (the
host optimizer loop, an NVMe write): the loop arms them at the start of their step
(:meth:`Faults.arm`) and the code where they happen fires them (:func:`fire`), like
``timeline``'s hooks: one global lookup when nothing is armed. This module imports
nothing from hetjax but the config's error type, so the storage layer can use it."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

from hetjax.config_values import ConfigError

KINDS = {
    "nan": "step N's gradients are NaN",
    "loss_spike": "step N's loss, as the loss-spike guard sees it, is 1000 times larger",
    "kill_mid_step": "SIGKILL while step N runs",
    "kill_mid_update": (
        "SIGKILL once the first stage the host optimizer updates in step N is written to "
        "NVMe (the tier then holds a step half written)"
    ),
    "kill_saving": "SIGKILL right after step N's checkpoint is handed to the background writer",
    "kill_saved": "SIGKILL once step N's checkpoint is complete",
    "sigterm": "SIGTERM while step N runs (from a timer thread, as a kill from outside arrives)",
    "sigusr1": "SIGUSR1 while step N runs (likewise)",
    "sigint": "SIGINT (Ctrl-C) while step N runs (likewise)",
    "optimizer_raise": "the host optimizer loop raises in its first stage update from step N",
    "nvme_bitflip": (
        "a bit flipped on disk in the first NVMe page file read from step N on (a live "
        "page of params or optimizer state), before that read"
    ),
    "nvme_write_fail": (
        "the first NVMe page write from step N fails as a disk error does: its future "
        "completes with an OSError once the write itself is done"
    ),
}
# armed by the loop, fired where they happen
IN_RUNTIME = ("optimizer_raise", "nvme_write_fail", "nvme_bitflip", "kill_mid_update")
MID_STEP = {
    "kill_mid_step": signal.SIGKILL,
    "sigterm": signal.SIGTERM,
    "sigusr1": signal.SIGUSR1,
    "sigint": signal.SIGINT,
}


SPIKE_GAIN = 1000.0  # loss_spike@N: step N's loss as the guard sees it, x this


class InjectedFault(RuntimeError):
    """The error an ``optimizer_raise`` fault raises."""


@dataclasses.dataclass
class StepFaults:
    """One step's faults as the loop applies them (:meth:`Faults.start_step`): the
    runtime's step arguments and the timer of a signal due while it runs."""

    poison: bool  # the step's gradients NaN
    loss_gain: float  # its loss as the spike guard sees it, times this
    timer: threading.Timer | None

    def step_ended(self) -> None:
        """The step outlived the signal's timer: the signal now, still before any save."""
        if self.timer is not None:
            self.timer.join()


class Faults:
    """The faults of one run, parsed from ``HETJAX_FAULTS`` (see the module docstring)."""

    def __init__(self, spec: str = ""):
        self.at: dict[str, set[int]] = {k: set() for k in KINDS}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, step = item.partition("@")
            if kind not in KINDS or not step.isdigit():
                raise ConfigError(
                    f"HETJAX_FAULTS item {item!r}: expected <kind>@<step> with kind one of "
                    f"{', '.join(KINDS)}"
                )
            self.at[kind].add(int(step))

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get("HETJAX_FAULTS", ""))

    def hit(self, kind: str, step: int) -> bool:
        """Whether fault ``kind`` is due at ``step``; each fires once."""
        if step in self.at[kind]:
            self.at[kind].discard(step)
            return True
        return False

    def mid_step_signal(self, step: int) -> signal.Signals | None:
        """The signal of :data:`MID_STEP` due while ``step`` runs, if any."""
        for kind, sig in MID_STEP.items():
            if self.hit(kind, step):
                return sig
        return None

    def arm(self, step: int) -> None:
        """Arms the :data:`IN_RUNTIME` faults due at ``step``: each stays armed until the
        runtime's work reaches it (:func:`fire`) or the run ends (:meth:`disarm`)."""
        due = {kind for kind in IN_RUNTIME if self.hit(kind, step)}
        if due:
            with _lock:
                _armed.update(due)

    def start_step(self, step: int, last_step_s: float) -> StepFaults:
        """The faults of ``step``, which starts now: a signal due while it runs is sent
        from a timer thread half the last step's time (``last_step_s``) later, the
        runtime's own faults are armed (:meth:`arm`), and its NaN gradients and loss
        spike are the step's arguments."""
        sig, timer = self.mid_step_signal(step), None
        if sig is not None:
            timer = threading.Timer(0.5 * last_step_s, os.kill, (os.getpid(), sig))
            timer.daemon = True
            timer.start()
        self.arm(step)
        gain = SPIKE_GAIN if self.hit("loss_spike", step) else 1.0
        return StepFaults(poison=self.hit("nan", step), loss_gain=gain, timer=timer)

    def checkpoint_handed_over(self, step: int, wait) -> None:
        """Step ``step``'s checkpoint went to the background writer: SIGKILL now
        (``kill_saving``), or once ``wait()`` says it is complete (``kill_saved``)."""
        if self.hit("kill_saving", step):
            self.kill()
        if self.hit("kill_saved", step):
            wait()
            self.kill()

    @staticmethod
    def disarm() -> None:
        """Forgets the armed faults: the run ended, and none may reach a later run."""
        with _lock:
            _armed.clear()

    @staticmethod
    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


_armed: set[str] = set()
_lock = threading.Lock()
flipped: list[str] = []  # the files ``nvme_bitflip`` changed, in order (for tests)


def fire(kind: str) -> bool:
    """Whether the :data:`IN_RUNTIME` fault ``kind`` is armed; disarms it (it fires
    once). Called from any thread where that fault happens."""
    if not _armed:
        return False
    with _lock:
        if kind in _armed:
            _armed.discard(kind)
            return True
    return False


def flip_bit(path) -> None:
    """Flips the lowest bit of the middle byte of file ``path`` on disk (the
    ``nvme_bitflip`` fault); None: nothing to flip yet, the fault is armed again."""
    if path is None:
        with _lock:
            _armed.add("nvme_bitflip")
        return
    fd = os.open(path, os.O_RDWR)
    try:
        at = os.fstat(fd).st_size // 2
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 1]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    flipped.append(str(path))
