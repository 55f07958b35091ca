"""The NVMe tier's I/O buffers: a fixed pool of host slabs reused every step.

A streamed stage's state goes disk -> buffer -> (updated in place) -> disk. Allocating
those buffers per stage and step (TensorStore's read results, XLA's copies of them,
the write's copy of its source) kept the process's RSS at twice its live data and more:
glibc keeps freed large blocks in per-thread heaps, fragmented (``census``;
docs/results/2026-11-23.md).
The pool allocates its slots once; TensorStore reads into them and writes from them
without a copy, and the host optimizer's native kernel updates them in place.

A slot holds one stage's slabs of every kind (sized for the biggest stage), each in its
kind's dtype (the optimizer's state format, ``state_format.py``). Its life:
taken for a read (``take``), held while the stage updates, and given back with the
futures of the I/O that still uses it (``give``: the write-back, or a read-ahead that a
commit made stale); it is free again once those are done. The number of slots is the
host plan's (``memory.IO_SLOTS``: the stages read ahead, the one updating and the one
being written), so the pool is what the plan counts as optimizer I/O buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import threading
from collections.abc import Mapping

import numpy as np

from hetjax.storage.pages import DIRECT_ALIGN, aligned_empty


@dataclasses.dataclass(eq=False)
class Slot:
    """One stage's buffers, a flat array per kind (in its dtype)."""

    arrays: dict[str, np.ndarray]
    stage: str = ""  # the stage it was last taken for (named when the pool runs out)
    pending: list = dataclasses.field(default_factory=list)  # I/O futures to outlive

    def view(self, kind: str, elems: int) -> np.ndarray:
        return self.arrays[kind][:elems]


class IoPool:
    """``slots`` slots of ``elems`` elements per kind, each kind in its dtype in
    ``dtypes`` (``{kind: dtype}``, e.g. ``StateFormat.dtypes``), allocated on first use."""

    def __init__(self, dtypes: Mapping[str, np.dtype], elems: int, slots: int):
        self.dtypes = {k: np.dtype(d) for k, d in dtypes.items()}
        self.kinds, self.elems, self.size = list(self.dtypes), elems, slots
        self._slots: list[Slot] = []
        self._returned: list[Slot] = []  # given back, free once their I/O is done

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now (all its slots, once allocated)."""
        return len(self._slots) * self.elems * sum(d.itemsize for d in self.dtypes.values())

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies in one of the pool's buffers."""
        return any(
            np.may_share_memory(array, a) for slot in self._slots for a in slot.arrays.values()
        )

    def take(self, stage: str) -> Slot:
        """A free slot for ``stage``'s I/O; waits for a returned slot's I/O when all are
        taken. Raises ``RuntimeError`` when every slot is held by a stage not given back
        (a caller's bug: the plan counts this many)."""
        slot = self._free() or self._allocate()
        if slot is None:
            if not self._returned:
                held = ", ".join(s.stage for s in self._slots)
                raise RuntimeError(
                    f"all {self.size} optimizer I/O buffers are held (stages {held}): a "
                    "stage was read and never written back or dropped"
                )
            slot = self._returned.pop(0)
            _wait(slot.pending)
            slot.pending = []
        slot.stage = stage
        return slot

    def give(self, slot: Slot, pending=()) -> None:
        """Gives ``slot`` back; it is reused once the futures in ``pending`` are done
        (their errors are their owners' to raise)."""
        slot.pending = list(pending)
        self._returned.append(slot)

    def _free(self) -> Slot | None:
        for slot in self._returned:
            if all(f.done() for f in slot.pending):
                self._returned.remove(slot)
                slot.pending = []
                return slot
        return None

    def _allocate(self) -> Slot | None:
        if len(self._slots) >= self.size:
            return None
        slot = Slot({k: aligned_empty(self.elems, d, DIRECT_ALIGN) for k, d in self.dtypes.items()})
        self._slots.append(slot)
        return slot


def _wait(futures) -> None:
    for future in futures:
        with contextlib.suppress(Exception):  # the future's owner raises its error
            future.result()


class SlabPool:
    """Flat aligned host slabs reused by size and dtype: the compute-dtype params the NVMe
    tier reads and the host optimizer writes, one stage's worth at a time, every step.

    Allocated afresh, each such slab is a fresh mapping under a host budget's allocator
    settings (``allocator.MALLOC_ENV``: every block over 1 MiB mapped and unmapped), a
    page fault per 4 KiB of it; without them glibc keeps the freed slabs in its heaps,
    fragmented between the step's other buffers, above the budget. Reused, they fault
    once. A slab has no single owner to give it back: it is handed to the window, cut
    into leaf views, put on the device (on the CPU backend JAX aliases an aligned numpy
    array instead of copying it, and holds a reference to its memory while it does),
    read into and written from by TensorStore. So a slab is free again when nothing but
    the pool refers to it or to its memory (CPython reference counts: every view, JAX
    alias and TensorStore transfer holds one). The pool keeps at most ``max_bytes`` of
    slabs (what the host plan counts as param slabs); past that :meth:`take` allocates
    slabs the pool does not keep (what the allocator did before), so a holder the plan
    did not foresee costs speed, not RAM."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._slabs: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.reused = self.allocated = 0  # slabs handed out from the pool / new

    def take(self, elems: int, dtype) -> np.ndarray:
        """A flat slab of ``elems`` elements of ``dtype`` that nothing else refers to
        (contents undefined)."""
        key = (elems, np.dtype(dtype))
        with self._lock:
            slabs = self._slabs.setdefault(key, [])
            for collect in (False, True):
                if collect and slabs:
                    # A JAX array lets go of the host memory it aliased only when the
                    # cyclic collector frees it (it sits in a young reference cycle)
                    gc.collect(0)
                for slab in slabs:
                    if _unreferenced(slab):
                        self.reused += 1
                        return slab
            self.allocated += 1
            slab = aligned_empty(elems, dtype, DIRECT_ALIGN)
            if self.nbytes + slab.nbytes <= self.max_bytes:
                slabs.append(slab)
            return slab

    @property
    def nbytes(self) -> int:
        """Bytes of the slabs the pool keeps (free or handed out)."""
        return sum(s.nbytes for slabs in self._slabs.values() for s in slabs)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies in one of the pool's slabs."""
        slabs = [s for group in self._slabs.values() for s in group]
        return any(np.may_share_memory(array, s) for s in slabs)


# References to a pooled slab when only the pool holds it, as sys.getrefcount sees them
# from _unreferenced: the pool's list (1), the loop's name (1), the call's argument (1),
# getrefcount's own (1); and to the memory it is a view of (``aligned_empty``'s raw
# buffer): the slab's (1), getrefcount's (1). A view of the slab refers to the raw buffer,
# TensorStore and JAX to the array they were given (a view or the slab).
_FREE_SLAB_REFS, _FREE_RAW_REFS = 4, 2


def _unreferenced(slab: np.ndarray) -> bool:
    return sys.getrefcount(slab) == _FREE_SLAB_REFS and sys.getrefcount(slab.base) == _FREE_RAW_REFS
