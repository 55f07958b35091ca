"""A micro-batch's schedule in the streaming runtime: each block's kind, where it is in
its stage group, and its uses of the prefetch window in forward and backward, worked
out once from the config so that the per-layer loop walks it instead of doing index
arithmetic.

Blocks are, in forward order (``offload.keep_blocks`` and ``offload.swap_blocks``)::

    recompute / routed ... | swap ... | keep ...
    0                        first_swap  first_kept      L

A kept block uses the window once (forward); every other block twice: forward, then
backward, in reverse order, after the kept blocks' backwards, which need no slab. The
window's use order is therefore every block in forward order, then the streamed
(non-kept) blocks in backward order.
"""

from __future__ import annotations

import dataclasses

KINDS = ("recompute", "routed", "swap", "keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSlot:
    """One block's place in the schedule."""

    index: int  # forward order over every group's blocks
    name: str  # its stage name (``block3``, ``decoder0``, ...)
    group: int  # its stage group
    kind: str  # one of KINDS
    forward_use: int  # its position in the window's use order in forward
    backward_use: int | None  # ... in backward; None: kept (no slab in backward)
    group_first: bool  # the group's input runs before it (forward) / after it (backward)
    group_last: bool  # backward starts the group's context gradient here
    # the block whose backward inputs (boundary, swapped residuals) come back to the
    # device while this one's backward computes; None: none does
    restore_ahead: int | None
    swap_slot: int | None  # its row among the swapped blocks (kind ``swap``)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The blocks in forward order, the window's use order (stage names) and the
    block whose backward inputs come back before backward starts (``restore_first``:
    the first streamed block backward reaches, or None)."""

    blocks: tuple[BlockSlot, ...]
    uses: tuple[str, ...]
    restore_first: int | None

    @classmethod
    def of(
        cls,
        block_names: list[str],
        group_of: list[int],
        *,
        keep_blocks: int = 0,
        swap_blocks: int = 0,
        routed: frozenset[str] = frozenset(),
    ) -> Schedule:
        """``group_of[i]``: block i's stage group; ``routed``: the blocks streamed
        expert-aware (``routed.py``), recomputed blocks all."""
        L = len(block_names)
        first_kept = L - keep_blocks
        first_swap = first_kept - swap_blocks
        backward = list(reversed(range(first_kept)))  # the streamed blocks, in backward
        backward_use = {i: L + k for k, i in enumerate(backward)}
        slots = []
        for i, name in enumerate(block_names):
            if i >= first_kept:
                kind = "keep"
            elif i >= first_swap:
                kind = "swap"
            else:
                kind = "routed" if name in routed else "recompute"
            slots.append(
                BlockSlot(
                    index=i,
                    name=name,
                    group=group_of[i],
                    kind=kind,
                    forward_use=i,
                    backward_use=backward_use.get(i),
                    group_first=i == 0 or group_of[i - 1] != group_of[i],
                    group_last=i == L - 1 or group_of[i + 1] != group_of[i],
                    restore_ahead=i - 1 if 0 < i < first_kept else None,
                    swap_slot=i - first_swap if kind == "swap" else None,
                )
            )
        uses = (*block_names, *(block_names[i] for i in backward))
        return cls(tuple(slots), uses, first_kept - 1 if first_kept > 0 else None)

    @property
    def forward_uses(self) -> tuple[str, ...]:
        """The window's use order of a forward alone (an evaluation)."""
        return tuple(b.name for b in self.blocks)

    @property
    def backward(self) -> tuple[BlockSlot, ...]:
        """The blocks in backward order."""
        return self.blocks[::-1]
