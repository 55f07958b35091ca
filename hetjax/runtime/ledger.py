"""The ledger: bytes the streaming runtime holds per memory kind, recomputed from its own
containers at every dispatch, with the peak per kind (what device and host budgets are
checked against on CPU, where no device memory statistics exist)."""

from __future__ import annotations

import collections
import math

import jax


def device_bytes(a: jax.Array) -> int:
    """Bytes of ``a`` on each device holding it: the whole array on one device or
    replicated, 1/N of it sharded over N devices."""
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


class Ledger:
    """Bytes held per memory kind on each device, recomputed from the streaming runtime's own
    containers at every dispatch, with the peak per kind."""

    def __init__(self):
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = collections.defaultdict(int)

    def record(self, arrays, host_buffers: int = 0, device_buffers: int = 0) -> None:
        """``arrays``: the JAX arrays held; ``host_buffers``: bytes of host RAM held
        outside JAX (NVMe staging), counted in the ``pinned_host`` kind;
        ``device_buffers``: device bytes counted without their arrays (optimizer state
        on the device, whose chunks are too many to walk at every dispatch)."""
        totals: dict[str, int] = collections.defaultdict(int)
        if host_buffers:
            totals["pinned_host"] = host_buffers
        if device_buffers:
            totals["device"] = device_buffers
        seen = set()
        for a in jax.tree.leaves(arrays):
            if id(a) in seen or not isinstance(a, jax.Array):  # (host zeros: no JAX's)
                continue
            seen.add(id(a))
            totals[a.sharding.memory_kind or "device"] += device_bytes(a)
        self.current = dict(totals)
        for kind, n in totals.items():
            self.peak[kind] = max(self.peak[kind], n)

    def reset_peak(self) -> None:
        self.peak = collections.defaultdict(int)


class IoMeter:
    """NVMe bytes read and written by a set of stores, counted from a mark: each step
    reports its own I/O (not initialisation's, not a restore's)."""

    def __init__(self, stores):
        self.stores = [s for s in stores if s is not None]
        self._mark = self._totals()

    def _totals(self) -> tuple[int, int]:
        return sum(s.read_bytes for s in self.stores), sum(s.write_bytes for s in self.stores)

    def mark(self) -> None:
        """Starts counting afresh (what happened before belongs to no step)."""
        self._mark = self._totals()

    def take(self) -> tuple[int, int]:
        """(read, written) bytes since the mark; then marks."""
        read, written = self._totals()
        delta = read - self._mark[0], written - self._mark[1]
        self._mark = read, written
        return delta

    @property
    def nvme_bytes(self) -> int:
        """Bytes the stores hold on NVMe."""
        return sum(s.nvme_bytes for s in self.stores)
