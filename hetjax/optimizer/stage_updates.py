"""What every mode of the host optimizer loop does to one stage (``update_loop.py``):
read its state ahead, update it, store the new state and publish its params; commit or
drop a step's updates; and count the work done for the training thread.

The modes (``sync_updates.py``, ``lockfree.py``) decide when and with which gradient
and clip factor; :class:`StageUpdates` does the update, routing the device-cached
stages to :class:`~hetjax.optimizer.device_updates.DeviceStageUpdates` and leaving
the pages the deferred updates name alone
(:class:`~hetjax.optimizer.deferred.DeferredCatchUps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetjax import faults, timeline
from hetjax.faults import InjectedFault
from hetjax.optimizer.deferred import DeferredCatchUps
from hetjax.optimizer.device_updates import DeviceStageUpdates
from hetjax.optimizer.loop_thread import CatchUp, LoopThread, LoopWork
from hetjax.storage.pages import GradPages

NO_CLIP = (0.0, 0.0)  # a clip argument that does not clip: (norm, max_norm)


class StageUpdates:
    """Updates stages in the update order (backward order) with the host optimizer,
    ``readahead`` stages' state read ahead, and commits or drops a step's updates."""

    def __init__(
        self,
        optimizer,
        states,
        params,
        *,
        order: list[str],
        layout_of: Callable[[str], str],
        readahead: int,
        thread: LoopThread,
        work: LoopWork,
        device: DeviceStageUpdates | None = None,
    ):
        """``work``: where the updates are counted; ``device``: the device-cached
        stages' updates (None: none)."""
        self.opt, self.states, self.params = optimizer, states, params
        self.order, self.layout_of, self.readahead = order, layout_of, readahead
        self.thread = thread
        self.device = device
        self.work = work
        self.catch_ups: DeferredCatchUps | None = None  # deferred updates, once used
        self._reads: dict[str, Any] = {}  # read-ahead handles of the state store

    def defer_with(self, catch_ups: DeferredCatchUps) -> None:
        """Leaves the pages ``catch_ups`` names alone from now on (``deferred.py``)."""
        self.catch_ups = catch_ups

    def update(self, stage: str, grad: np.ndarray | GradPages, clip) -> None:
        """Updates ``stage`` with ``grad`` and ``clip`` ((norm, max_norm), or
        :data:`NO_CLIP`): its new state is stored (speculative until :meth:`commit`)
        and its new params published."""
        if self.device is not None and self.device.has(stage):
            self.device.update(stage, grad, clip)
            return
        self.thread.now(f"updating {stage}")
        if faults.fire("optimizer_raise"):
            raise InjectedFault(f"HETJAX_FAULTS optimizer_raise, in the update of {stage}")
        t0 = time.perf_counter()
        skip = self._skip_of(stage)  # pages left alone: neither read (but the master) nor written
        handle = self._reads.pop(stage, None) or self.states.prefetch(stage, skip=skip)
        self._read_ahead(stage)
        slabs, scalars = self.states.get(stage, handle, skip=skip)
        spare, in_place = self.states.recycle(stage)
        catch_up = self.catch_ups.in_update(stage, skip, scalars) if self.catch_ups else ()
        new, new_scalars, pages = self.opt.update(
            self.layout_of(stage), slabs, scalars, grad, clip, spare=spare, in_place=in_place,
            skip=skip, catch_up=catch_up,
        )  # fmt: skip
        timeline.watch("optimizer", stage, (new, pages))
        self.work.params += grad.size
        self.states.put(stage, new, new_scalars, skip=skip)
        self.params.publish(stage, pages)
        self.work.busy_s += time.perf_counter() - t0

    def _read_ahead(self, stage: str) -> None:
        """Starts reading the state of the ``readahead`` stages after ``stage``."""
        pos = self.order.index(stage)
        for ahead in self.order[pos + 1 : pos + 1 + self.readahead]:
            if ahead not in self._reads:
                self._reads[ahead] = self.states.prefetch(ahead, skip=self._skip_of(ahead))

    def _skip_of(self, stage: str) -> frozenset[int]:
        return self.catch_ups.skip_of(stage) if self.catch_ups else frozenset()

    def commit(self) -> None:
        """Makes the step's updates current; starts reading the next step's first
        stages."""
        self.thread.now("committing the step's state")
        t0 = time.perf_counter()
        self.states.commit()  # the last stages' write-back may still be landing
        self.params.commit()
        self._reads.clear()  # read-ahead was of the copy just replaced
        if self.catch_ups is not None:
            self.catch_ups.commit()  # (read-ahead below: of every page)
        for stage in self.order[: self.readahead]:  # the next step's first stages
            if not (self.catch_ups and self.catch_ups.defers(stage)):  # (which pages:
                self._reads[stage] = self.states.prefetch(stage)  # known once it ran)
        self.work.busy_s += time.perf_counter() - t0

    def abort(self, restore_params: bool) -> None:
        """Drops the step's speculative updates. Params published in place (host) are
        restored from the committed masters unless a redo pass will republish them."""
        self.thread.now("dropping the step's updates")
        self.states.abort()
        if self.catch_ups is not None:
            self.catch_ups.abort()
        self._reads.clear()
        if self.params.abort() and restore_params:
            for stage in self.order:
                if self.device is not None and self.device.has(stage):
                    self.device.republish(stage)
                    continue
                # Off the device, a fresh copy: a streamed stage's ``get`` would hold a
                # pooled I/O buffer that no update writes back
                master = self.states.master(stage)
                self.params.publish(stage, self.opt.compute_pages(self.layout_of(stage), master))

    def end_step(self) -> None:
        """The step is over (committed, redone or dropped)."""
        if self.device is not None:
            self.device.clear()
        if self.catch_ups is not None:
            self.catch_ups.end_step()

    def reload(self) -> None:
        """The committed state was replaced from outside (a restore): forget
        read-ahead and what the deferred updates left behind."""
        self._reads.clear()
        if self.catch_ups is not None:
            self.catch_ups.reset()

    def on_catch_up(self, request: CatchUp) -> None:
        """The loop thread's side of :class:`CatchUp`: the pages' missed updates
        applied and written back as committed (``deferred.py``)."""
        self.thread.now(f"catching up deferred pages of {request.stage}")
        t0 = time.perf_counter()
        fresh = self.catch_ups.apply(request.stage, request.pages)
        if fresh:
            request.fresh.update(fresh)
            self._reads.pop(request.stage, None)  # read ahead before: the old state
            self.work.busy_s += time.perf_counter() - t0
