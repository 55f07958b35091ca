"""The NVMe tier's I/O buffers: a fixed pool of host slabs reused every step.

A streamed stage's state goes disk -> buffer -> (updated in place) -> disk. Allocating
those buffers per stage and step (TensorStore's read results, XLA's copies of them,
the write's copy of its source) kept the process's RSS at twice its live data and more:
glibc keeps freed large blocks in per-thread heaps, fragmented (``census``; measured in
docs/results/2026-11-23.md: 8.45 GiB retained against 0.40 GiB in use at 310M params).
The pool allocates its slots once; TensorStore reads into them and writes from them
without a copy, and the host optimizer's native kernel updates them in place.

A slot holds one stage's slabs of every kind (sized for the biggest stage). Its life:
taken for a read (``take``), held while the stage updates, and given back with the
futures of the I/O that still uses it (``give``: the write-back, or a read-ahead that a
commit made stale); it is free again once those are done. The number of slots is the
host plan's (``memory.IO_SLOTS``: the stages read ahead, the one updating and the one
being written), so the pool is what the plan counts as optimizer I/O buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from hetjax.storage.pages import aligned_empty


@dataclasses.dataclass(eq=False)
class Slot:
    """One stage's buffers, a flat float32 array per kind."""

    arrays: dict[str, np.ndarray]
    stage: str = ""  # the stage it was last taken for (named when the pool runs out)
    pending: list = dataclasses.field(default_factory=list)  # I/O futures to outlive

    def view(self, kind: str, elems: int) -> np.ndarray:
        return self.arrays[kind][:elems]


class IoPool:
    """``slots`` slots of ``elems`` float32 elements per kind, allocated on first use."""

    def __init__(self, kinds: list[str], elems: int, slots: int):
        self.kinds, self.elems, self.size = list(kinds), elems, slots
        self._slots: list[Slot] = []
        self._returned: list[Slot] = []  # given back, free once their I/O is done

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now (all its slots, once allocated)."""
        return len(self._slots) * len(self.kinds) * self.elems * 4

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
        slot = Slot({k: aligned_empty(self.elems, np.float32) for k in self.kinds})
        self._slots.append(slot)
        return slot


def _wait(futures) -> None:
    for future in futures:
        with contextlib.suppress(Exception):  # the future's owner raises its error
            future.result()
