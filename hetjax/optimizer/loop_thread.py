"""The host optimizer loop's thread, the messages it takes, its settings and its work
reports (``update_loop.py``).

Every mode shares one protocol: the training thread posts typed messages on one queue,
the loop's thread hands each to the handler registered for its type, in the order
posted. A :class:`Request` carries an event the thread sets once it is handled (the
poster waits for it); :data:`STOP` ends the thread. An error on the thread is kept and
raised in the training thread by :meth:`LoopThread.check`, naming what the thread did.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hetjax.types import OptimizerWork, TrainingError


@dataclasses.dataclass(eq=False)
class StageGradient:
    """Sync mode: a stage's final, averaged gradient (a flat slab, or the pages it
    landed in on the host), the caller's no more."""

    stage: str
    grad: Any


@dataclasses.dataclass(eq=False)
class GradientsAccumulated:
    """Lock-free mode: steps' gradients wait in the accumulator (posted once each time
    it fills from empty; the thread takes whatever has accumulated by then)."""


@dataclasses.dataclass(eq=False, kw_only=True)
class Request:
    """A message whose poster waits until the thread has handled it (``done``)."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(eq=False, kw_only=True)
class EndStep(Request):
    """Sync mode: backward ended with the gradients' global ``norm``; ``apply`` False:
    an fp16 overflow, the step is skipped."""

    norm: float
    apply: bool


@dataclasses.dataclass(eq=False, kw_only=True)
class CatchUp(Request):
    """Deferred updates: catch up ``pages`` (indices within ``stage``); the thread puts
    each page's new compute-dtype params in ``fresh``."""

    stage: str
    pages: list[int]
    fresh: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


STOP = object()  # ends the thread (after the messages posted before it)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """How the host optimizer loop runs (``optimizer.*`` and the host plan)."""

    max_norm: float  # global-norm clipping's bound (0: no clipping)
    mode: str = "sync"  # "sync" or "lockfree"
    max_staleness: int = 1  # lock-free: steps' gradients unapplied before a step waits
    speculation: str = "adaptive"  # sync: "adaptive", "always" or "never"
    readahead: int = 2  # stages whose state is read ahead of the one updating
    max_queued: int = 0  # sync: stages submitted, not yet updated, before submit waits

    @property
    def keeps_grads(self) -> bool:
        """Whether sync mode keeps each consumed gradient to the step's end: for a
        clipping redo, or for the update itself where it waits for the global norm
        (``speculation=never``)."""
        return self.max_norm > 0 or self.speculation == "never"

    @classmethod
    def of(cls, optimizer_config, **plan) -> LoopSettings:
        """The settings of an ``optimizer`` config section, with the plan's
        ``readahead`` and ``max_queued``."""
        return cls(
            max_norm=float(optimizer_config.grad_clip),
            mode=optimizer_config.mode,
            max_staleness=optimizer_config.max_staleness,
            speculation=optimizer_config.speculation,
            **plan,
        )


class LoopWork:
    """The loop's work since its last report, and the reports made: the loop's thread
    counts and reports (at the end of a step or pass), the training thread collects
    through a queue, so nothing is read and reset across threads."""

    def __init__(self):
        self.busy_s, self.params, self.device_params = 0.0, 0, 0
        self._reports: queue.Queue[OptimizerWork] = queue.Queue()

    def report(self, redo: int = 0, deferred: int = 0) -> None:
        """Hands the work since the last report to the training thread (with the
        steps redone and deferred since the loop started)."""
        work = OptimizerWork(self.busy_s, self.params, self.device_params, redo, deferred)
        self._reports.put(work)
        self.busy_s, self.params, self.device_params = 0.0, 0, 0

    def collect(self, redo: int = 0, deferred: int = 0) -> OptimizerWork:
        """The work reported since the last call."""
        work = OptimizerWork(redo=redo, deferred=deferred)
        while True:
            try:
                work = work + self._reports.get_nowait()
            except queue.Empty:
                return work


class LoopThread:
    """The loop's one thread: takes messages off the queue and runs their handlers.
    ``cv`` is the condition the modes wait on for back-pressure (notified when the
    thread fails too)."""

    def __init__(self):
        self.cv = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._doing = "starting"  # what the thread does now: named if it fails
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._thread = threading.Thread(target=self._run, name="hetjax-optimizer", daemon=True)

    def start(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        """Starts the thread with a handler for each message type it will be posted."""
        self._handlers = dict(handlers)
        self._thread.start()

    def post(self, message: Any) -> None:
        self._queue.put(message)

    def call(self, request: Request) -> None:
        """Posts ``request`` and waits until it is handled; raises the thread's error."""
        self._queue.put(request)
        while not request.done.wait(0.5):
            self.check()
        self.check()

    def now(self, doing: str) -> None:
        """Says what the thread does now (named in the error if it fails there)."""
        self._doing = doing

    @property
    def failed(self) -> bool:
        return self._error is not None

    def check(self) -> None:
        """Raises the loop thread's error, if it failed, in the calling thread."""
        if self._error is not None:
            e = self._error
            raise TrainingError(
                f"the host optimizer loop failed {self._doing}: {type(e).__name__}: {e}. "
                "The checkpoints written are intact: the run resumes from the newest"
            ) from e

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(STOP)
            with self.cv:
                self.cv.notify_all()
            self._thread.join()

    def _run(self) -> None:
        try:
            while (message := self._queue.get()) is not STOP:
                self._handlers[type(message)](message)
                if isinstance(message, Request):
                    message.done.set()
                del message  # no reference outlives the handler but its own
        except BaseException as e:  # surfaced in the training thread by check
            self._error = e
            with self.cv:
                self.cv.notify_all()
