"""Routed experts under tensor parallelism (``offload.expert_fetch=routed`` with
``distributed.tensor_parallel`` M > 1): a streamed MoE block's devices copy in and
gather only their slice of the pages of the experts some device routed to.

Tensor parallelism lays a block's split weights out by slice (``parallel/groupings.py``,
``grouped.py``): device (s, m) of S x M (S on the ``data`` axis, M on ``model``) holds
share s of group m's slab, which is slice m of every split weight, and share n = s M + m
of the dense slab (norms, biases, the router). An expert weight (E, d, h) split on h is
stacked as M slices of (E, d, h/M), so a group's slab holds slice m of every expert,
expert-major: expert e's part of it is a contiguous run, at the same pages in every
group. Its pages are told apart as on one share (``routed_zero.PageExperts`` over the
group's slab): *group-dense* pages (the attention weights' slices) and pages wholly
inside expert leaves, each with the experts whose rows it holds. Then:

    window   the dense slab, every device's share all-gathered whole, and the group's
             dense pages, each device's own copied in (padded to the largest device's
             count, fixed by the layout) and all-gathered over the data axis: a
             compact ``(M x S rows, page_elems)`` array split over ``model``
             (:class:`TensorRoutedSlab`); ``route`` reads the group with its expert
             pages zero, expanded from it on the device
    route    attention and the router -> pairs per expert averaged over the devices
             (``Kind.MEAN``): the same on every device and process (``routed_zero.py``)
    experts  the group pages holding a routed expert's rows (the same pages in every
             group): each device copies in its own of them, padded to the busiest
             device's count (rounded up to 1/8 of a share: at most 8 compiled gathers),
             all-gathered over the data axis and placed into its group beside the
             group-dense pages, the others zero
    mlp      the rest of the block over every expert (the unrouted ones' slices zero:
             no pair reads them), split over ``model`` by XLA as with every expert
             fetched; backward recomputes the block with the same decision and pages

So the step equals ``expert_fetch=all`` under the same split; what it saves is the copies
and the data-axis all-gather of the group pages wholly in experts no device routed to.
Deferred expert updates (``optimizer/deferred.py``) take this process's pages wholly in
such experts (:meth:`TensorExpertFetcher.zero_pages`: in every group, at each device's
share) and catch them up before a routed expert's pages are copied in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.parallel.grouped import GroupPages
from hetjax.runtime.experts.routed import RoutedBlock, Routing
from hetjax.runtime.experts.routed_zero import PageExperts, ZeroFetcher, padded_rows


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class TensorRoutedSlab:
    """A routed block's params as the window holds them under tensor parallelism:
    ``gathered``, the dense slab's pages all-gathered (each whole on every device),
    ``compact``, each group's dense pages gathered over the data axis (global ``(M x
    S rows, page_elems)``, split over ``model``), ``expand`` the jitted function turning
    ``compact`` into the groups' pages with the experts zero, and ``host``, the sharded
    host slab the expert pages are copied from. A pytree of its device arrays only."""

    gathered: list
    compact: jax.Array
    expand: Any
    host: Any
    groupings: tuple  # the block layout's (``grouped.GroupPages``)
    # the last routing's, (routing, the block's pages)
    held: tuple | None = None

    @property
    def dense(self) -> GroupPages:
        """The block's pages as ``route`` reads them: every expert page zero."""
        return GroupPages(self.gathered, (self.expand(self.compact),), self.groupings)

    def tree_flatten(self):
        held = [self.held[1].group] if self.held else []
        aux = (self.expand, self.host, self.groupings, len(self.gathered))
        return (*self.gathered, self.compact, *held), aux

    @classmethod
    def tree_unflatten(cls, aux, children) -> TensorRoutedSlab:
        expand, host, groupings, n = aux
        return cls(list(children[:n]), children[n], expand, host, groupings)


class TensorExpertFetcher(ZeroFetcher):
    """:class:`~hetjax.runtime.experts.routed_zero.ShardedExpertFetcher`'s interface under
    tensor parallelism (module docstring): device (s, m) of S x M copies in its share
    of group m's pages that the window or the routing needs and all-gathers them over
    the data axis only."""

    def __init__(self, block: RoutedBlock, zero, dtype: Any, num_experts: int):
        self.block, self.zero, self.num_experts = block, zero, num_experts
        layout = block.layout  # a GroupedSlabLayout of a TensorGrouping
        self.layout, self.groups, self.shares = layout, layout.groups, layout.shares
        group = layout.group
        at = tuple(k for k, leaf in enumerate(group.leaves) if block.is_expert(leaf.path))
        self.pages = PageExperts.of(group, at, num_experts)  # the same in every group
        self.first_page, self.own = zero.own_pages(layout)  # this process's
        self.dtype, self.page_elems = np.dtype(dtype), layout.page_elems
        axis = layout.grouping.axis
        self._group_sharding = NamedSharding(zero.mesh, PartitionSpec(axis, None))
        self._index = zero.sharded.gathered  # replicated
        self._every = jax.device_put(np.arange(num_experts, dtype=np.int32), self._index)
        # the group-dense pages: each device's own (padded to the largest count), and
        # where each lands in a group's pages (0: a zero row, then the compact rows)
        dense = np.flatnonzero(self.pages.dense)
        # (at least one row: a slice of split weights without attention copies a zero)
        self._dense, self._dense_rows = dense, max(1, self._rows(dense, pad=False))
        self._dense_index = np.zeros(group.num_pages, np.int32)
        self._dense_index[dense] = 1 + self._where(dense, self._dense_rows)
        self._expand = self._jit_expand()
        self._assemblers: dict[int, Any] = {}
        self.fetched = self.offered = self.bytes = 0

    def dense(self, slab: jax.Array) -> TensorRoutedSlab:
        """The window's copy of a routed block (a global sharded host slab): the dense
        slab gathered whole and the groups' dense pages gathered over the data axis."""
        lay, P = self.layout, self.page_elems
        shards = self._shards(slab)
        local = np.concatenate([np.asarray(s.data)[lay.group_share :] for s in shards])
        copied = jax.make_array_from_process_local_data(self.zero.sharded.slab_device, local)
        N = lay.devices
        self.zero.comm["all_gather"] += (N - 1) * lay.dense_share * P * self.dtype.itemsize
        gathered = self.zero.gather(N * lay.dense_share)(copied)
        compact = self._copy_in(shards, self._dense, self._dense_rows)
        self._count_gather(self._dense_rows)
        group = self._gather_group()(compact)
        return TensorRoutedSlab(gathered, group, self._expand, slab, lay.groupings)

    def experts(
        self, slab: TensorRoutedSlab, routing: Routing, fresh: dict[int, np.ndarray] | None = None
    ) -> tuple[GroupPages, list]:
        """The block's pages with each device's slice of the routed experts gathered in,
        and the pages copied in (none when the slab holds them from this routing's
        forward). ``fresh``: new params of some of this process's pages, by page within
        its share (deferred updates caught up), which replace the slab's."""
        if slab.held is not None and slab.held[0] is routing:
            return slab.held[1], []
        need = self.pages.routed(routing.ids)
        rows = self._rows(need)
        if not rows:
            pages = slab.dense
            slab.held = (routing, pages)
            return pages, []
        copied = self._copy_in(self._shards(slab.host), need, rows, fresh)
        index = self._dense_index.copy()
        index[need] = 1 + self.shares * self._dense_rows + self._where(need, rows)
        at = jax.device_put(index, self._index)
        group = self._assemble(rows)(slab.compact, copied, at)
        self._count_gather(rows)
        self.fetched += routing.ids.size
        self.offered += self.num_experts
        self.bytes += self.layout.devices * rows * self.page_elems * self.dtype.itemsize
        pages = self.layout.pages(slab.gathered, group)
        slab.held = (routing, pages)  # (the copies go once gathered)
        return pages, [copied]

    def zero_pages(self, ids: np.ndarray) -> frozenset[int]:
        """This process's pages (numbered within its share) wholly in experts not in
        ``ids``, in every group: their gradient is zero."""
        lay, gs, M = self.layout, self.layout.group_share, self.groups
        q = self.pages.unrouted(ids)  # of a group's slab, the same in every group
        s = q // gs
        out = [(s * M + m) * lay.share + q - s * gs - self.first_page for m in range(M)]
        pages = np.concatenate(out)
        return frozenset(pages[(pages >= 0) & (pages < self.own)].tolist())

    # -- the copies and their gathers ----------------------------------------------------

    def _rows(self, pages: np.ndarray, pad: bool = True) -> int:
        """Rows each device copies in for group pages ``pages`` (sorted): the busiest
        data index's count (the same in every group), rounded up (``padded_rows``)."""
        gs = self.layout.group_share
        busiest = int(np.bincount(pages // gs, minlength=self.shares).max()) if pages.size else 0
        return padded_rows(busiest, gs) if pad else busiest

    def _where(self, pages: np.ndarray, rows: int) -> np.ndarray:
        """Each of group pages ``pages`` (sorted)'s row in their gather over the data
        axis, of ``rows`` a device."""
        owner = pages // self.layout.group_share
        return owner * rows + np.arange(pages.size) - np.searchsorted(owner, owner)

    def _shards(self, slab: jax.Array) -> list:
        return sorted(slab.addressable_shards, key=lambda a: a.index[0].start or 0)

    def _copy_in(self, shards, pages: np.ndarray, rows: int, fresh=None) -> jax.Array:
        """Each of this process's devices' own of group pages ``pages`` (sorted), ``rows``
        a device (zeros after its own), as a global ``(N rows, page_elems)`` array over
        every device (``fresh``: pages of this process's share replacing the slab's)."""
        lay, gs, M = self.layout, self.layout.group_share, self.groups
        local = np.zeros((len(shards) * rows, self.page_elems), self.dtype)
        for i, shard in enumerate(shards):
            n = self.zero.first_slot + i
            s = n // M
            mine = pages[pages // gs == s] - s * gs  # rows of the shard
            local[i * rows : i * rows + mine.size] = np.asarray(shard.data)[mine]
            for j, r in enumerate(mine.tolist()):
                page = n * lay.share + r - self.first_page  # within this process's
                if fresh and page in fresh:
                    local[i * rows + j] = fresh[page]
        return jax.make_array_from_process_local_data(self.zero.sharded.slab_device, local)

    def _count_gather(self, rows: int) -> None:
        self.zero.comm["all_gather"] += (
            (self.shares - 1) * rows * self.page_elems * self.dtype.itemsize
        )

    def _shard_map(self, fn, in_specs):
        return jax.shard_map(
            fn,
            mesh=self.zero.mesh,
            in_specs=in_specs,
            out_specs=PartitionSpec(self.layout.grouping.axis, None),
            check_vma=False,
        )

    def _gather_group(self):
        """The jitted all-gather over the data axis of rows copied in by every device
        (global ``(N rows, page_elems)``) -> ``(M x S rows, page_elems)`` over model."""
        if "dense" not in self._assemblers:
            share_axes = self.layout.grouping.share_axes  # a group's devices: data
            gather = lambda copied: jax.lax.all_gather(copied, share_axes, tiled=True)
            spec = PartitionSpec(self.zero.page_axes, None)
            fn = self._shard_map(gather, (spec,))
            self._assemblers["dense"] = jax.jit(fn, out_shardings=self._group_sharding)
        return self._assemblers["dense"]

    def _jit_expand(self):
        """The jitted ``compact`` (the groups' dense pages) -> the groups' pages, global
        ``(M x group pages, page_elems)`` over model, the expert pages zero."""
        index = self._dense_index

        def per_device(compact):  # (S rows, P) -> (group pages, P)
            zero = jnp.zeros((1, compact.shape[1]), compact.dtype)
            return jnp.concatenate([zero, compact])[index]

        spec = PartitionSpec(self.layout.grouping.axis, None)
        return jax.jit(self._shard_map(per_device, (spec,)), out_shardings=self._group_sharding)

    def _assemble(self, rows: int):
        """The jitted gather of ``rows`` copied expert pages a device over the data axis
        into each group's pages, beside its dense pages (``compact``), each page placed
        by its index (0: a zero page)."""
        if rows not in self._assemblers:
            share_axes = self.layout.grouping.share_axes  # a group's devices: data

            def per_device(compact, copied, index):  # (S dense rows, P), (rows, P), (pages,)
                gathered = jax.lax.all_gather(copied, share_axes, tiled=True)  # (S rows, P)
                zero = jnp.zeros((1, gathered.shape[1]), gathered.dtype)
                return jnp.concatenate([zero, compact, gathered])[index]

            axis = self.layout.grouping.axis
            specs = (
                PartitionSpec(axis, None),
                PartitionSpec(self.zero.page_axes, None),
                PartitionSpec(),
            )
            fn = self._shard_map(per_device, specs)
            self._assemblers[rows] = jax.jit(fn, out_shardings=self._group_sharding)
        return self._assemblers[rows]
