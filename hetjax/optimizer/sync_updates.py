"""Synchronous mode of the host optimizer loop (``optimizer.mode=sync``): speculative
updates as gradients arrive, committed, redone with clipping or dropped when backward
ends (``update_loop.py``'s docstring has the whole story)."""

from __future__ import annotations

import numpy as np

from hetjax.optimizer.loop_thread import EndStep, LoopSettings, LoopThread, StageGradient
from hetjax.optimizer.stage_updates import NO_CLIP, StageUpdates
from hetjax.storage.gradients import GradientStore
from hetjax.storage.pages import GradPages


class SyncUpdates:
    """A step's updates: each stage's speculatively (as if clipping did not bind) as
    its gradient arrives, unless clipping bound last step (``speculation=adaptive``:
    then all at once when backward ends); then committed, redone with the clip factor,
    or dropped. ``grads`` keeps the consumed gradients for a redo."""

    def __init__(
        self,
        updates: StageUpdates,
        thread: LoopThread,
        grads: GradientStore,
        settings: LoopSettings,
    ):
        self.updates, self.thread, self.grads = updates, thread, grads
        self.max_norm = float(settings.max_norm)
        self.speculation = settings.speculation
        self.max_queued = settings.max_queued  # 0: no limit
        self.redo = 0  # steps whose speculative update was redone with clipping
        self.deferred = 0  # steps updated after backward only (clipping bound before)
        # Whether this step's updates wait for the global norm (no speculation): set at
        # the end of a step whose clipping bound, with ``speculation=adaptive``; always,
        # with ``never`` (no update is ever dropped: NVMe state written in place).
        self._never = settings.speculation == "never"
        self._keep = settings.keeps_grads
        self._defer = self._never
        self._queued = 0  # gradients submitted and not yet updated
        self._queued_bytes = 0

    def handlers(self) -> dict:
        return {StageGradient: self._on_gradient, EndStep: self._on_end_step}

    # -- the training thread's -----------------------------------------------------------

    def submit(self, stage: str, grad: np.ndarray | GradPages) -> None:
        """Stage ``stage``'s final, averaged gradient (see ``UpdateLoop.submit``); waits
        while ``max_queued`` stages are not yet updated."""
        cv = self.thread.cv
        with cv:
            while self.max_queued and self._queued >= self.max_queued and not self.thread.failed:
                cv.wait(0.5)
            self.thread.check()
            self._queued += 1
            self._queued_bytes += grad.nbytes
        self.thread.post(StageGradient(stage, grad))

    def submit_device(self, stage: str, grad) -> None:
        """A device-cached stage's final gradient: its speculative update dispatched at
        once, from the caller's thread; kept on the device for a redo (clipping)."""
        self.thread.check()
        if not self._defer:
            self.updates.update(stage, grad, NO_CLIP)
        if self._keep:
            self.updates.device.keep(stage, grad)

    def grad_host_bytes(self) -> int:
        """Gradient bytes held now: submitted not yet updated, and kept."""
        return self._queued_bytes + self.grads.host_bytes()

    def finish(self, global_norm: float, apply: bool) -> None:
        """Ends the step (see ``UpdateLoop.finish``) and waits for it."""
        self.thread.call(EndStep(norm=global_norm, apply=apply))

    def reload(self) -> None:
        self._defer = self._never  # (the last step's clipping: the next step speculates)

    # -- the loop thread's ---------------------------------------------------------------

    def _on_gradient(self, message: StageGradient) -> None:
        stage, grad = message.stage, message.grad
        if not self._defer:
            self.updates.update(stage, grad, NO_CLIP)  # speculative: no clipping
        self.thread.now(f"keeping the gradient of {stage} for a redo")
        self.grads.keep(stage, grad)  # for a redo (RAM or NVMe), or dropped
        with self.thread.cv:
            self._queued -= 1
            self._queued_bytes -= grad.nbytes
            self.thread.cv.notify_all()
        message.grad = None  # no reference outlives the update but the store's

    def _on_end_step(self, message: EndStep) -> None:
        self._end_step(message.norm, message.apply)
        self.updates.work.report(self.redo, self.deferred)

    def _end_step(self, norm: float, apply: bool) -> None:
        clip_binds = self.max_norm > 0 and not norm < self.max_norm
        clip = (norm, self.max_norm)
        if self._defer:  # nothing updated yet: one pass, clipped or not
            if apply:
                self.deferred += 1
                self.grads.wait_writes()
                self._pass(clip if clip_binds else NO_CLIP)
                self.updates.commit()
        elif apply and not clip_binds:
            self.updates.commit()
        elif apply:  # clipping binds: again, with the clip factor (republishes params)
            self.updates.abort(restore_params=False)
            self.redo += 1
            self.grads.wait_writes()  # the spilled gradients are on disk
            self._pass(clip)
            self.updates.commit()
        else:  # fp16 overflow: the step is skipped
            self.updates.abort(restore_params=True)
        self.grads.clear()
        self.updates.end_step()
        if apply and self.speculation == "adaptive":
            self._defer = clip_binds  # clipping that bound tends to bind again

    def _pass(self, clip) -> None:
        """Updates every stage with the gradients kept (read back from NVMe
        ``readahead`` stages ahead; the device-cached stages' from the device)."""
        order, device = self.updates.order, self.updates.device
        for pos, stage in enumerate(order):
            if device is not None and device.has(stage):  # it waited on the device
                self.updates.update(stage, device.take(stage), clip)
                continue
            for ahead in order[pos : pos + 1 + self.updates.readahead]:
                self.grads.prefetch(ahead)
            grad = self.grads.take(stage)
            self.updates.update(stage, grad, clip)
            del grad
