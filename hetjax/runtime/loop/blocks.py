"""How the streaming runtime runs each block: one small strategy object per block, by
its kind in the schedule (``schedule.py``), holding that block's state from its forward
to its backward.

    Recomputed  keeps its input (a *boundary*, ``boundaries.py``) and recomputes its
                inside in backward (``jax.vjp`` of the block)
    Routed      a recomputed mixture-of-experts block that copies in only its routed
                experts (``routed.py``), keeping the routing for its backward
    Swapped     moves its in-block activations to host memory and back
                (``offload.swap_blocks``, ``stages.SwappedBlock``)
    Kept        keeps its in-block activations on the device (``offload.keep_blocks``)

Each has ``forward(slab, x, context, training) -> (y, statistics)`` (the block's
compute dispatched before its boundary's copy out), ``restore()`` (its backward's
inputs back to the device, dispatched once the block after it in forward has
dispatched its backward, which it then overlaps) and ``backward(slab, dy, dstats,
context, dcontext) -> (gradient, dx, dcontext)``, the gradient ``(pages, their
squared norms[, the pages known to be zero])``; ``evaluate(slab, x, context)`` is a
forward that keeps nothing. A stage group's input (``GroupInput``: the embed stage's,
T5's decoder input from the encoder's output) is a strategy of its own, holding the
group's context and its gradient.

Strategies look their jitted functions up in their group's :class:`GroupFunctions` at
each call (tests wrap them there), and hold their state with the runtime's ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hetjax import timeline
from hetjax.runtime.experts.routed import DeferredExperts, ExpertFetchers, Routing
from hetjax.runtime.loop.boundaries import Boundaries, SwappedResiduals
from hetjax.runtime.loop.ledger import Ledger
from hetjax.runtime.loop.schedule import BlockSlot, Schedule
from hetjax.runtime.stages.functions import GroupFunctions


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockParts:
    """What the blocks of a streaming run share."""

    boundaries: Boundaries
    residuals: SwappedResiduals  # the swapped blocks' activations in host memory
    ledger: Ledger
    swap_level: str  # offload.swap_level
    put_batch: Any  # a host array -> on the device like a batch
    experts: ExpertFetchers | None = None  # the routed groups' fetchers, by group
    deferred: DeferredExperts | None = None  # deferred expert updates


class Recomputed:
    """A block that keeps its input and recomputes its inside in backward."""

    def __init__(self, slot: BlockSlot, group: GroupFunctions, parts: BlockParts):
        self.slot, self.group, self.parts = slot, group, parts
        self.index, self.name = slot.index, slot.name
        self.x: Any = None  # its input, back on the device for backward

    def forward(self, slab, x, c, training: bool = True):
        out = self.group.block_fwd(slab, x, c)
        # the compute first: the store's copy out (and a swap's wait for a write slot)
        # then runs behind it, not in front of it in the device's queue
        self.parts.boundaries.store(self.index, x)
        return out

    def evaluate(self, slab, x, c):
        return self.group.block_fwd(slab, x, c)

    def restore(self) -> None:
        self.x = self.parts.boundaries.load(self.index)

    def backward(self, slab, dy, dstats, c, dcontext):
        x, self.x = self.x, None
        db, dx, dcontext = self.group.block_bwd(slab, x, dy, dstats, c, dcontext)
        self.parts.boundaries.drop(self.index)
        timeline.watch("compute", f"{self.name} bwd", (db, dx), after=(slab, x))
        return db, dx, dcontext

    def reset(self) -> None:
        """Drops what a pass left (one that failed midway)."""
        self.x = None


class Routed(Recomputed):
    """A recomputed block copying in only the experts its tokens were routed to
    (``routed.py``), forward and backward alike, with one routing decision."""

    routing: Routing | None = None

    def forward(self, slab, x, c, training: bool = True):
        y, stats, self.routing = self._route(slab, x, c, training)
        self.parts.boundaries.store(self.index, x)  # behind the compute (Recomputed's)
        self.parts.ledger.hold(("block", self.index), self.routing)
        return y, stats

    def evaluate(self, slab, x, c):
        return self._route(slab, x, c, training=False)[:2]

    def _route(self, slab, x, c, training: bool):
        """Attention and the router; the host reads which experts got tokens, only
        those are copied in (their deferred updates caught up first), the rest of the
        block runs. -> (y, statistics, the routing)."""
        fns, parts = self.group.routed(), self.parts
        x_mid, top_e, counts = fns.route(slab.dense, x, c)
        fetcher = parts.experts[self.group.index]
        routing = fetcher.routing(np.asarray(counts), top_e, parts.put_batch)
        parts.deferred.forward(self.name, fetcher, routing, training=training)
        held, copied = fetcher.experts(slab, routing, parts.deferred.fresh.get(self.name))
        timeline.watch("host_to_device", "experts", copied)
        y, stats = fns.mlp(held, x_mid, routing.top_e, routing.slots, c)
        return y, stats, routing

    def backward(self, slab, dy, dstats, c, dcontext):
        x, self.x = self.x, None
        r, self.routing = self.routing, None
        self.parts.ledger.release(("block", self.index))
        fetcher = self.parts.experts[self.group.index]
        fresh = self.parts.deferred.fresh.get(self.name)
        held, copied = fetcher.experts(slab, r, fresh)  # copied in again
        timeline.watch("host_to_device", "experts", copied)
        db, dx, dcontext = self.group.routed().backward(
            held, r.ids_device, r.top_e, r.slots, x, dy, dstats, c, dcontext
        )
        zero_pages = fetcher.unsent_pages(r.ids)
        del held, copied, r, fetcher
        self.parts.boundaries.drop(self.index)
        timeline.watch("compute", f"{self.name} bwd", (db, dx), after=(slab, x))
        return (*db, zero_pages), dx, dcontext

    def reset(self) -> None:
        super().reset()
        self.routing = None
        self.parts.ledger.release(("block", self.index))


class Swapped(Recomputed):
    """A block whose in-block activations go to host memory (NVMe with
    ``offload.swap_tier=nvme``) from its forward to its backward."""

    residuals: list | None = None  # on the host, then back on the device

    def _functions(self):
        return self.group.swapped(self.parts.swap_level)

    def forward(self, slab, x, c, training: bool = True):
        (y, stats), residuals = self._functions().forward(slab, x, c)
        self.residuals = self.parts.residuals.out(self.index, self.slot.swap_slot, residuals)
        self.parts.ledger.hold(("block", self.index), self.residuals)
        return y, stats

    def restore(self) -> None:
        back = self.parts.residuals.back(self.index, self.slot.swap_slot, self.residuals)
        self.residuals = back
        self.parts.ledger.hold(("block", self.index), back)

    def backward(self, slab, dy, dstats, c, dcontext):
        residuals, self.residuals = self.residuals, None
        self.parts.ledger.release(("block", self.index))
        db, dx, dcontext = self._functions().backward(slab, residuals, dy, dstats, c, dcontext)
        timeline.watch("compute", f"{self.name} bwd", (db, dx), after=(slab, residuals))
        return db, dx, dcontext

    def reset(self) -> None:
        self.residuals = None
        self.parts.ledger.release(("block", self.index))


class Kept(Recomputed):
    """A block that keeps its in-block activations (its vjp's residuals) on the device
    from forward to backward: no boundary, no recompute, no second fetch."""

    vjp: Any = None

    def forward(self, slab, x, c, training: bool = True):
        (y, stats), self.vjp = self.group.block_fwd_keep(slab, x, c)
        self.parts.ledger.hold(("block", self.index), self.vjp)
        return y, stats

    def restore(self) -> None:  # nothing left the device
        pass

    def backward(self, slab, dy, dstats, c, dcontext):
        vjp, self.vjp = self.vjp, None
        db, dx, dcontext = self.group.block_bwd_kept(vjp, dy, dstats, dcontext)
        timeline.watch("compute", f"{self.name} bwd", (db, dx), after=vjp)
        self.parts.ledger.release(("block", self.index))
        return db, dx, dcontext

    def reset(self) -> None:
        self.vjp = None
        self.parts.ledger.release(("block", self.index))


STRATEGIES = {"recompute": Recomputed, "routed": Routed, "swap": Swapped, "keep": Kept}


class GroupInput:
    """A stage group's input (``models/staged.py``): made from the embed stage and the
    previous group's output (None for the first group), which it keeps for its
    backward, with the group's context (T5's decoder: the encoder's output), read by
    every block of the group, and the sum of the blocks' gradients of it (``dcontext``,
    summed block by block in backward)."""

    def __init__(self, group: GroupFunctions):
        self.group, self.index = group, group.index
        self.reset()

    def reset(self) -> None:
        self.prev: Any = None
        self.context: Any = ()
        self.dcontext: Any = ()

    def forward(self, embed, x, tokens, targets, keep: bool = True):
        """-> the group's first block's input (B, T, D); the context is kept here, and
        ``x`` too while ``keep``."""
        self.prev = x if keep else None
        y, self.context = self.group.input_fwd(embed, x, tokens, targets)
        timeline.watch("compute", "embed fwd" if self.index == 0 else f"group{self.index} input", y)
        return y

    def begin_backward(self) -> None:
        """The group's last block's backward comes next: the context's gradient starts."""
        c = self.context
        self.dcontext = self.group.zero_context(c) if jax.tree.leaves(c) else ()

    def backward(self, embed, tokens, targets, dx):
        """-> (the embed stage's gradient (pages, norms), the previous group's output's
        gradient); the group's state goes."""
        de, dx = self.group.input_bwd(embed, self.prev, tokens, targets, dx, self.dcontext)
        name = "embed bwd" if self.index == 0 else f"group{self.index} input bwd"
        timeline.watch("compute", name, de)
        self.reset()
        return de, dx

    def state(self) -> tuple:
        """What it holds on the device (for the ledger)."""
        return self.prev, self.context, self.dcontext


def make_blocks(schedule: Schedule, groups: list[GroupFunctions], parts: BlockParts) -> tuple:
    """One strategy per block of ``schedule``, in forward order."""
    return tuple(STRATEGIES[s.kind](s, groups[s.group], parts) for s in schedule.blocks)
