"""The host optimizer loop: a background thread that updates stages as gradients arrive.

**Synchronous mode** (``optimizer.mode=sync``, the default). During the last
micro-batch's backward the step's gradient thread (``runtime/loop/grads.py``) hands each
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

**The parts.** :class:`UpdateLoop` composes them and is what the runtimes call: one
thread and its typed messages (``loop_thread.py``), the update of one stage
(``stage_updates.py``), a mode (``sync_updates.py`` or ``lockfree.py``, chosen by
``LoopSettings.mode``), the device-cached stages (``device_updates.py``) and the
deferred catch-ups (``deferred.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hetjax.optimizer.deferred import Deferred, DeferredCatchUps
from hetjax.optimizer.device_updates import DeviceStageUpdates
from hetjax.optimizer.lockfree import LockFreeUpdates
from hetjax.optimizer.loop_thread import CatchUp, LoopSettings, LoopThread, LoopWork
from hetjax.optimizer.stage_updates import StageUpdates
from hetjax.optimizer.sync_updates import SyncUpdates
from hetjax.storage.gradients import GradientStore
from hetjax.storage.pages import GradPages
from hetjax.types import OptimizerWork

__all__ = ["LoopSettings", "UpdateLoop"]


class UpdateLoop:
    """The host optimizer loop: a thread updating stages with ``optimizer`` (their
    state in ``states``, their params published to ``params``) in ``order`` (backward
    order), in the mode ``settings.mode`` says."""

    def __init__(
        self,
        optimizer,
        states,
        params,
        *,
        order: list[str],
        layout_of: Callable[[str], str],
        settings: LoopSettings,
        grads: GradientStore | None = None,
        device_optimizer=None,
        device_stages=(),
    ):
        """``layout_of``: stage name -> layout name; ``grads``: where sync mode keeps
        the gradients for a redo (default: in RAM, when clipping is on);
        ``device_stages`` keep their state on the device and are updated there by
        ``device_optimizer`` (``states`` and ``params`` route them to device stores)."""
        self.settings = settings
        self.mode = settings.mode
        self._thread = LoopThread()
        self._work = LoopWork()
        self._device = None
        if device_stages:
            self._device = DeviceStageUpdates(
                device_optimizer, states, params,
                stages=device_stages, layout_of=layout_of, work=self._work,
            )  # fmt: skip
        self._updates = StageUpdates(
            optimizer, states, params, order=order, layout_of=layout_of,
            readahead=settings.readahead, thread=self._thread, work=self._work,
            device=self._device,
        )  # fmt: skip
        self.grads = grads if grads is not None else GradientStore(keep=settings.keeps_grads)
        self._sync: SyncUpdates | None = None
        self._lockfree: LockFreeUpdates | None = None
        if settings.mode == "lockfree":
            self._lockfree = LockFreeUpdates(self._updates, self._thread, settings)
            handlers = self._lockfree.handlers()
        else:
            self._sync = SyncUpdates(self._updates, self._thread, self.grads, settings)
            handlers = self._sync.handlers()
        self._thread.start({**handlers, CatchUp: self._updates.on_catch_up})

    # -- synchronous mode ---------------------------------------------------------------

    def submit(self, stage: str, grad: np.ndarray | GradPages) -> None:
        """Stage ``stage``'s final, averaged gradient: a flat slab, or the pages it
        landed in on the host, which the update reads where they are (never changed by
        the caller after this; the loop keeps it for a redo or drops it). Waits while
        ``max_queued`` stages are not yet updated."""
        self._sync.submit(stage, grad)

    def submit_device(self, stage: str, grad) -> None:
        """A device-cached stage's final, averaged fp32 gradient slab (a device array):
        its speculative update is dispatched at once, from the caller's thread (JAX
        runs it asynchronously on the device). With clipping the gradient is kept on
        the device until the step ends, for a redo."""
        self._sync.submit_device(stage, grad)

    def device_grads(self) -> list:
        """The device gradients kept for a redo (the runtime's ledger counts them)."""
        return self._device.grads() if self._device is not None else []

    def grad_host_bytes(self) -> int:
        """Gradient bytes the loop holds now: submitted not yet updated, and kept."""
        return self._sync.grad_host_bytes()

    def finish(self, global_norm: float, apply: bool) -> OptimizerWork:
        """Ends a synchronous step: waits for the submitted updates, then commits them,
        redoes them with clipping, or (``apply`` False: fp16 overflow) drops them.
        Returns the step's optimizer work."""
        self._sync.finish(global_norm, apply)
        return self.collect()

    def collect(self) -> OptimizerWork:
        """The work the loop reported since the last call (lock-free mode: the passes
        that completed; sync mode: the step :meth:`finish` ended)."""
        if self._sync is None:
            return self._work.collect()
        return self._work.collect(self._sync.redo, self._sync.deferred)

    # -- deferred updates (deferred.py) -------------------------------------------------

    def use_deferred(self, deferred: Deferred) -> None:
        """Defers the updates of zero-gradient pages the runtime names (sync mode,
        state on NVMe: ``deferred.py``)."""
        assert self._sync is not None
        u = self._updates
        device_stages = self._device.stages if self._device is not None else ()
        catch_ups = DeferredCatchUps(
            deferred, u.opt, u.states, layout_of=u.layout_of, device_stages=device_stages
        )
        u.defer_with(catch_ups)

    @property
    def deferral(self) -> Deferred | None:
        """The deferred updates' bookkeeping (None: not used)."""
        catch_ups = self._updates.catch_ups
        return catch_ups.deferred if catch_ups is not None else None

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
        request = CatchUp(stage=stage, pages=list(pages))
        self._thread.call(request)
        return request.fresh

    def pending(self) -> dict[str, list[int]]:
        """Every stage's deferred pages (between steps: the loop is idle)."""
        deferral = self.deferral
        return deferral.pending() if deferral is not None else {}

    # -- lock-free mode -----------------------------------------------------------------

    def submit_step(self, grads: dict[str, np.ndarray]) -> None:
        """Adds one step's averaged gradients to the accumulation buffer; blocks while
        more than ``max_staleness`` steps are unapplied."""
        self._lockfree.submit_step(grads)

    def drain(self) -> None:
        """Waits until every submitted step is applied (lock-free mode)."""
        self._lockfree.drain()

    @property
    def unapplied(self) -> int:
        return self._lockfree.unapplied if self._lockfree is not None else 0

    # -- either ---------------------------------------------------------------------------

    def reload(self) -> None:
        """The committed state was replaced from outside (a restore): forget read-ahead
        (and the last step's clipping: the next step speculates)."""
        self._updates.reload()
        if self._sync is not None:
            self._sync.reload()

    def close(self) -> None:
        self._thread.close()
