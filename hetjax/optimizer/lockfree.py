"""Lock-free mode of the host optimizer loop (``optimizer.mode=lockfree``, Angel-PTM's
Algorithm 2; ``update_loop.py``'s docstring has the whole story): the runtime adds each
step's gradients to an accumulator and goes on; the loop's thread applies whatever has
accumulated as one update, while the runtime trains on the params published so far."""

from __future__ import annotations

import numpy as np

from hetjax.optimizer.loop_thread import GradientsAccumulated, LoopSettings, LoopThread
from hetjax.optimizer.stage_updates import NO_CLIP, StageUpdates


class LockFreeUpdates:
    """The accumulator and its passes: ``submit_step`` blocks while more than
    ``max_staleness`` steps' gradients are unapplied."""

    def __init__(self, updates: StageUpdates, thread: LoopThread, settings: LoopSettings):
        self.updates, self.thread = updates, thread
        self.max_norm = float(settings.max_norm)
        self.max_staleness = settings.max_staleness
        self._acc: dict[str, np.ndarray] | None = None  # under thread.cv
        self._acc_steps = 0
        self._unapplied = 0

    def handlers(self) -> dict:
        return {GradientsAccumulated: self._on_accumulated}

    # -- the training thread's -----------------------------------------------------------

    def submit_step(self, grads: dict[str, np.ndarray]) -> None:
        """Adds one step's averaged gradients (stage -> fp32 slab) to the accumulator;
        blocks while more than ``max_staleness`` steps are unapplied."""
        cv = self.thread.cv
        with cv:
            self.thread.check()
            if self._acc is None:  # the thread takes it (and what joins it meanwhile)
                self._acc = grads
                self.thread.post(GradientsAccumulated())
            else:
                for k, g in grads.items():
                    self._acc[k] += g
            self._acc_steps += 1
            self._unapplied += 1
            cv.notify_all()
            while self._unapplied > self.max_staleness and not self.thread.failed:
                cv.wait(0.5)
            self.thread.check()

    def drain(self) -> None:
        """Waits until every submitted step is applied."""
        cv = self.thread.cv
        with cv:
            while self._unapplied and not self.thread.failed:
                cv.wait(0.5)
        self.thread.check()

    @property
    def unapplied(self) -> int:
        return self._unapplied

    # -- the loop thread's ---------------------------------------------------------------

    def _on_accumulated(self, _: GradientsAccumulated) -> None:
        """One update of every stage with the average of the steps accumulated, clipped
        by its own norm (none if it is not finite), then published and committed."""
        with self.thread.cv:
            grads, steps = self._acc, self._acc_steps
            self._acc, self._acc_steps = None, 0
        for g in grads.values():
            g /= steps
        norm = float(np.sqrt(sum(float(np.dot(g, g)) for g in grads.values())))
        if np.isfinite(norm):
            clip = (norm, self.max_norm) if self.max_norm > 0 else NO_CLIP
            for stage in self.updates.order:
                self.updates.update(stage, grads[stage], clip)
            self.updates.commit()
        self.updates.work.report()
        with self.thread.cv:
            self._unapplied -= steps
            self.thread.cv.notify_all()
