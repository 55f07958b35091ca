"""The ledger: bytes the streaming runtime holds per memory kind at every dispatch of an
accounted step, with the peak per kind (what device and host budgets are checked against
on CPU, where no device memory statistics exist).

Which steps are accounted (:meth:`Ledger.begin_step`): a step run with a probe, a traced
step (``train.trace_every``) and the runtime's first training step. Every step of a run
holds the same arrays at the same dispatches, so the first step's peak is the run's; the
others skip the per-dispatch walk (a step's report has ``device_bytes_peak`` only when
the step was accounted)."""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable

import jax

from hetjax import timeline


def device_bytes(a: jax.Array) -> int:
    """Bytes of ``a`` on each device holding it: the whole array on one device or
    replicated, 1/N of it sharded over N devices."""
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


class Ledger:
    """Bytes held per memory kind on each device, with the peak per kind.

    What the runtime holds for long (resident slabs, boundaries, the blocks' state from
    forward to backward: as many as there are blocks) is *held* here by its holder as
    it comes and *released* as it goes, so that a record at each dispatch walks only
    what is held briefly (the window, gradients in flight, the current activation):
    a step's accounting is linear in its blocks, not quadratic. An array held by two
    holders (a kept block's vjp holding its slab's pages, a boundary that is also the
    current activation) counts once, as does one both held and passed to a record."""

    def __init__(self):
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = collections.defaultdict(int)
        self._held: dict[Hashable, list[tuple[int, str, int]]] = {}  # holder -> arrays
        self._holders: dict[int, int] = {}  # id(array) -> its holders
        self._standing: dict[str, int] = collections.defaultdict(int)  # held, by kind
        self.accounting = False  # whether the step under way is accounted
        self._accounted = False  # whether a step was

    def begin_step(self, probed: bool) -> bool:
        """Starts a training step: accounts it (and starts its peak afresh) if it runs
        with a probe (``probed``), is traced, or is the first. -> whether it is."""
        self.accounting = probed or timeline.active() is not None or not self._accounted
        if self.accounting:
            self._accounted = True
            self.reset_peak()
        return self.accounting

    def hold(self, key: Hashable, arrays) -> None:
        """``key``'s holder holds the JAX arrays of the pytree ``arrays`` (instead of
        what it held before). It must release them before it drops them: the ledger
        keeps their ids, not the arrays."""
        self.release(key)
        entries = []
        for a in jax.tree.leaves(arrays):
            if not isinstance(a, jax.Array):
                continue
            kind, n = a.sharding.memory_kind or "device", device_bytes(a)
            count = self._holders.get(id(a), 0)
            if count == 0:
                self._standing[kind] += n
            self._holders[id(a)] = count + 1
            entries.append((id(a), kind, n))
        if entries:
            self._held[key] = entries

    def release(self, key: Hashable) -> None:
        """``key``'s holder holds nothing any more (nothing happens if it held nothing)."""
        for ident, kind, n in self._held.pop(key, ()):
            count = self._holders[ident] - 1
            if count:
                self._holders[ident] = count
            else:
                del self._holders[ident]
                self._standing[kind] -= n

    def record(self, arrays, host_buffers: int = 0, device_buffers: int = 0) -> None:
        """Notes what is held now: the held arrays and ``arrays``, the JAX arrays held
        briefly; ``host_buffers``: bytes of host RAM held outside JAX (NVMe staging),
        counted in the ``pinned_host`` kind; ``device_buffers``: device bytes counted
        without their arrays (optimizer state on the device, whose chunks are too many
        to walk at every dispatch)."""
        totals: dict[str, int] = collections.defaultdict(int, self._standing)
        if host_buffers:
            totals["pinned_host"] += host_buffers
        if device_buffers:
            totals["device"] += device_buffers
        seen = set()
        for a in jax.tree.leaves(arrays):
            if not isinstance(a, jax.Array) or id(a) in seen or id(a) in self._holders:
                continue  # (host zeros: no JAX's)
            seen.add(id(a))
            totals[a.sharding.memory_kind or "device"] += device_bytes(a)
        self.current = {k: n for k, n in totals.items() if n}
        for kind, n in self.current.items():
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
