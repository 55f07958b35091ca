"""The host optimizer loop: a background thread that updates stages as gradients arrive.

**Synchronous mode** (``optimizer.mode=sync``, the default). During the last
micro-batch's backward the step's gradient thread (``runtime/grads.py``) hands each
stage's final gradient to :meth:`UpdateLoop.submit` the moment it reaches the host (as
the pages it landed in, when nothing had to be summed), in backward order (head,
block L-1 .. block 0, embed). The thread reads the stage's state ahead (the next
``readahead`` stages in that order are already being read from NVMe while this one
computes), runs the optax update, stores the new state (written back to disk
asynchronously while the next stage updates) and publishes the refreshed compute-dtype
params. So the optimizer and its I/O run while backward is still computing.

Global-norm clipping needs every gradient first. The loop therefore updates
*speculatively*, as if clipping did not bind, into state the store keeps apart from the
committed state (``storage/states.py``). When backward ends the runtime calls
:meth:`UpdateLoop.finish` with the global norm: if ``norm < max_norm`` (or clipping is
off) the speculative updates are exactly optax's and are committed; if clipping binds,
they are dropped and every stage is updated again with the clip factor (counted in
``optimizer_redo``); if an fp16 step overflowed, they are dropped and the step skipped.
Results equal ``optax.chain(clip_by_global_norm, base)`` in every case.

A redo costs a whole extra optimizer pass (and, for state on NVMe, a read and write of
all of it) after backward, so with ``optimizer.speculation=adaptive`` (the default) a
step that follows one whose clipping bound does not speculate: it keeps the gradients
and updates once when backward ends, clipped or not (counted in ``optimizer_deferred``).
Early in training, when clipping binds step after step, that halves the optimizer's
work and its I/O; once it stops binding, updates overlap backward again from the step
after. ``always`` speculates every step. A consumed
gradient goes to the :class:`~hetjax.storage.gradients.GradientStore`, which keeps it (in RAM or
on NVMe) for a possible redo, or drops it when clipping is off; with bounded gradient
buffers ``submit`` waits while ``max_queued`` stages are not yet updated
(``hetjax/memory.py``).

**What the loop did** reaches the training thread as an
:class:`~hetjax.types.OptimizerWork` through a queue (:meth:`UpdateLoop.collect`): the
loop's thread hands over each step's (sync) or each pass's (lock-free) work; nothing is
read and reset across threads.

**Device-cached stages** (``offload.optimizer_device_stages``, Angel-PTM's GPU cache
of optimizer state): their state lives on the device and their gradient never leaves
it. :meth:`UpdateLoop.submit_device` dispatches a stage's speculative update from the
runtime's thread the moment its final gradient exists, so it runs on the device right
after the backward that produced it instead of queueing behind the host stages; the
gradient stays on the device (with clipping) for a redo. Commit, redo and abort treat
those stages like every other (the redo runs them from this thread, in the same
order). In lock-free mode their gradients reach the host like the others' and only
the update runs on the device.

**Lock-free mode** (``optimizer.mode=lockfree``, Angel-PTM's Algorithm 2). The runtime
never waits for the optimizer: :meth:`UpdateLoop.submit_step` adds the step's averaged
gradient into an accumulation buffer and returns. The thread takes whatever has
accumulated, averages it (one optimizer update for the ``n`` steps it covers: the
optax count advances once), clips it by its own norm, updates every stage and publishes
the params stage by stage, while the runtime keeps training on the buffered params.
Staleness is bounded: ``submit_step`` blocks while more than ``optimizer.max_staleness``
steps' gradients are not yet applied. The trade: forward and backward run on params up
to ``max_staleness`` steps old and fewer optimizer updates happen, so loss per step is
a little worse than sync mode; in exchange the optimizer and its NVMe traffic leave the
critical path entirely. ``max_staleness=0`` waits for every update (no overlap).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from hetjax import faults, timeline
from hetjax.faults import InjectedFault
from hetjax.optimizer.deferred import Deferred
from hetjax.storage.gradients import GradientStore
from hetjax.storage.pages import GradPages
from hetjax.types import OptimizerWork, TrainingError


class UpdateLoop:
    def __init__(
        self,
        optimizer,
        states,
        params,
        order: list[str],
        layout_of,
        max_norm: float,
        mode: str = "sync",
        max_staleness: int = 1,
        speculation: str = "adaptive",
        readahead: int = 2,
        grads: GradientStore | None = None,
        max_queued: int = 0,
        device_optimizer=None,
        device_stages=(),
    ):
        """``device_stages`` keep their state on the device and are updated there by
        ``device_optimizer`` (``states`` and ``params`` route them to device stores)."""
        # pages whose updates wait while their gradient is zero (deferred.py), or None
        self.deferral: Deferred | None = None
        self.opt, self.states, self.params = optimizer, states, params
        self.device_opt = device_optimizer
        self.device_stages = frozenset(device_stages)
        self._device_grads: dict[str, Any] = {}  # device gradients kept for a redo
        self.grads = grads if grads is not None else GradientStore(keep=max_norm > 0)
        # stages submitted and not yet updated before submit waits (0: no limit)
        self.max_queued = max_queued
        self.order = order  # update order: backward order
        self.layout_of = layout_of  # stage name -> layout name
        self.max_norm = float(max_norm)
        self.mode = mode
        self.max_staleness = max_staleness
        self.readahead = readahead
        # The work since the last report (OptimizerWork's fields), and the reports made.
        self._busy_s, self._params, self._device_params = 0.0, 0, 0
        self._reports: queue.Queue[OptimizerWork] = queue.Queue()
        self.redo = 0  # steps whose speculative update was redone with clipping
        self.deferred = 0  # steps updated after backward only (clipping bound before)
        self.speculation = speculation
        # Whether this step's updates wait for the global norm (no speculation): set at
        # the end of a step whose clipping bound, with ``speculation=adaptive``.
        self._defer = False
        self._queue: queue.Queue = queue.Queue()
        self._reads: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._doing = "starting"  # what the thread does now: named if it fails
        # lock-free accumulation
        self._cv = threading.Condition()
        self._acc: dict[str, np.ndarray] | None = None
        self._acc_steps = 0
        self._unapplied = 0
        # sync: gradients submitted and not yet updated
        self._queued = 0
        self._queued_bytes = 0
        self._thread = threading.Thread(target=self._run, name="hetjax-optimizer", daemon=True)
        self._thread.start()

    # -- synchronous mode ---------------------------------------------------------------

    def submit(self, stage: str, grad: np.ndarray | GradPages) -> None:
        """Stage ``stage``'s final, averaged gradient: a flat slab, or the pages it
        landed in on the host, which the update reads where they are (never changed by
        the caller after this; the loop keeps it for a redo or drops it). Waits while
        ``max_queued`` stages are not yet updated."""
        with self._cv:
            while self.max_queued and self._queued >= self.max_queued and self._error is None:
                self._cv.wait(0.5)
            self._check()
            self._queued += 1
            self._queued_bytes += grad.nbytes
        self._queue.put(("stage", stage, grad))

    def submit_device(self, stage: str, grad) -> None:
        """A device-cached stage's final, averaged fp32 gradient slab (a device array):
        its speculative update is dispatched at once, from the caller's thread (JAX
        runs it asynchronously on the device). With clipping the gradient is kept on
        the device until the step ends, for a redo."""
        self._check()
        if not self._defer:
            self._update(stage, grad, (0.0, 0.0))
        if self.max_norm > 0:
            self._device_grads[stage] = grad

    def device_grads(self) -> list:
        """The device gradients kept for a redo (the runtime's ledger counts them)."""
        return list(self._device_grads.values())

    def use_deferred(self, deferred: Deferred) -> None:
        """Defers the updates of zero-gradient pages the runtime names (sync mode,
        state on NVMe: ``deferred.py``)."""
        assert self.mode == "sync"
        self.deferral = deferred
        getattr(self.states, "base", self.states).skip_of = self._skip_of

    def catch_up(self, stage: str, pages=None, keep=frozenset()) -> dict[int, np.ndarray]:
        """Catches up the deferred pages of ``stage`` (``deferred.py``) among ``pages``
        (all: None) but those in ``keep``, on the loop's thread (idle between a sync
        step's commit and the next backward), and waits: their state is written back as
        committed. Returns each such page's new params (compute dtype) by page; at once,
        with no hand-over to the thread, when none is behind (the forward asks for every
        routed block)."""
        pages = self.deferral.behind_among(stage, pages, keep)
        if not pages:
            return {}
        done, out = threading.Event(), {}
        self._queue.put(("catch_up", stage, list(pages), out, done))
        while not done.wait(0.5):
            self._check()
        self._check()
        return out

    def pending(self) -> dict[str, list[int]]:
        """Every stage's deferred pages (between steps: the loop is idle)."""
        return self.deferral.pending() if self.deferral is not None else {}

    def grad_host_bytes(self) -> int:
        """Gradient bytes the loop holds now: submitted not yet updated, and kept."""
        return self._queued_bytes + self.grads.host_bytes()

    def finish(self, global_norm: float, apply: bool) -> OptimizerWork:
        """Ends a synchronous step: waits for the submitted updates, then commits them,
        redoes them with clipping, or (``apply`` False: fp16 overflow) drops them.
        Returns the step's optimizer work."""
        done = threading.Event()
        self._queue.put(("finish", global_norm, apply, done))
        while not done.wait(0.5):
            self._check()
        self._check()
        return self.collect()

    def collect(self) -> OptimizerWork:
        """The work the loop reported since the last call (lock-free mode: the passes
        that completed; sync mode: the step :meth:`finish` ended)."""
        work = OptimizerWork(redo=self.redo, deferred=self.deferred)
        while True:
            try:
                work = work + self._reports.get_nowait()
            except queue.Empty:
                return work

    def _report(self) -> None:
        """Hands the work since the last report to the training thread (called by the
        loop's thread at the end of a step or pass, while the training thread waits or
        does not touch these counters)."""
        self._reports.put(
            OptimizerWork(self._busy_s, self._params, self._device_params, self.redo, self.deferred)
        )
        self._busy_s, self._params, self._device_params = 0.0, 0, 0

    # -- lock-free mode -----------------------------------------------------------------

    def submit_step(self, grads: dict[str, np.ndarray]) -> None:
        """Adds one step's averaged gradients to the accumulation buffer; blocks while
        more than ``max_staleness`` steps are unapplied."""
        with self._cv:
            self._check()
            if self._acc is None:
                self._acc = grads
            else:
                for k, g in grads.items():
                    self._acc[k] += g
            self._acc_steps += 1
            self._unapplied += 1
            self._cv.notify_all()
            while self._unapplied > self.max_staleness and self._error is None:
                self._cv.wait(0.5)
            self._check()

    def drain(self) -> None:
        """Waits until every submitted step is applied (lock-free mode)."""
        with self._cv:
            while self._unapplied and self._error is None:
                self._cv.wait(0.5)
        self._check()

    @property
    def unapplied(self) -> int:
        return self._unapplied

    # -- the thread ---------------------------------------------------------------------

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            with self._cv:
                self._cv.notify_all()
            self._thread.join()

    def _check(self) -> None:
        """Raises the loop thread's error, if it failed, in the calling thread."""
        if self._error is not None:
            e = self._error
            raise TrainingError(
                f"the host optimizer loop failed {self._doing}: {type(e).__name__}: {e}. "
                "The checkpoints written are intact: the run resumes from the newest"
            ) from e

    def _run(self) -> None:
        try:
            if self.mode == "lockfree":
                self._run_lockfree()
            else:
                self._run_sync()
        except BaseException as e:  # surfaced in the training thread by _check
            self._error = e
            with self._cv:
                self._cv.notify_all()

    def _run_sync(self) -> None:
        while (item := self._queue.get()) is not None:
            if item[0] == "catch_up":
                _, stage, pages, out, done = item
                out.update(self._catch_up(stage, pages))
                done.set()
                continue
            if item[0] == "stage":
                _, stage, grad = item
                del item  # no reference outlives the update but the store's
                if not self._defer:
                    self._update(stage, grad, (0.0, 0.0))  # speculative: no clipping
                self._doing = f"keeping the gradient of {stage} for a redo"
                self.grads.keep(stage, grad)  # for a redo (RAM or NVMe), or dropped
                with self._cv:
                    self._queued -= 1
                    self._queued_bytes -= grad.nbytes
                    self._cv.notify_all()
                del grad
                continue
            _, norm, apply, done = item
            self._end_step(norm, apply)
            self._report()
            done.set()

    def _end_step(self, norm: float, apply: bool) -> None:
        clip_binds = self.max_norm > 0 and not norm < self.max_norm
        if self._defer:  # nothing updated yet: one pass, clipped or not
            if apply:
                self.deferred += 1
                self.grads.wait_writes()
                self._pass((norm, self.max_norm) if clip_binds else (0.0, 0.0))
                self._commit()
        elif apply and not clip_binds:
            self._commit()
        elif apply:  # clipping binds: again, with the clip factor (republishes params)
            self._abort(restore_params=False)
            self.redo += 1
            self.grads.wait_writes()  # the spilled gradients are on disk
            self._pass((norm, self.max_norm))
            self._commit()
        else:  # fp16 overflow: the step is skipped
            self._abort(restore_params=True)
        self.grads.clear()
        self._device_grads.clear()
        if self.deferral is not None:
            self.deferral.end_step()
        if apply and self.speculation == "adaptive":
            self._defer = clip_binds  # clipping that bound tends to bind again

    def _run_lockfree(self) -> None:
        while True:
            with self._cv:
                while self._acc is None:
                    if not self._queue.empty():  # close() was called
                        return
                    self._cv.wait(0.5)
                grads, steps = self._acc, self._acc_steps
                self._acc, self._acc_steps = None, 0
            for g in grads.values():
                g /= steps
            norm = float(np.sqrt(sum(float(np.dot(g, g)) for g in grads.values())))
            if np.isfinite(norm):
                clip = (norm, self.max_norm) if self.max_norm > 0 else (0.0, 0.0)
                self._pass(clip, grads)
                self._commit()
            self._report()
            with self._cv:
                self._unapplied -= steps
                self._cv.notify_all()

    # -- updating stages ----------------------------------------------------------------

    def _pass(self, clip, grads: dict[str, np.ndarray] | None = None) -> None:
        """Updates every stage with ``grads``, or with the gradients the store kept
        (read back from NVMe ``readahead`` stages ahead)."""
        for pos, stage in enumerate(self.order):
            if grads is not None:
                self._update(stage, grads[stage], clip)
                continue
            if stage in self.device_stages:  # its gradient waited on the device
                self._update(stage, self._device_grads.pop(stage), clip)
                continue
            for ahead in self.order[pos : pos + 1 + self.readahead]:
                self.grads.prefetch(ahead)
            grad = self.grads.take(stage)
            self._update(stage, grad, clip)
            del grad

    def _opt(self, stage: str):
        return self.device_opt if stage in self.device_stages else self.opt

    def _update(self, stage: str, grad: np.ndarray | GradPages, clip) -> None:
        if stage in self.device_stages:
            self._update_device(stage, grad, clip)
            return
        self._doing = f"updating {stage}"
        if faults.fire("optimizer_raise"):
            raise InjectedFault(f"HETJAX_FAULTS optimizer_raise, in the update of {stage}")
        t0 = time.perf_counter()
        handle = self._reads.pop(stage, None) or self.states.prefetch(stage)
        pos = self.order.index(stage)
        for ahead in self.order[pos + 1 : pos + 1 + self.readahead]:
            if ahead not in self._reads:
                self._reads[ahead] = self.states.prefetch(ahead)
        slabs, scalars = self.states.get(stage, handle)
        layout = self.layout_of(stage)
        spare, in_place = self.states.recycle(stage)
        skip, catch_up = frozenset(), ()
        if self.deferral is not None:
            skip = self._skip_of(stage)
            catch_up = self.deferral.catch_up_groups(stage)
            catch_up = [(p, inputs) for p, inputs in catch_up if not set(p) <= skip]
            catch_up = [([q for q in p if q not in skip], inputs) for p, inputs in catch_up]
            self.deferral.updated(stage, skip, scalars)
        new, new_scalars, pages = self.opt.update(
            layout, slabs, scalars, grad, clip, spare=spare, in_place=in_place,
            skip=skip, catch_up=catch_up,
        )  # fmt: skip
        timeline.watch("optimizer", stage, (new, pages))
        self._params += grad.size
        self.states.put(stage, new, new_scalars)
        self.params.publish(stage, pages)
        self._busy_s += time.perf_counter() - t0

    def _update_device(self, stage: str, grad, clip) -> None:
        """A device-cached stage's update: dispatched, not waited for. Touches only the
        device stores and no read-ahead, so the runtime's thread may run it while this
        loop's thread updates host stages."""
        slabs, scalars = self.states.get(stage)
        spare, in_place = self.states.recycle(stage)
        new, new_scalars, pages = self.device_opt.update(
            self.layout_of(stage), slabs, scalars, grad, clip, spare=spare, in_place=in_place
        )
        timeline.watch("compute", f"{stage} update", (new, pages))
        self._device_params += grad.size
        self.states.put(stage, new, new_scalars)
        self.params.publish(stage, pages)

    def reload(self) -> None:
        """The committed state was replaced from outside (a restore): forget read-ahead
        (and the last step's clipping: the next step speculates)."""
        self._reads.clear()
        self._defer = False
        if self.deferral is not None:
            self.deferral.reset()

    # -- deferred updates (deferred.py) -------------------------------------------------

    def _skip_of(self, stage: str) -> frozenset[int]:
        """The pages of ``stage`` this step leaves behind: those the runtime deferred,
        where the stage's state streams from NVMe through the native kernel."""
        if not self._defers(stage):
            return frozenset()
        return self.deferral.skip_of(stage)

    def _defers(self, stage: str) -> bool:
        """Whether ``stage``'s pages may be deferred: a routed block streamed from NVMe
        through the native kernel."""
        if self.deferral is None or stage not in self.deferral.stages:
            return False
        return stage not in self.device_stages and self.opt.native and self.states.links(stage)

    def _catch_up(self, stage: str, pages) -> dict[int, np.ndarray]:
        """Applies the updates the deferred ``pages`` of ``stage`` missed (those behind;
        the others are current) and writes them back as committed; their new params."""
        self._doing = f"catching up deferred pages of {stage}"
        t0 = time.perf_counter()
        groups = self.deferral.catch_up_groups(stage, pages)
        wanted = sorted(p for group, _ in groups for p in group)
        if not wanted:
            return {}
        slabs = self.states.read_pages(stage, wanted)
        flat = {k: v.reshape(-1) for k, v in slabs.items()}
        at = {p: i for i, p in enumerate(wanted)}
        fresh = {}
        for group, inputs in groups:
            params = self.opt.catch_up(
                self.layout_of(stage), flat, group, [at[p] for p in group], inputs
            )
            fresh.update(zip(group, params, strict=True))
        self.states.write_pages(stage, wanted, slabs)
        self.deferral.caught_up(stage, wanted)
        self._reads.pop(stage, None)  # read ahead before: the old state
        self._busy_s += time.perf_counter() - t0
        return fresh

    def _commit(self) -> None:
        self._doing = "committing the step's state"
        t0 = time.perf_counter()
        self.states.commit()  # the last stages' write-back may still be landing
        self.params.commit()
        self._reads.clear()  # read-ahead was of the generation just replaced
        if self.deferral is not None:
            self.deferral.commit()
            self.deferral.end_step()  # (read-ahead below: of every page)
        for stage in self.order[: self.readahead]:  # the next step's first stages
            if not self._defers(stage):  # (which pages: known once its forward ran)
                self._reads[stage] = self.states.prefetch(stage)
        self._busy_s += time.perf_counter() - t0

    def _abort(self, restore_params: bool) -> None:
        """Drops the step's speculative updates. Params published in place (host) are
        restored from the committed masters unless a redo pass will republish them."""
        self._doing = "dropping the step's updates"
        self.states.abort()
        if self.deferral is not None:
            self.deferral.abort()
        self._reads.clear()
        if self.params.abort() and restore_params:
            for stage in self.order:
                # Off the device, a fresh copy: a streamed stage's ``get`` would hold a
                # pooled I/O buffer that no update writes back
                if stage in self.device_stages:
                    master = self.states.get(stage)[0]["master"]
                else:
                    master = self.states.master(stage)
                pages = self._opt(stage).compute_pages(self.layout_of(stage), master)
                self.params.publish(stage, pages)
