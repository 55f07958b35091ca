"""One step's gradients, collected as they leave the device.

The thread that dispatches device work must not do host work on a gradient: on an
accelerator that thread keeps the device busy, and numpy over a d=4096 block's
gradient (concatenate, cast, norm: ~0.8 s per 1e9 parameters) takes longer than the
block's backward. So the dispatching thread only hands each gradient (its pages, as the
device-to-host copy will fill them, and its pages' squared norms, a device reduction
inside the jitted backward) to a gradient thread of the step and goes on dispatching;
the gradient thread waits for the copy and does what host work remains. A stage's one
and only contribution (one micro-batch, sync mode, no loss scale) is handed to the
optimizer loop as the pages it landed in, untouched: the optimizer reads them where
they are (``optimizer/native.py``). Sums over micro-batches (and the embedding's two
parts: the tied head's and its own) are accumulated there, in fp32 host slabs.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.memory import HANDOFF_DEPTH
from hetjax.optimizer.update_loop import UpdateLoop
from hetjax.storage.pages import GradPages, aligned_concatenate, zero_page

F32 = jnp.float32


def to_host(g: list[jax.Array], zero_pages: frozenset[int] = frozenset()) -> tuple[list, list]:
    """A gradient's pages copied to ``pinned_host`` (dispatched, not waited for), but
    ``zero_pages``, pages known to be zero (a routed block's experts that got no token):
    the host takes zeros of its own for them. -> (the pages on the host, those copied)."""
    host = jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), g)
    if not zero_pages:
        on_host = jax.device_put(g, host)
        return on_host, on_host
    sent = [k for k in range(len(g)) if k not in zero_pages]
    copied = iter(jax.device_put([g[k] for k in sent], [host[k] for k in sent]))
    on_host = [
        zero_page(p.shape, p.dtype) if k in zero_pages else next(copied) for k, p in enumerate(g)
    ]
    return on_host, [on_host[k] for k in sent]


class StepAbandoned(RuntimeError):
    """The step's dispatching thread failed: its gradient thread drops the rest."""


class DeviceGradients:
    """The device cache's gradient arithmetic, jitted once per runtime: a gradient's
    pages -> one fp32 slab on the device, and a summed slab -> (its average, the
    average's squared norm)."""

    def __init__(self, device: jax.sharding.Sharding):
        self.device = device
        self._slab = jax.jit(
            lambda pages: jnp.concatenate([p.astype(F32).reshape(-1) for p in pages]),
            out_shardings=device,
        )
        self._flat = jax.jit(lambda shard: shard.astype(F32).reshape(-1))
        # the divisor is static (one per run): a Python float argument would be an
        # implicit host-to-device transfer every step
        self.average = jax.jit(
            lambda g, d: (g / d, jnp.dot(g / d, g / d, precision="highest")), static_argnums=1
        )

    def slab(self, pages):
        """A gradient as its stage function returned it (a list of pages; ZeRO-3: a
        ``(pages, page_elems)`` slab sharded over the mesh) -> this process's pages as one
        fp32 slab on the device cache's device (ZeRO-3: its devices' shards, in page
        order: the pages its optimizer updates; each on its own device where the device cache
        spans the process's devices)."""
        if not isinstance(pages, jax.Array):
            return self._slab(pages)
        shards = sorted(pages.addressable_shards, key=lambda s: s.index[0].start or 0)
        if len(self.device.device_set) == 1:
            return self._slab([jax.device_put(s.data, self.device) for s in shards])
        # each device's shard flattened where it is, the whole a global slab over them
        # (``optimizer/sharded_slab.py``): no copy between devices
        devices = list(self.device.mesh.devices.flat)
        assert [s.device for s in shards] == devices, (shards, devices)
        flat = [self._flat(s.data) for s in shards]
        size = sum(f.shape[0] for f in flat)
        return jax.make_array_from_single_device_arrays((size,), self.device, flat)


class StepGradients:
    """One step's gradients, from the device to the optimizer loop.

    The dispatching thread calls :meth:`add` with a stage's gradient on its way to the
    host and the per-page squared norms its backward computed; a gradient thread of the
    step takes it from there, in the order given. A stage's gradient is final after its
    last contribution of the last micro-batch (embed has one per micro-batch from the
    head, tied or not, and one from each stage group's input's backward). Its squared
    norm (the backward's, or for a sum the host's) is added to the global norm and, in
    sync mode, the gradient is handed to the optimizer ``loop`` at once, which owns it
    from then on (``storage/gradients.py``): it is not held here. A single contribution
    with no loss scale goes as the pages it landed in; sums are fp32 host slabs, averaged
    (loss scale removed). Lock-free mode (``loop`` None) keeps them all, as fp32 slabs,
    for the loop's accumulator.

    Device-cached stages (sync mode) take the same steps on the device
    (:meth:`add_device`, on the dispatching thread: it dispatches device work only):
    their squared norms stay device scalars until :meth:`norm`."""

    def __init__(
        self,
        stage_names: list[str],
        *,
        groups: int,
        micro_batches: int,
        scale: float,
        seed: float,
        loop: UpdateLoop | None,
        host_grad: Callable[[object], GradPages],
        host_sq: Callable[[object], float],
        sum_over_processes: Callable[[float], float],
        device: DeviceGradients | None = None,
    ):
        embed_uses = 1 + groups  # the head's and each group input's backward
        self.remaining = {
            n: micro_batches * (embed_uses if n == "embed" else 1) for n in stage_names
        }
        self.divisor = micro_batches * scale
        self.scale = scale
        self.seed = seed  # the loss cotangent: the scale (NaN when a fault is injected)
        self.loop = loop
        self.host_grad, self.host_sq = host_grad, host_sq
        self.sum_over_processes = sum_over_processes
        self.device = device
        self.finite = True  # once a gradient is not finite, nothing more is submitted
        self.grads: dict[str, np.ndarray] = {}  # sums (and, lock-free, every stage)
        self.peak_bytes = 0  # gradient bytes held on the host (here and by the loop)
        self._sq = 0.0
        self.stage_sq: dict[str, float] = {}  # each host stage's averaged squared norm
        self.device_grads: dict[str, jax.Array] = {}  # device-cached stages' sums
        self._device_sq: list[jax.Array] = []
        # Seconds the dispatching thread spent here instead of dispatching device work,
        # and the part of it waiting for room in the hand-off: the gradient thread was
        # then waiting for a copy (the device behind the dispatching thread: it has work
        # queued, nothing idles) or for the optimizer loop (a sync run's back-pressure);
        # the gradient thread's two waits tell which.
        self.dispatch_outside_s = 0.0
        self.handoff_wait_s = 0.0
        self.copy_wait_s = 0.0  # the gradient thread waiting for gradients' copies
        self.loop_wait_s = 0.0  # the gradient thread waiting to hand one to the loop
        # The gradient thread's work: (stage, gradient on its way to the host, its pages'
        # squared norms); at most HANDOFF_DEPTH wait (device-to-host copies in flight).
        self._work: queue.Queue = queue.Queue(maxsize=HANDOFF_DEPTH)
        # The micro-batch's last HANDOFF_DEPTH gradients handed over: counted (and held)
        # as in flight, as the memory model counts them (memory.D2H_SLABS), whether or
        # not the gradient thread has taken them yet.
        self._recent: collections.deque = collections.deque(maxlen=HANDOFF_DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetjax-gradients", daemon=True)
        self._thread.start()

    # -- the dispatching thread ---------------------------------------------------------

    def add(self, name: str, grad, sq) -> None:
        """Hands ``name``'s gradient over: ``grad`` its pages on the way to the host
        (dispatched copies), ``sq`` its pages' squared norms (a device array). Returns at
        once unless HANDOFF_DEPTH gradients are still waiting for the gradient thread."""
        t0 = time.perf_counter()
        self._raise()
        self._recent.append(grad)
        t1 = time.perf_counter()
        self._work.put((name, grad, sq))
        t2 = time.perf_counter()
        self.dispatch_outside_s += t2 - t0
        self.handoff_wait_s += t2 - t1  # the hand-off full: see grad_copy_wait_s

    def in_flight(self) -> list:
        """The gradients in flight to the host (the ledger counts them): the last
        HANDOFF_DEPTH handed over in this micro-batch."""
        return list(self._recent)

    def micro_batch_sent(self) -> None:
        """The micro-batch's gradients are all handed over: none is held as in flight
        through the next micro-batch's forward."""
        self._recent.clear()

    def add_device(self, name: str, pages) -> None:
        """A device-cached stage's gradient pages: summed on the device over the
        micro-batches (as the host does), then averaged, its squared norm taken and its
        update dispatched, all without leaving the device."""
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
        """The global gradient norm, once every gradient is in: waits for the gradient
        thread to finish the step (and raises what it raised)."""
        self.close()
        assert not any(self.remaining.values()), self.remaining
        sq = self._sq + sum(float(s) for s in self._device_sq)  # waits for the device's
        return float(np.sqrt(self.sum_over_processes(sq)))

    def close(self, abandon: bool = False) -> None:
        """Ends the gradient thread after what it was handed (``abandon``: the step
        failed; what is still waiting is dropped, nothing more goes to the loop)."""
        if abandon and self._error is None:
            self._error = StepAbandoned("the step failed on the dispatching thread")
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the gradient thread ------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if self._error is None:  # after a failure, only drained
                try:
                    self._take(*item)
                except BaseException as e:  # raised on the dispatching thread
                    self._error = e
            del item

    def _take(self, name: str, grad, sq) -> None:
        t0 = time.perf_counter()
        pages = self.host_grad(grad)  # waits for this gradient's copy only
        self.copy_wait_s += time.perf_counter() - t0
        del grad
        self.remaining[name] -= 1
        final = self.remaining[name] == 0
        whole = final and name not in self.grads  # the stage's one contribution
        if whole and self.loop is not None and self.divisor == 1:
            g, stage_sq = pages, self.host_sq(sq)  # handed on as it landed
        else:
            if name in self.grads:
                acc, n = self.grads[name], pages.page_elems
                for k, page in enumerate(pages.pages):
                    acc[k * n : (k + 1) * n] += page
            else:  # a slab of its own: summed into, divided, kept past the step
                self.grads[name] = aligned_concatenate(pages.pages)
            del pages
            if not final:
                self._held()
                return
            g = self.grads[name]
            if self.divisor != 1:
                g /= self.divisor
            if whole:  # the backward's norm, of the gradient before the division
                stage_sq = self.host_sq(sq) / self.divisor**2
            else:
                g32 = g if g.dtype == np.float32 else g.astype(np.float32)
                stage_sq = float(np.dot(g32, g32))
                del g32
            if self.loop is not None:
                del self.grads[name]
        self.stage_sq[name] = stage_sq
        self._sq += stage_sq
        self.finite = self.finite and bool(np.isfinite(stage_sq))
        self._held(g if self.loop is not None else None)
        if self.loop is not None and self.finite:  # never write non-finite state
            t0 = time.perf_counter()
            self.loop.submit(name, g)
            self.loop_wait_s += time.perf_counter() - t0

    def _held(self, passing=None) -> None:
        """Records the gradient bytes the host holds now (``passing``: one on its way
        to the loop)."""
        held = sum(a.nbytes for a in self.grads.values())
        if passing is not None:
            held += passing.nbytes
        if self.loop is not None:
            held += self.loop.grad_host_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
