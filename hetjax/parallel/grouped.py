"""A stage slab whose devices each compute with one group of some of its leaves, so that
ZeRO-3's pages split those leaves by device: expert parallelism's experts
(a group of E/G experts per device of the ``expert`` axis) and tensor parallelism's
split weights (a 1/M slice of each split weight per device of the ``model`` axis), the
groupings of ``groupings.py``, which ``layouts.py`` hands a stage. A :class:`Grouping`
says which leaves are grouped and how; :class:`GroupedSlabLayout` lays the slab out for
one or more of them, its parts.

Under ZeRO-3 (``zero.py``) a stage's slab is a ``(pages, page_elems)`` array of which
each of the N devices of the mesh owns one contiguous share, and its pages are
all-gathered onto every device before the stage computes. A part's grouped leaves are
split over the G devices of its grouping's mesh axes (the innermost axes of the mesh:
N = S x G, S devices holding the same group, on the grouping's ``share_axes``), so
device n = (s, g) = divmod(n, G) computes with only group g of them. The slab is laid
out for that: device n's share is

    [ share s0 of part 0's group g0 | share s1 of part 1's group g1 | ... | share n of dense ]

where the dense slab is the stage without any part's leaves (pages a multiple of N, its
leaves right-aligned) and a part's group slab holds group g of every leaf of the part
(pages a multiple of its S). A part's leaf is stacked by group on its first axis
(:meth:`Grouping.split`: experts are; a tensor-parallel weight's slices, each in its own
shape, are stacked so), so a group is a contiguous run of it. The parts split the stage
in order (part 1 groups what part 0 left, the dense slab is what the last left). One
part is expert parallelism's experts or tensor parallelism's split weights; the data x
expert x model mesh's MoE block has two (``layouts.groupings``): its experts
by expert group and model slice (X x M groups, shares over ``data``) and its other split
weights (attention) by model slice (M groups, shares over data x expert).

So the storage is ZeRO-3's unchanged (every page owned by one device, each process's
pages contiguous: its optimizer, stores and checkpoints are as for any stage); what
changes is the gather: the dense shares are all-gathered over every device, a part's
shares over its grouping's ``share_axes`` only (``zero.py``), and the gradients are
reduce-scattered the same ways: the pages on the device (:class:`GroupPages`) carry each
part's grouping, whose ``share_axes`` the gather, the reduce-scatter and the byte count
(:func:`scattered_elements`) all read. Weight decay stays a single split point: every
grouped leaf is weight-decayed and comes before the dense norm scales and biases, which
end the slab (the last device's share must hold them all).

Checkpoints record this layout (its leaves, cut at the shares, each piece with where it
starts in its leaf, stacked by group): restored into the same layout, each
process reads its pages as they are; into any other (another degree, device count or
page size, one device, the in-memory runtime), the stage's params are reassembled from
the pieces and laid out anew (``state_io.restore``,
``checkpoint_state.StoredState.stage_tree``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import ConfigError
from hetjax.parallel.rules import BATCH_AXES
from hetjax.storage.pages import Leaf, SlabLayout

# The mesh axes ZeRO-3 reduce-scatters the dense part of a stage's gradient over
# (``zero.Zero3.grad_slab``), which its byte count (:func:`scattered_elements`: the
# runtime's counter and the planner's collectives lane) reads too: the batch axes. A
# part's pages (a block's experts, a stage's tensor-parallel slices) go over the
# devices holding the same group, its grouping's ``share_axes``. Never over the model
# axis: its devices compute with the same rows, their gradients of the dense pages
# already whole on each.
DENSE_SCATTER_AXES = BATCH_AXES


def ring_sent(elements: int, devices: int) -> int:
    """Elements one device sends in a ring all-gather of an ``elements`` result, or a
    ring reduce-scatter of an ``elements`` operand, over ``devices`` devices: (n-1)/n of
    them (none on one device)."""
    return elements * (devices - 1) // devices


def axes_of(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """A grouping's ``axis`` (one mesh axis or several) as a tuple."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def scattered_elements(layout: SlabLayout | GroupedSlabLayout, mesh_shape) -> int:
    """Elements of a stage's gradient one device sends in ZeRO-3's reduce-scatters on a
    mesh of ``mesh_shape`` (axis -> devices): each part (n-1)/n of its pages over the n
    devices of the axes it is scattered on. Without tensor parallelism that is what the
    stage's gather brings (``layout.gathered_size``); with it the dense pages are
    scattered over the data axes only, not all data x tensor devices they are gathered
    from (at data x tensor = 1 x M: none); a part's group over its grouping's
    ``share_axes`` (an expert group's, or its model slice's: the data axis; a
    tensor-parallel slice's: the data axis, data x expert under expert parallelism)."""
    devices = lambda axes: math.prod(mesh_shape.get(a, 1) for a in axes)
    if isinstance(layout, GroupedSlabLayout):
        pages = sum(
            ring_sent(part.layout.num_pages, devices(part.grouping.share_axes))
            for part in layout.parts
        )
        pages += ring_sent(layout.dense.num_pages, devices(DENSE_SCATTER_AXES))
    else:
        pages = ring_sent(layout.num_pages, devices(DENSE_SCATTER_AXES))
    return pages * layout.page_elems


@jax.tree_util.register_pytree_node_class
class GroupPages:
    """A grouped stage's params on the device: the dense pages whole (replicated, as any
    gathered stage's) and, of each part, this device's group: a ``(group pages,
    page_elems)`` array (globally ``(G x group pages, page_elems)`` split over the part
    grouping's axes). ``groupings``: each part's :class:`Grouping`, static (the pytree's
    auxiliary data): its mesh axes, over which the stage functions split the group where
    they are manual, and its ``share_axes``, over which its gradient is reduce-scattered
    (``zero.Zero3.jit``, ``zero.Zero3.grad_slab``)."""

    __slots__ = ("dense", "groups", "groupings")

    def __init__(self, dense: list, groups: tuple, groupings: tuple):
        self.dense, self.groups, self.groupings = dense, tuple(groups), tuple(groupings)

    @property
    def group(self) -> Any:
        """The group of a one-part stage (expert or tensor parallelism alone)."""
        (group,) = self.groups
        return group

    def tree_flatten(self):
        return (self.dense, self.groups), self.groupings

    @classmethod
    def tree_unflatten(cls, groupings, children) -> GroupPages:
        dense, groups = children
        return cls(dense, groups, groupings)

    def __repr__(self) -> str:
        return f"GroupPages(dense={self.dense!r}, groups={self.groups!r})"


class Grouping(Protocol):
    """Which leaves of a stage a device holds a group of, and on which mesh axes."""

    axis: str | tuple[str, ...]  # the mesh axis (or axes, major first) the groups lie on
    # the mesh axes of a group's shares: its devices, over which its pages are gathered
    # and its gradient reduce-scattered (the others on the mesh hold other groups)
    share_axes: tuple[str, ...]

    @property
    def groups(self) -> int:
        """G: the groups, one per device of the grouping's axes."""

    def split(self, params: Any) -> tuple[Any, Any]:
        """params (arrays or shapes, numpy or jnp) -> (the rest, the grouped leaves, each
        its G groups stacked on its first axis)."""

    def join(self, rest: Any, grouped: Any) -> Any:
        """The inverse of :meth:`split`."""

    def cut(self, path: tuple[str, ...]) -> tuple[int, int]:
        """How :meth:`split` stacked a grouped leaf: (axis, parts): its axis ``axis`` cut
        into ``parts`` slices stacked on a new first axis, merged with the slices' own
        first axis; (0, 1): the leaf as it is (its first axis already the groups')."""

    def stacked_index(self, group: int) -> int:
        """Where group ``group`` (of the devices' order) is among the leaf's groups as a
        checkpoint stacks them (its ``cut`` axis's slices first, then its first axis)."""


@dataclasses.dataclass(frozen=True)
class GroupPart:
    """One part of a grouped slab: a group of its grouping's leaves, its pages a
    multiple of the ``shares`` devices holding the same group."""

    layout: SlabLayout  # one group of every leaf of the part
    grouping: Any  # a Grouping (hashable)
    shares: int  # S = N / G: devices holding the same group (its share_axes')

    @property
    def groups(self) -> int:
        return self.grouping.groups

    @property
    def share(self) -> int:
        """Pages of a group's slab per device of the group."""
        return self.layout.num_pages // self.shares


@dataclasses.dataclass(frozen=True)
class GroupedSlabLayout:
    """A stage's slab laid out for its groupings, its parts (see the module docstring);
    the :class:`~hetjax.storage.pages.SlabLayout` interface the runtime uses."""

    dense: SlabLayout  # the stage without any part's leaves; pages a multiple of N
    parts: tuple[GroupPart, ...]  # in the order of a device's share
    devices: int  # N

    @classmethod
    def of(
        cls, params: Any, page_bytes: int, devices: int, *groupings: Grouping
    ) -> GroupedSlabLayout:
        """The layout of a stage's params (arrays or shapes) on ``devices`` devices, with
        each grouping's leaves (of what the groupings before it left) in its groups."""
        parts, rest = [], params
        for grouping in groupings:
            rest, grouped = grouping.split(rest)
            G = grouping.groups
            one = jax.tree.map(
                lambda a, G=G: jax.ShapeDtypeStruct((a.shape[0] // G, *a.shape[1:]), a.dtype),
                grouped,
            )
            shares = devices // G
            group = SlabLayout.from_params(one, page_bytes, shares)
            parts.append(GroupPart(group, grouping, shares))
        layout = cls(SlabLayout.from_params(rest, page_bytes, devices), tuple(parts), devices)
        for part in layout.parts:
            assert part.layout.num_decay == part.layout.size  # grouped leaves all decay
        unscaled = layout.dense.size - layout.dense.num_decay  # norm scales, biases
        if unscaled > layout.dense_share * layout.page_elems:
            raise ConfigError(
                f"config key 'memory.page_size': a stage's {unscaled} norm-scale and bias "
                f"elements (not weight-decayed) exceed one device's share of its dense pages "
                f"({layout.dense_share} pages of {layout.page_elems} elements) with "
                f"{devices} devices; raise memory.page_size"
            )
        return layout

    # -- a one-part layout's (expert or tensor parallelism alone: the routed blocks') ------

    @property
    def only(self) -> GroupPart:
        """The part of a one-part layout."""
        (part,) = self.parts
        return part

    @property
    def group(self) -> SlabLayout:
        return self.only.layout

    @property
    def grouping(self) -> Any:
        return self.only.grouping

    @property
    def groups(self) -> int:
        return self.only.groups

    @property
    def shares(self) -> int:
        return self.only.shares

    # -- sizes (pages and elements) -------------------------------------------------------

    @property
    def groupings(self) -> tuple:
        return tuple(part.grouping for part in self.parts)

    @property
    def page_elems(self) -> int:
        return self.dense.page_elems

    @property
    def dense_share(self) -> int:
        """Pages of the dense slab per device."""
        return self.dense.num_pages // self.devices

    @property
    def group_share(self) -> int:
        """Pages of the parts' groups per device: where its dense share starts."""
        return sum(part.share for part in self.parts)

    @property
    def share(self) -> int:
        """Pages each device owns."""
        return self.group_share + self.dense_share

    @property
    def num_pages(self) -> int:
        return self.devices * self.share

    @property
    def padded_size(self) -> int:
        return self.num_pages * self.page_elems

    size = padded_size  # no padding at the end: the norm scales end the slab

    @property
    def compute_size(self) -> int:
        """Elements a device computes with: the dense pages and a group of each part."""
        pages = self.dense.num_pages + sum(part.layout.num_pages for part in self.parts)
        return pages * self.page_elems

    @property
    def gathered_size(self) -> int:
        """Elements the gather brings each device from the others: (N-1)/N of the dense
        pages, (S-1)/S of its group of each part (none of another group's)."""
        pages = ring_sent(self.dense.num_pages, self.devices)
        pages += sum(ring_sent(part.layout.num_pages, part.shares) for part in self.parts)
        return pages * self.page_elems

    @property
    def page_multiple(self) -> int:
        return self.devices

    @property
    def num_decay(self) -> int:
        return self.padded_size - (self.dense.size - self.dense.num_decay)

    @property
    def _shift(self) -> int:
        """Elements of padding before the dense leaves (right-aligned in their pages)."""
        return self.dense.padded_size - self.dense.size

    def nbytes(self, dtype: Any) -> int:
        return self.padded_size * jnp.dtype(dtype).itemsize

    def shard(self, first_page: int, num_pages: int) -> SlabLayout:
        """The layout of a page range, for the optimizer of one process's shards."""
        whole = SlabLayout(
            leaves=(),
            treedef=None,
            tree_order=(),
            num_decay=self.num_decay,
            size=self.size,
            page_elems=self.page_elems,
        )
        return whole.shard(first_page, num_pages)

    @property
    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf's pieces, one per device share it falls in, at their offsets in the
        slab, each with its whole leaf's path and shape, where in that leaf (its groups
        stacked first: ``Leaf.axis``, ``Leaf.parts``) it starts (what a checkpoint
        records of the layout: it reassembles the params from them,
        ``checkpoint_state.StoredState.stage_tree``)."""
        P, pieces = self.page_elems, []

        def cut(leaves, start, stop, at, grouping=None, group=0):
            # the pieces of ``leaves`` in slab elements [start, stop), placed at ``at``;
            # the leaves are group ``group`` of the grouping's stacked on their first axis
            for leaf in leaves:
                lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.size, stop)
                if lo < hi:
                    groups = grouping.groups if grouping else 1
                    axis, parts = grouping.cut(leaf.path) if groups > 1 else (0, 1)
                    shape = list(leaf.shape)  # one group's (a slice's) shape -> the leaf's
                    shape[axis] *= parts
                    shape[0] *= groups // parts  # groups of the first axis (experts)
                    stacked = grouping.stacked_index(group) if groups > 1 else group
                    first = stacked * leaf.size + lo - leaf.offset  # in the stacked leaf
                    pieces.append(
                        Leaf(leaf.path, tuple(shape), at + lo - start, hi - lo, first, axis, parts)
                    )

        dense = [dataclasses.replace(f, offset=f.offset + self._shift) for f in self.dense.leaves]
        Pd = self.dense_share * P
        for n in range(self.devices):
            at = n * self.share * P
            for part in self.parts:
                s, g = divmod(n, part.groups)
                Pg = part.share * P
                cut(part.layout.leaves, s * Pg, (s + 1) * Pg, at, part.grouping, g)
                at += Pg
            cut(dense, n * Pd, (n + 1) * Pd, at)
        return tuple(pieces)

    # -- params <-> slab ------------------------------------------------------------------

    def flatten(self, params: Any, dtype: Any = jnp.float32) -> jax.Array:
        """A whole stage's params -> its slab (padded_size,) in ``dtype`` (in and out
        of jit)."""
        return self._flatten(params, jnp, lambda lay, p: lay.flatten(p, dtype))

    def flatten_np(self, params: Any, dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`flatten`, on the host with numpy."""
        return self._flatten(params, np, lambda lay, p: lay.flatten_np(p, dtype))

    def _flatten(self, params, xp, flatten):
        P, N = self.page_elems, self.devices
        columns, rest = [], params  # each part's shares (N, its share's elements), the dense
        for part in self.parts:
            rest, grouped = part.grouping.split(rest)
            G, S = part.groups, part.shares

            def group(g, G=G, grouped=grouped):  # each grouped leaf's g-th 1/G of its first axis
                return jax.tree.map(lambda a: a[g * (n := a.shape[0] // G) : (g + 1) * n], grouped)

            groups = xp.stack([flatten(part.layout, group(g)) for g in range(G)])  # (G, elements)
            columns.append(groups.reshape(G, S, -1).transpose(1, 0, 2).reshape(N, -1))  # n = (s, g)
        dense = flatten(self.dense, rest)[: self.dense.size]
        dense = xp.concatenate([xp.zeros(self._shift, dense.dtype), dense])
        columns.append(dense.reshape(N, self.dense_share * P))
        return xp.concatenate(columns, axis=1).reshape(-1)

    def unflatten(self, slab: Any) -> Any:
        """Slab -> the whole stage's params (numpy in, numpy out; else jnp)."""
        xp = np if isinstance(slab, np.ndarray) else jnp
        P = self.page_elems
        rows = slab.reshape(self.devices, self.share * P)
        stacked, at = [], 0
        for part in self.parts:
            G, S, Pg = part.groups, part.shares, part.share * P
            group = rows[:, at : at + Pg].reshape(S, G, -1).transpose(1, 0, 2)
            stacked.append(self._stacked(part.layout, group.reshape(G, -1), xp))
            at += Pg
        rest = self.dense.unflatten(rows[:, at:].reshape(-1)[self._shift :])
        return self._join(rest, stacked)

    def _join(self, rest: Any, stacked: list) -> Any:
        """The dense rest and each part's grouped leaves -> the stage's params (the
        parts' splits undone in reverse)."""
        for part, grouped in reversed(list(zip(self.parts, stacked, strict=True))):
            rest = part.grouping.join(rest, grouped)
        return rest

    @staticmethod
    def _stacked(layout: SlabLayout, rows: Any, xp) -> Any:
        """``(groups here, group elements)`` of a part's ``layout`` -> each of its leaves,
        its groups stacked on its first axis."""
        flat = []
        for slab_index in layout.tree_order:
            leaf = layout.leaves[slab_index]
            part = rows[:, leaf.offset : leaf.offset + leaf.size]
            flat.append(part.reshape(-1, *leaf.shape[1:]))
        return jax.tree.unflatten(layout.treedef, flat)

    def unflatten_pages(self, pages: GroupPages) -> Any:
        """Inside a stage function: the pages a device computes with -> the stage's
        params with this device's group of each part (expert parallelism, manual over
        its axis: each expert leaf E/G rows), or with every group stacked and the arrays
        split over the grouping's axis by XLA (tensor parallelism, whose ``model`` axis
        is automatic: each split weight whole, a device holding its slice)."""
        rest = self.dense.unflatten_pages(pages.dense, offset=self._shift)
        P = self.page_elems
        stacked = [
            self._stacked(part.layout, group.reshape(-1, part.layout.num_pages * P), jnp)
            for part, group in zip(self.parts, pages.groups, strict=True)
        ]
        return self._join(rest, stacked)

    leaf_buffers = False  # the device takes pages (ZeRO-3's): pages.SlabLayout's flag

    def grad_pages(self, grad: GroupPages) -> GroupPages:
        """A gradient as the stage's pages: they are (the device takes pages here)."""
        return grad

    def pages(self, dense: list, *groups: Any) -> GroupPages:
        """The pages a device computes with: ``dense`` and a group of each part."""
        return GroupPages(dense, groups, self.groupings)

    def device_pages(self, dtype: Any) -> GroupPages:
        """The abstract pages a device computes with (global shapes)."""
        sds, P = jax.ShapeDtypeStruct, self.page_elems
        groups = [sds((part.groups * part.layout.num_pages, P), dtype) for part in self.parts]
        return self.pages([sds((P,), dtype)] * self.dense.num_pages, *groups)
