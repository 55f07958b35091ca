"""Preemption: SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) stop the run at the next safe point
with a checkpoint.

A scheduler that wants a job's resources back sends SIGTERM (SLURM at the time limit,
Kubernetes on eviction), and SLURM can send SIGUSR1 ahead of it (``launch/slurm.sh``
asks for ``--signal=B:USR1@120``). The handler only records the signal; the training
loop (``hetjax/train.py``) looks at it between steps, never inside a step or inside a
checkpoint's snapshot, writes a complete checkpoint of the step reached, waits until it
is on disk and raises :class:`Preempted`. ``python -m hetjax.launch`` then exits with
:data:`PREEMPTED_EXIT_STATUS`, so requeue logic can tell "preempted, checkpointed" from
success (0) and failure (1; 2 for a bad config). Running the same command again resumes.

With several processes the loop combines every process's flag at that point
(:func:`hetjax.distributed.any_process`), so all of them stop at the same step even when
the signal reached only some.

Ctrl-C is the same stop, from a terminal; it says so on stderr at once, since the step
in flight and the checkpoint take a while. A second Ctrl-C stops the process at once,
by the signal itself (the first one puts SIGINT's default action back): no checkpoint
of the steps since the last one, no traceback, the status a shell reports as 130
(128 + SIGINT; Python's ``subprocess`` sees -2). What is on disk is as after SIGKILL:
the complete checkpoints intact, a partial one ignored by the next run. A process that
started with SIGINT ignored (a background job of a script) keeps ignoring it.

This module imports nothing else from hetjax but the error base (``hetjax/errors.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from hetjax.errors import UserError

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry".
PREEMPTED_EXIT_STATUS = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CTRL_C_NOTE = (
    "\nhetjax: Ctrl-C: stopping after the step in flight, with a checkpoint (exit status "
    f"{PREEMPTED_EXIT_STATUS}; run the same command again to resume). Ctrl-C again stops "
    "at once, without one\n"
)


class Preempted(UserError):
    """The run stopped on a signal at a safe point, after writing a complete checkpoint
    of ``step`` into ``directory`` (``directory`` is None when there was nothing new to
    save: the newest checkpoint already was of this step, or no step had run). A
    command exits with :data:`PREEMPTED_EXIT_STATUS` on it (``hetjax/errors.py``)."""

    status = PREEMPTED_EXIT_STATUS
    label = ""

    def __init__(self, reason: str, step: int, directory: Path | None):
        self.reason, self.step, self.directory = reason, step, directory
        saved = (
            f"checkpoint of step {step} complete in {directory}"
            if directory is not None
            else f"nothing new to save at step {step}"
        )
        super().__init__(
            f"preempted ({reason}) at step {step}: {saved}; exit status "
            f"{PREEMPTED_EXIT_STATUS}. Run the same command again to resume"
        )


class StopSignals:
    """While entered, SIGTERM, SIGUSR1 and SIGINT only record that the run should stop
    (:attr:`received`); the previous handlers come back on exit. Python runs signal
    handlers in the main thread, between bytecodes, so recording is all this does:
    the loop decides when it is safe to stop. The first SIGINT puts back SIGINT's
    default action, so a second ends the process at once. Not ``active`` (a run
    without checkpoints), or entered off the main thread (where handlers cannot be
    installed), it installs nothing: the signals keep their actions (Ctrl-C raises
    KeyboardInterrupt, which the command reports in one line, ``hetjax/errors.py``).
    A signal ignored on entry stays ignored."""

    def __init__(self, active: bool = True):
        self.active = active
        self.received: str | None = None  # the first signal's name, e.g. "SIGTERM"
        self._received_at = 0.0
        self._previous: dict[int, object] = {}

    def since(self) -> float:
        """Seconds since the first signal arrived."""
        return time.monotonic() - self._received_at

    def __enter__(self) -> StopSignals:
        if self.active and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C: stop now
            os.write(2, CTRL_C_NOTE.encode())  # not print: this may interrupt a print
        if self.received is None:
            self.received = signal.Signals(signum).name
            self._received_at = time.monotonic()
