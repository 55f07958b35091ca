"""A stage slab whose devices each compute with one group of some of its leaves, so that
ZeRO-3's pages split those leaves by device: expert parallelism's experts
(``experts.py``: a group of E/G experts per device of the ``expert`` axis) and tensor
parallelism's split weights (``tensor.py``: a 1/M slice of each split weight per device
of the ``model`` axis). A :class:`Grouping` says which leaves are grouped and how;
:class:`GroupedSlabLayout` lays the slab out for it.

Under ZeRO-3 (``zero.py``) a stage's slab is a ``(pages, page_elems)`` array of which
each of the N devices of the mesh owns one contiguous share, and its pages are
all-gathered onto every device before the stage computes. With the grouped leaves split
over the G devices of the grouping's mesh axis (N = S x G: S devices on the ``data``
axis, G innermost), a device computes with the stage's dense params (every leaf not
grouped) and only its own group, so the slab is laid out for that: device n = (s, g)'s
share is

    [ share s of group g's slab | share n of the dense slab ]

where the dense slab is the stage without its grouped leaves (pages a multiple of N, its
leaves right-aligned) and a group's slab holds group g of every grouped leaf (pages a
multiple of S). A grouped leaf is stacked by group on its first axis
(:meth:`Grouping.split`: experts are; a tensor-parallel weight's slices, each in its own
shape, are stacked so), so a group is a contiguous run of it. So the storage is ZeRO-3's
unchanged (every page owned by one device, each
process's pages contiguous: its optimizer, stores and checkpoints are as for any stage);
what changes is the gather: the dense shares are all-gathered over every device, a
group's shares over the ``data`` axis only, never over the grouping's axis
(``zero.py``), and the gradients are reduce-scattered the same ways. Weight decay stays
a single split point: every grouped leaf is weight-decayed and comes before the dense
norm scales and biases, which end the slab (the last device's share must hold them all).

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
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import ConfigError
from hetjax.distributed import BATCH_AXES
from hetjax.storage.pages import Leaf, SlabLayout

# The mesh axes ZeRO-3 reduce-scatters the dense part of a stage's gradient over
# (``zero.Zero3.grad_slab``), which its byte count (:func:`scattered_elements`: the
# runtime's counter and the planner's collectives lane) reads too: the batch axes. A
# group's pages (a block's experts, a stage's tensor-parallel slices) go over the
# devices holding the same group, its grouping's ``share_axes``. Never over the model
# axis: its devices compute with the same rows, their gradients of the dense pages
# already whole on each.
DENSE_SCATTER_AXES = BATCH_AXES


def ring_sent(elements: int, devices: int) -> int:
    """Elements one device sends in a ring all-gather of an ``elements`` result, or a
    ring reduce-scatter of an ``elements`` operand, over ``devices`` devices: (n-1)/n of
    them (none on one device)."""
    return elements * (devices - 1) // devices


def scattered_elements(layout: SlabLayout | GroupedSlabLayout, mesh_shape) -> int:
    """Elements of a stage's gradient one device sends in ZeRO-3's reduce-scatters on a
    mesh of ``mesh_shape`` (axis -> devices): each part (n-1)/n of its pages over the n
    devices of the axes it is scattered on. Without tensor parallelism that is what the
    stage's gather brings (``layout.gathered_size``); with it the dense pages are
    scattered over the data axis only, not all data x tensor devices they are gathered
    from (at data x tensor = 1 x M: none); a group's pages over its grouping's
    ``share_axes`` (the data axis; a tensor-parallel slice under expert parallelism too:
    data x expert)."""
    devices = lambda axes: math.prod(mesh_shape.get(a, 1) for a in axes)
    dense = devices(DENSE_SCATTER_AXES)
    if isinstance(layout, GroupedSlabLayout):
        pages = ring_sent(layout.group.num_pages, devices(layout.grouping.share_axes))
        pages += ring_sent(layout.dense.num_pages, dense)
    else:
        pages = ring_sent(layout.num_pages, dense)
    return pages * layout.page_elems


class GroupPages(NamedTuple):
    """A grouped stage's params on the device: the dense pages whole (replicated, as any
    gathered stage's) and this device's group, a ``(group pages, page_elems)`` array
    (globally ``(G x group pages, page_elems)`` split over the grouping's axis)."""

    dense: list
    group: Any


class ExpertPages(GroupPages):
    """A :class:`GroupPages` whose groups lie (also) on the ``expert`` axis, over which
    the stage functions are manual: each device's stage function sees its own group
    (expert parallelism's experts, alone or cut by tensor parallelism's slices)."""

    __slots__ = ()


class Grouping(Protocol):
    """Which leaves of a stage a device holds a group of, and on which mesh axes."""

    axis: str | tuple[str, ...]  # the mesh axis (or axes, major first) the groups lie on
    # the mesh axes of a group's shares: its devices, over which its pages are gathered
    # and its gradient reduce-scattered (the others on the mesh hold other groups)
    share_axes: tuple[str, ...]
    pages: type  # GroupPages, or ExpertPages where the groups lie on the expert axis

    def split(self, params: Any) -> tuple[Any, Any]:
        """params (arrays or shapes, numpy or jnp) -> (the dense rest, the grouped
        leaves, each its G groups stacked on its first axis)."""

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
class GroupedSlabLayout:
    """A stage's slab laid out for its grouping (see the module docstring); the
    :class:`~hetjax.storage.pages.SlabLayout` interface the runtime uses."""

    dense: SlabLayout  # the stage without its grouped leaves; pages a multiple of N
    group: SlabLayout  # one group of every grouped leaf; pages a multiple of S
    groups: int  # G: devices on the grouping's axis
    shares: int  # S: devices on the data axis
    grouping: Any  # a Grouping (hashable)

    @classmethod
    def of(
        cls, params: Any, page_bytes: int, groups: int, shares: int, grouping: Grouping
    ) -> GroupedSlabLayout:
        """The layout of a stage's params (arrays or shapes) with its grouped leaves in
        ``groups`` groups, on ``groups`` x ``shares`` devices."""
        rest, grouped = grouping.split(params)
        one = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // groups, *a.shape[1:]), a.dtype), grouped
        )
        layout = cls(
            SlabLayout.from_params(rest, page_bytes, groups * shares),
            SlabLayout.from_params(one, page_bytes, shares),
            groups,
            shares,
            grouping,
        )
        assert layout.group.num_decay == layout.group.size  # grouped leaves all decay
        unscaled = layout.dense.size - layout.dense.num_decay  # norm scales, biases
        if unscaled > layout.dense_share * layout.page_elems:
            raise ConfigError(
                f"config key 'memory.page_size': a stage's {unscaled} norm-scale and bias "
                f"elements (not weight-decayed) exceed one device's share of its dense pages "
                f"({layout.dense_share} pages of {layout.page_elems} elements) with "
                f"{groups * shares} devices; raise memory.page_size"
            )
        return layout

    # -- sizes (pages and elements) -------------------------------------------------------

    @property
    def devices(self) -> int:
        return self.groups * self.shares

    @property
    def page_elems(self) -> int:
        return self.dense.page_elems

    @property
    def dense_share(self) -> int:
        """Pages of the dense slab per device."""
        return self.dense.num_pages // self.devices

    @property
    def group_share(self) -> int:
        """Pages of a group's slab per device of the group."""
        return self.group.num_pages // self.shares

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
        """Elements a device computes with: the dense pages and one group."""
        return (self.dense.num_pages + self.group.num_pages) * self.page_elems

    @property
    def gathered_size(self) -> int:
        """Elements the gather brings each device from the others: (N-1)/N of the dense
        pages, (S-1)/S of its group (none of another group's)."""
        N, S, P = self.devices, self.shares, self.page_elems
        return (self.dense.num_pages * (N - 1) // N + self.group.num_pages * (S - 1) // S) * P

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

        def cut(leaves, start, stop, at, group=0, groups=1):
            # the pieces of ``leaves`` in slab elements [start, stop), placed at ``at``;
            # the leaves are group ``group`` of ``groups`` stacked on their first axis
            for leaf in leaves:
                lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.size, stop)
                if lo < hi:
                    axis, parts = self.grouping.cut(leaf.path) if groups > 1 else (0, 1)
                    shape = list(leaf.shape)  # one group's (a slice's) shape -> the leaf's
                    shape[axis] *= parts
                    shape[0] *= groups // parts  # groups of the first axis (experts)
                    stacked = self.grouping.stacked_index(group) if groups > 1 else group
                    first = stacked * leaf.size + lo - leaf.offset  # in the stacked leaf
                    pieces.append(
                        Leaf(leaf.path, tuple(shape), at + lo - start, hi - lo, first, axis, parts)
                    )

        dense = [dataclasses.replace(f, offset=f.offset + self._shift) for f in self.dense.leaves]
        Pg, Pd = self.group_share * P, self.dense_share * P
        for n in range(self.devices):
            s, g = divmod(n, self.groups)
            at = n * self.share * P
            cut(self.group.leaves, s * Pg, (s + 1) * Pg, at, g, self.groups)
            cut(dense, n * Pd, (n + 1) * Pd, at + Pg)
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
        rest, grouped = self.grouping.split(params)
        P, N, G, S = self.page_elems, self.devices, self.groups, self.shares
        dense = flatten(self.dense, rest)[: self.dense.size]
        dense = xp.concatenate([xp.zeros(self._shift, dense.dtype), dense])

        def group(g):  # each grouped leaf's g-th 1/G of its first axis
            return jax.tree.map(lambda a: a[g * (n := a.shape[0] // G) : (g + 1) * n], grouped)

        groups = xp.stack([flatten(self.group, group(g)) for g in range(G)])  # (G, elements)
        shares = groups.reshape(G, S, -1).transpose(1, 0, 2).reshape(N, -1)  # device n = (s, g)
        return xp.concatenate([shares, dense.reshape(N, self.dense_share * P)], axis=1).reshape(-1)

    def unflatten(self, slab: Any) -> Any:
        """Slab -> the whole stage's params (numpy in, numpy out; else jnp)."""
        xp = np if isinstance(slab, np.ndarray) else jnp
        P, G, S = self.page_elems, self.groups, self.shares
        rows = slab.reshape(self.devices, self.share * P)
        group = rows[:, : self.group_share * P].reshape(S, G, -1).transpose(1, 0, 2)
        rest = self.dense.unflatten(rows[:, self.group_share * P :].reshape(-1)[self._shift :])
        return self.grouping.join(rest, self._stacked(group.reshape(G, -1), xp))

    def _stacked(self, rows: Any, xp) -> Any:
        """``(groups here, group elements)`` -> each grouped leaf, its groups stacked on
        its first axis."""
        flat = []
        for slab_index in self.group.tree_order:
            leaf = self.group.leaves[slab_index]
            part = rows[:, leaf.offset : leaf.offset + leaf.size]
            flat.append(part.reshape(-1, *leaf.shape[1:]))
        return jax.tree.unflatten(self.group.treedef, flat)

    def unflatten_pages(self, pages: GroupPages) -> Any:
        """Inside a stage function: the pages a device computes with -> the stage's
        params with this device's group (expert parallelism, manual over its axis: each
        expert leaf E/G rows), or with every group stacked and the arrays split over the
        grouping's axis by XLA (tensor parallelism, whose ``model`` axis is automatic:
        each split weight whole, a device holding its slice)."""
        rest = self.dense.unflatten_pages(pages.dense, offset=self._shift)
        rows = pages.group.reshape(-1, self.group.num_pages * self.page_elems)
        return self.grouping.join(rest, self._stacked(rows, jnp))

    leaf_buffers = False  # the device takes pages (ZeRO-3's): pages.SlabLayout's flag

    def grad_pages(self, grad: GroupPages) -> GroupPages:
        """A gradient as the stage's pages: they are (the device takes pages here)."""
        return grad

    def device_pages(self, dtype: Any) -> GroupPages:
        """The abstract pages a device computes with (global shapes)."""
        sds, P = jax.ShapeDtypeStruct, self.page_elems
        group = sds((self.groups * self.group.num_pages, P), dtype)
        return self.grouping.pages([sds((P,), dtype)] * self.dense.num_pages, group)
