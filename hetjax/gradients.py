"""The host's gradient buffers: how many stages' gradients RAM holds, and where the
gradients kept for a clipping redo wait (RAM or NVMe).

In sync mode the executor hands each stage's final gradient slab to the optimizer loop
(``update_loop.py``) the moment it reaches the host, in backward order. What happens to
it after its speculative update depends on whether the step can still be *redone*
(``optimizer.grad_clip > 0``: when the global norm turns out above the threshold every
stage is updated again, in backward order, with the clip factor):

* ``release`` (no clipping): nothing can redo the update, so the slab is dropped as
  soon as the update consumed it. When not all of them fit ``memory.host_budget``, the
  executor waits while the loop has :data:`GRAD_QUEUE` stages not yet updated
  (backpressure), so RAM holds only the stages in flight (:func:`in_flight_slabs`), not
  all of them; with room (or no budget) backward never waits for the loop.
* ``keep`` (clipping): every stage's gradient is kept until the step commits. They stay
  in RAM while they fit ``memory.host_budget``; otherwise the plan keeps as many as fit
  and spills the others to NVMe (ZeRO-Infinity offloads gradients too): a TensorStore
  array next to the optimizer state, in the dtype the buffer already has, written right
  after the stage's speculative update and read back (ahead, in backward order) only
  by a redo. Spilled are the stages backward produces *first* (head, the last blocks):
  their writes overlap the rest of backward, and the last ones, which would be written
  at the very end of the step, stay in RAM.
* ``accumulate`` (``train.grad_accum > 1``): every stage's buffer sums over the
  micro-batches, so all are held the whole step. ``lockfree``: all of them twice (the
  loop's accumulator and the step being filled).

The embed's buffer is held all through backward in every policy: its tied-head part
arrives first and its own gradient last.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hetjax.config import format_bytes
from hetjax.nvme import PageStore, bound_writes

POLICIES = ("release", "keep", "accumulate", "lockfree")
GRAD_QUEUE = 1  # stages the loop holds not yet updated (the one updating) before submit waits
# Gradient slabs a bounded host holds besides the embed's and the kept ones: the
# executor's two device-to-host copies in flight plus the one being turned into a host
# slab (executor._send_grad), that slab (waiting for room in the loop), the GRAD_QUEUE
# the loop holds and, when gradients are kept, one being written to NVMe.
D2H_SLABS = 3


def in_flight_slabs(keep: bool) -> int:
    """Gradient slabs in flight on the host when buffers are bounded (see above)."""
    return D2H_SLABS + 1 + GRAD_QUEUE + (1 if keep else 0)


@dataclasses.dataclass(frozen=True)
class GradientPlan:
    """What the gradient buffers hold in host RAM and on NVMe, in bytes."""

    policy: str  # release | keep | accumulate | lockfree
    all_bytes: int  # every stage's buffer once (what "all in RAM" means)
    ram_bytes: int  # host RAM at most
    max_queued: int  # stages the loop may hold not yet updated; 0: no limit
    ram_stages: tuple[str, ...]  # kept for a redo in RAM (keep)
    spilled: tuple[str, ...]  # kept for a redo on NVMe (keep), in backward order
    spill_bytes: int  # their bytes on disk

    @property
    def bounded(self) -> bool:
        return self.max_queued > 0

    def describe(self) -> str:
        if not self.bounded:
            times = " x2" if self.policy == "lockfree" else ""
            return f"gradient buffers {format_bytes(self.ram_bytes)} (every stage{times})"
        if self.policy == "release":
            return (
                f"gradient buffers {format_bytes(self.ram_bytes)} (stages in flight only, "
                f"of {format_bytes(self.all_bytes)}: no clipping, each dropped once updated)"
            )
        n = len(self.ram_stages) + len(self.spilled)
        return (
            f"gradient buffers {format_bytes(self.ram_bytes)} (in flight + {len(self.ram_stages)} "
            f"of {n} stages kept for a clipping redo; {len(self.spilled)} spilled to NVMe, "
            f"{format_bytes(self.spill_bytes)})"
        )


def plan_gradients(
    sizes: dict[str, int], order: list[str], policy: str, room: int | None, spill: bool
) -> GradientPlan:
    """Plans the gradient buffers of stages with slab bytes ``sizes`` produced in
    ``order`` (backward order; the last one, the embed, is held all through backward;
    when the embed's state is on the device, the last one reaching the host is counted
    as held all through backward, which is more than it is).
    ``room``: host bytes left for them by the rest of the working set (None: no budget).
    ``spill``: whether kept gradients may go to NVMe. All buffers stay in RAM when they
    fit ``room`` (or under ``release``, when in-flight ones would be as much); else
    ``release`` bounds them to the stages in flight and ``keep`` keeps as many of the
    last-produced stages in RAM as fit and spills the others. The returned plan may
    exceed ``room``: the caller reports the shortfall."""
    assert policy in POLICIES, policy
    if not order:  # every stage's gradient stays on the device (its state is there)
        return GradientPlan(policy, 0, 0, 0, (), (), 0)
    total = sum(sizes.values())
    everything = GradientPlan(
        policy,
        total,
        2 * total if policy == "lockfree" else total,
        0,
        tuple(order) if policy == "keep" else (),
        (),
        0,
    )
    if policy in ("accumulate", "lockfree"):
        return everything
    held = order[-1]  # the embed
    slab = max((sizes[s] for s in order[:-1]), default=0)
    window = sizes[held] + in_flight_slabs(policy == "keep") * slab
    if policy == "release":
        # Without a budget, or with room for all of them, backward never waits for the
        # optimizer: it may run ahead of an I/O-bound update loop by several stages.
        if room is None or total <= room or window >= total:
            return everything
        return GradientPlan(policy, total, window, GRAD_QUEUE, (), (), 0)
    if room is None or total <= room or not spill:
        return everything
    spare = room - window
    kept = [held]
    for stage in reversed(order[:-1]):  # the last-produced first
        if sizes[stage] > spare:
            break
        kept.append(stage)
        spare -= sizes[stage]
    spilled = tuple(s for s in order if s not in kept)
    ram = window + sum(sizes[s] for s in kept if s != held)
    spill_bytes = sum(sizes[s] for s in spilled)
    return GradientPlan(
        policy, total, ram, GRAD_QUEUE, tuple(s for s in order if s in kept), spilled, spill_bytes
    )


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
    ):
        """``spilled``: stage -> (pages, dtype) of its gradient slab."""
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
            self.disk = PageStore(Path(path), {d: d for d in dtypes}, first, page_elems)
        itemsize = lambda kind: jnp.dtype(kind).itemsize
        self.nvme_bytes = sum(n * page_elems * itemsize(k) for k, _, n in self.where.values())
        biggest = max((n * page_elems * itemsize(k) for k, _, n in self.where.values()), default=0)
        self._write_window = biggest  # one stage's write in flight
        self.ram: dict[str, np.ndarray] = {}
        self._reads: dict = {}
        self._writes: list = []
        self._ram_bytes = self._io_bytes = 0  # ints: read without a lock by host_bytes
        self.read_bytes = self.write_bytes = 0

    def keep(self, stage: str, grad: np.ndarray) -> None:
        """After ``stage``'s speculative update: keeps its gradient (in RAM or written
        to NVMe, asynchronously) until :meth:`clear`, or drops it (``keep`` False)."""
        if not self.keep_grads:
            return
        if stage not in self.where:
            self.ram[stage] = grad
            self._ram_bytes += grad.nbytes
            return
        kind, first, _ = self.where[stage]
        data = np.asarray(grad)
        self._writes.append((self.disk.write(kind, first, data), data))
        self.write_bytes += data.nbytes
        bound_writes(self._writes, self._write_window)
        self._io_bytes = sum(d.nbytes for _, d in self._writes)

    def prefetch(self, stage: str) -> None:
        """Starts reading a spilled stage's gradient back (no-op for the others)."""
        if stage in self.where and stage not in self._reads:
            kind, first, n = self.where[stage]
            self._reads[stage] = self.disk.read(kind, first, n)

    def take(self, stage: str) -> np.ndarray:
        """A kept gradient, once (for the redo); waits for its read."""
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
