"""One step's gradients, collected as they leave the device."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.optimizer.update_loop import UpdateLoop

F32 = jnp.float32


class DeviceGradients:
    """The device cache's gradient arithmetic, jitted once per runtime: a gradient's
    pages -> one fp32 slab on the device, and a summed slab -> (its average, the
    average's squared norm)."""

    def __init__(self, device: jax.sharding.Sharding):
        self.slab = jax.jit(
            lambda pages: jnp.concatenate([p.astype(F32) for p in pages]), out_shardings=device
        )
        # the divisor is static (one per run): a Python float argument would be an
        # implicit host-to-device transfer every step
        self.average = jax.jit(lambda g, d: (g / d, jnp.dot(g / d, g / d)), static_argnums=1)


class StepGradients:
    """One step's gradient slabs, accumulated on the host (fp32) over micro-batches.

    A stage's slab is final after its last contribution of the last micro-batch (embed
    has two per micro-batch: the tied head and its own backward). It is then averaged
    (loss scale removed), its squared norm added to the global norm, and, in sync mode,
    handed to the optimizer ``loop`` at once, which owns it from then on
    (``storage/gradients.py``): it is not held here. Lock-free mode (``loop`` None)
    keeps them all for the loop's accumulator.

    Device-cached stages (sync mode) take the same steps on the device
    (:meth:`add_device`): their squared norms stay device scalars until :meth:`norm`."""

    def __init__(
        self,
        stage_names: list[str],
        micro_batches: int,
        scale: float,
        seed: float,
        loop: UpdateLoop | None,
        host_slab: Callable[[object], np.ndarray],
        sum_over_processes: Callable[[float], float],
        device: DeviceGradients | None = None,
    ):
        self.remaining = {n: micro_batches * (2 if n == "embed" else 1) for n in stage_names}
        self.divisor = micro_batches * scale
        self.scale = scale
        self.seed = seed  # the loss cotangent: the scale (NaN when a fault is injected)
        self.loop = loop
        self.host_slab, self.sum_over_processes = host_slab, sum_over_processes
        self.device = device
        self.finite = True  # once a gradient is not finite, nothing more is submitted
        self.grads: dict[str, np.ndarray] = {}
        self.peak_bytes = 0  # gradient bytes held on the host (here and by the loop)
        self._sq = 0.0
        self.device_grads: dict[str, jax.Array] = {}  # device-cached stages' sums
        self._device_sq: list[jax.Array] = []
        # seconds the dispatching thread spent here instead of dispatching device work
        self.dispatch_outside_s = 0.0

    def add(self, name: str, pages) -> None:
        t0 = time.perf_counter()
        self._add(name, pages)
        self.dispatch_outside_s += time.perf_counter() - t0

    def _add(self, name: str, pages) -> None:
        g = self.host_slab(pages)  # waits for this slab only
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g
        self.remaining[name] -= 1
        if self.remaining[name] == 0:
            g = self.grads[name]
            if self.divisor != 1:
                g /= self.divisor
            g32 = g if g.dtype == np.float32 else g.astype(np.float32)  # bf16: one block
            sq = float(np.dot(g32, g32))
            del g32
            self._sq += sq
            self.finite = self.finite and bool(np.isfinite(sq))
        held = sum(a.nbytes for a in self.grads.values())
        if self.loop is not None:
            held += self.loop.grad_host_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
        if self.remaining[name] == 0 and self.loop is not None:
            g = self.grads.pop(name)
            if self.finite:  # never write non-finite state
                self.loop.submit(name, g)

    def add_device(self, name: str, pages) -> None:
        """A device-cached stage's gradient pages: summed on the device over the
        micro-batches (as :meth:`add` does on the host), then averaged, its squared norm
        taken and its update dispatched, all without leaving the device."""
        g = self.device.slab(pages)
        if name in self.device_grads:
            g = self.device_grads[name] + g
        self.device_grads[name] = g
        self.remaining[name] -= 1
        if self.remaining[name] == 0:
            g, sq = self.device.average(self.device_grads.pop(name), self.divisor)
            self._device_sq.append(sq)
            self.loop.submit_device(name, g)

    def norm(self) -> float:
        assert not any(self.remaining.values()), self.remaining
        sq = self._sq + sum(float(s) for s in self._device_sq)  # waits for the device's
        return float(np.sqrt(self.sum_over_processes(sq)))
