"""Where the gradients kept for a clipping redo wait: in RAM, or spilled to TensorStore
page arrays on NVMe. How many stages' gradients RAM holds, and which spill, is the memory
model's decision (``hetjax/memory.py``: :func:`~hetjax.memory.plan_gradients`, with the
policies explained there)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hetjax.storage.nvme import PageStore, bound_writes
from hetjax.storage.pages import GradPages
from hetjax.storage.stripes import Stripes


class GradientStore:
    """A step's gradient slabs from the moment their speculative update consumed them
    until the step ends, for a redo with the clip factor: in RAM, or (the stages in
    ``spilled``) written to TensorStore page arrays under ``path``, one per dtype.
    ``keep`` False: nothing can redo an update, so nothing is kept.

    Used by the optimizer loop's thread only; ``host_bytes`` may be read from another."""

    def __init__(
        self,
        keep: bool,
        spilled: dict[str, tuple[int, np.dtype]] | None = None,
        path: Path | None = None,
        page_elems: int = 0,
        stripes: Stripes | None = None,
    ):
        """``spilled``: stage -> (pages, dtype) of its gradient slab; ``stripes``: the
        drives the spilled pages stripe over (``stripes.py``)."""
        self.keep_grads = keep
        self.page_elems = page_elems
        spilled = spilled or {}
        dtypes = sorted({jnp.dtype(d).name for _, d in spilled.values()})
        self.where: dict[str, tuple[str, int, int]] = {}  # stage -> (kind, first page, pages)
        first = 0
        for stage, (n, dtype) in spilled.items():
            self.where[stage] = (jnp.dtype(dtype).name, first, n)
            first += n
        self.disk = None
        if spilled:
            self.disk = PageStore(
                Path(path), {d: d for d in dtypes}, first, page_elems, stripes=stripes
            )
        itemsize = lambda kind: jnp.dtype(kind).itemsize
        self.nvme_bytes = sum(n * page_elems * itemsize(k) for k, _, n in self.where.values())
        biggest = max((n * page_elems * itemsize(k) for k, _, n in self.where.values()), default=0)
        self._write_window = biggest  # one stage's write in flight
        self.ram: dict[str, np.ndarray] = {}
        self._reads: dict = {}
        self._writes: list = []
        self._ram_bytes = self._io_bytes = 0  # ints: read without a lock by host_bytes
        self.read_bytes = self.write_bytes = 0

    def keep(self, stage: str, grad: np.ndarray | GradPages) -> None:
        """After ``stage``'s speculative update: keeps its gradient (a flat slab, or the
        pages it reached the host in) in RAM or written to NVMe (asynchronously) until
        :meth:`clear`, or drops it (``keep`` False)."""
        if not self.keep_grads:
            return
        if stage not in self.where:
            self.ram[stage] = grad
            self._ram_bytes += grad.nbytes
            return
        kind, first, _ = self.where[stage]
        data = grad.slab() if isinstance(grad, GradPages) else np.asarray(grad)
        self._writes.append((self.disk.write(kind, first, data), data))
        self.write_bytes += data.nbytes
        bound_writes(self._writes, self._write_window)
        self._io_bytes = sum(d.nbytes for _, d in self._writes)

    def prefetch(self, stage: str) -> None:
        """Starts reading a spilled stage's gradient back (no-op for the others)."""
        if stage in self.where and stage not in self._reads:
            kind, first, n = self.where[stage]
            self._reads[stage] = self.disk.read(kind, first, n)

    def take(self, stage: str) -> np.ndarray | GradPages:
        """A kept gradient, once (for the redo), as it was kept or (spilled) a flat
        slab; waits for its read."""
        if stage not in self.where:
            grad = self.ram.pop(stage)
            self._ram_bytes -= grad.nbytes
            return grad
        self.prefetch(stage)
        grad = self._reads.pop(stage).result().reshape(-1)
        self.read_bytes += grad.nbytes
        return grad

    def wait_writes(self) -> None:
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self._io_bytes = 0

    def clear(self) -> None:
        """The step ended: forgets every kept gradient."""
        self.wait_writes()
        self.ram.clear()
        self._reads.clear()
        self._ram_bytes = 0

    def host_bytes(self) -> int:
        """Bytes held in RAM now: kept gradients and spill writes in flight."""
        return self._ram_bytes + self._io_bytes
