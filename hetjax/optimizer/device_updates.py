"""Device-cached stages (``offload.optimizer_device_stages``, Angel-PTM's GPU cache of
optimizer state): their state lives on the device and, in sync mode, their gradient
never leaves it.

:meth:`DeviceStageUpdates.update` dispatches a stage's update on the device (JAX runs
it asynchronously) and touches only the device stores, no read-ahead: so the
runtime's thread may run a speculative update the moment the stage's final gradient
exists (``UpdateLoop.submit_device``) while the loop's thread updates host stages. With
clipping the gradient is kept on the device until the step ends, for a redo, which the
loop's thread runs in the update order like every other stage's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hetjax import timeline
from hetjax.optimizer.loop_thread import LoopWork


class DeviceStageUpdates:
    """The updates of the device-cached ``stages`` by the device ``optimizer``
    (``states`` and ``params`` route those stages to device stores)."""

    def __init__(
        self,
        optimizer,
        states,
        params,
        *,
        stages,
        layout_of: Callable[[str], str],
        work: LoopWork,
    ):
        self.opt, self.states, self.params = optimizer, states, params
        self.stages = frozenset(stages)
        self.layout_of = layout_of
        self.work = work  # counts ``device_params``
        self._grads: dict[str, Any] = {}  # device gradients kept for a redo

    def has(self, stage: str) -> bool:
        return stage in self.stages

    def update(self, stage: str, grad, clip) -> None:
        """A device-cached stage's update with ``grad`` (an fp32 device slab):
        dispatched, not waited for."""
        slabs, scalars = self.states.get(stage)
        spare, in_place = self.states.recycle(stage)
        new, new_scalars, pages = self.opt.update(
            self.layout_of(stage), slabs, scalars, grad, clip, spare=spare, in_place=in_place
        )
        timeline.watch("compute", f"{stage} update", (new, pages))
        self.work.device_params += grad.size
        self.states.put(stage, new, new_scalars)
        self.params.publish(stage, pages)

    def keep(self, stage: str, grad) -> None:
        """Keeps ``stage``'s gradient on the device until the step ends (a redo)."""
        self._grads[stage] = grad

    def take(self, stage: str):
        """A kept gradient, once (for the redo or the deferred pass)."""
        return self._grads.pop(stage)

    def grads(self) -> list:
        """The device gradients kept now (the runtime's ledger counts them)."""
        return list(self._grads.values())

    def clear(self) -> None:
        """The step ended: forgets the kept gradients."""
        self._grads.clear()

    def republish(self, stage: str) -> None:
        """Publishes ``stage``'s params again from its committed master (a dropped step)."""
        master = self.states.get(stage)[0]["master"]
        self.params.publish(stage, self.opt.compute_pages(self.layout_of(stage), master))
