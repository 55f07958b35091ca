"""Routed experts under ZeRO-3 (``offload.expert_fetch=routed`` with
``distributed.data_parallel``, ``expert_parallel`` or ``tensor_parallel`` > 1): a
streamed MoE block's devices copy in and gather only the pages of the experts some
device routed to.

On one device a routed block copies its experts leaf row by leaf row (``routed.py``).
Under ZeRO-3 (``zero.py``) a device owns a contiguous share of a block's pages, cut
across its leaves and so across its experts, and all-gathers the others' shares. Here
the block's pages are told apart by what they hold (:class:`PageExperts`): *dense*
pages (any element of attention, norms, the router, or any leaf but the experts') and
pages wholly inside expert leaves, each with the experts whose rows it holds. Then:

    window   the dense pages: each device copies in its own of them, an all-gather
             (``Zero3.gather``) makes them whole; the expert pages stand as one zero
             page (:class:`ShardedRoutedSlab`)
    route    attention and the router on those pages -> pairs per expert, averaged
             over the devices (``Kind.MEAN``): nonzero for an expert some device's
             rows routed to, the same array on every device and process, so every
             device dispatches the same gather (never a timing's decision)
    experts  the pages holding a routed expert's rows: each device copies its own of
             them in, padded to the largest device's count (rounded up to 1/8 of a
             share: at most 8 compiled gathers), and all-gathers them
    mlp      the rest of the block over every expert, the unrouted ones' rows zero
             (no pair reads them: ``ragged_dot`` gives them no rows), with ``route``'s
             decision; backward recomputes the block from its boundary with the same
             decision and the same pages, gathered again

So the step equals ``expert_fetch=all`` (an unrouted expert's gradient is zero either
way, and the reduce-scatter of the block's gradient is unchanged); what it saves is the
host -> device copies and the all-gather of the pages wholly in experts no device
routed to. Deferred expert updates (``optimizer/deferred.py``) take the pages of this
process's share wholly in such experts (:meth:`ShardedExpertFetcher.zero_pages`, by
page within the share, as the process's optimizer and state store number them) and
catch them up before a routed expert's pages are copied in.

Under expert parallelism (:class:`GroupedExpertFetcher`) a device holds a share of its
group's slab (its E/G experts) and of the dense slab (``grouped.py``): the window gathers
the dense slab whole, and after ``route`` each device copies in its share of its group's
pages holding a routed expert's rows (padded to the busiest device's count over every
group: one gather for the whole mesh) and all-gathers them over the data axis only, into
its group's pages, the others zero; the tokens reach their experts by all-to-all as
they do with every expert fetched (``models/llama.py``). On the data x expert x model
mesh the same, its group being its expert group's model slice; the window gathers the
block's attention slices (the layout's second part, over data x expert) with the dense
pages. Under tensor parallelism alone the block is laid out as that mesh with one
expert group (``parallel/layouts.py``): group m is slice m of every expert, the same
fetcher.
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
from hetjax.storage.pages import SlabLayout


@dataclasses.dataclass(frozen=True)
class PageExperts:
    """Which pages of a block's slab hold what: ``dense`` (pages,) bool, a page with
    any element outside the expert leaves' rows; ``experts`` (pages, E) bool, the
    experts whose rows a page not dense holds (a padding page: none)."""

    dense: np.ndarray
    experts: np.ndarray

    @classmethod
    def of(cls, layout: SlabLayout, expert_leaves: tuple[int, ...], num_experts: int):
        P, pages = layout.page_elems, layout.num_pages
        span = lambda lo, n: slice(lo // P, (lo + n - 1) // P + 1)  # pages of [lo, lo + n)
        dense = np.zeros(pages, bool)
        experts = np.zeros((pages, num_experts), bool)
        for k, leaf in enumerate(layout.leaves):
            if k not in expert_leaves:
                dense[span(leaf.offset, leaf.size)] = True
                continue
            rows = leaf.size // num_experts  # an expert's elements in this leaf
            for e in range(num_experts):
                experts[span(leaf.offset + e * rows, rows), e] = True
        experts[dense] = False
        return cls(dense, experts)

    def routed(self, ids: np.ndarray) -> np.ndarray:
        """The pages (sorted) holding a row of an expert in ``ids``, none dense."""
        return np.flatnonzero(self.experts[:, ids].any(axis=1))

    def unrouted(self, ids: np.ndarray) -> np.ndarray:
        """The pages wholly in experts not in ``ids`` (their gradient is zero)."""
        held = self.experts.any(axis=1)
        return np.flatnonzero(held & ~self.experts[:, ids].any(axis=1))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class ShardedRoutedSlab:
    """A routed block's params as the window holds them under ZeRO-3: ``gathered``, the
    dense pages all-gathered (each whole on every device), ``where`` for each of the
    block's pages its index among them (-1: an expert page, standing as ``zero``), and
    ``host``, the sharded host slab the expert pages are copied from. A pytree of its
    device arrays only (what the ledger and the timeline count)."""

    gathered: list
    zero: jax.Array
    where: tuple[int, ...]
    host: Any
    # the last routing's pages, (routing, the block's pages, the expert pages gathered)
    held: tuple | None = None

    @property
    def dense(self) -> list:
        """The block's pages as ``route`` reads them: the expert pages zero."""
        return [self.gathered[i] if i >= 0 else self.zero for i in self.where]

    def tree_flatten(self):
        held = list(self.held[2]) if self.held else []
        return (*self.gathered, *held), (self.zero, self.where, self.host, len(self.gathered))

    @classmethod
    def tree_unflatten(cls, aux, children) -> ShardedRoutedSlab:
        zero, where, host, n = aux
        return cls(list(children[:n]), zero, where, host)


def padded_rows(needed: int, share: int) -> int:
    """Pages each device copies in for a gather whose busiest device needs ``needed`` of
    its ``share``: rounded up to a multiple of share/8, so that the gathers compile for
    at most 8 sizes (the extra rows are zeros no page reads)."""
    step = max(1, share // 8)
    return min(share, -(-needed // step) * step)


class ZeroFetcher:
    """What the ZeRO-3 fetchers share: every expert is held (the unrouted ones' rows
    zero, each expert its own row: ``_every``), and the gradient leaves whole."""

    _every: jax.Array  # (E,) int32 0 .. E-1, replicated

    def routing(self, counts: np.ndarray, top_e: jax.Array, put) -> Routing:
        """The decision of ``route`` (``counts`` the devices' mean pairs per expert):
        the experts some device routed to; every expert a row of its own."""
        del put
        ids = np.flatnonzero(counts).astype(np.int32)
        return Routing(ids, top_e, self._every, self._every)

    def unsent_pages(self, ids: np.ndarray) -> frozenset[int]:
        """Pages of the block's gradient not copied to the host: none (the gradient
        leaves reduce-scattered, each device's share whole)."""
        del ids
        return frozenset()


class ShardedExpertFetcher(ZeroFetcher):
    """:class:`~hetjax.runtime.experts.routed.ExpertFetcher`'s interface under ZeRO-3 (module
    docstring): :meth:`dense` the window's copy, :meth:`routing` the decision,
    :meth:`experts` the routed experts' pages, :meth:`zero_pages` the pages deferred
    updates may leave alone; counts the experts copied and the bytes."""

    def __init__(self, block: RoutedBlock, zero, dtype: Any, num_experts: int):
        self.block, self.zero, self.num_experts = block, zero, num_experts
        layout = block.layout
        self.pages = PageExperts.of(layout, block.expert_leaves, num_experts)
        self.devices = zero.degree
        self.share = layout.num_pages // self.devices  # pages a device owns
        self.first_page, self.own = zero.own_pages(layout)  # this process's
        self.dtype, self.page_elems = np.dtype(dtype), layout.page_elems
        gathered = zero.sharded.gathered
        self._zero = jax.device_put(np.zeros(layout.page_elems, dtype), gathered)
        # every expert held (the unrouted ones' rows zero): each expert its own row
        self._every = jax.device_put(np.arange(num_experts, dtype=np.int32), gathered)
        self._dense = np.flatnonzero(self.pages.dense)
        self.fetched = self.offered = self.bytes = 0

    def dense(self, slab: jax.Array) -> ShardedRoutedSlab:
        """The window's copy of a routed block (a global sharded host slab): its dense
        pages gathered."""
        gathered, where = self._gather(slab, self._dense)
        index = np.full(slab.shape[0], -1, np.int64)
        index[self._dense] = where
        return ShardedRoutedSlab(gathered, self._zero, tuple(index.tolist()), slab)

    def experts(
        self, slab: ShardedRoutedSlab, routing: Routing, fresh: dict[int, np.ndarray] | None = None
    ) -> tuple[list, list]:
        """The block's pages with the routed experts' pages gathered in, and those
        gathered (none when the slab holds them from this routing's forward).
        ``fresh``: new params of some of this process's pages, by page within its share
        (deferred updates caught up), which replace the slab's."""
        if slab.held is not None and slab.held[0] is routing:
            return slab.held[1], []
        need = self.pages.routed(routing.ids)
        gathered, where = self._gather(slab.host, need, fresh)
        pages = slab.dense
        for p, i in zip(need.tolist(), where.tolist(), strict=True):
            pages[p] = gathered[i]
        self.fetched += routing.ids.size
        self.offered += self.num_experts
        self.bytes += len(gathered) * self.page_elems * self.dtype.itemsize
        slab.held = (routing, pages, gathered)
        return pages, gathered

    def zero_pages(self, ids: np.ndarray) -> frozenset[int]:
        """This process's pages (numbered within its share) wholly in experts not in
        ``ids``: their gradient is zero."""
        pages = self.pages.unrouted(ids) - self.first_page
        return frozenset(pages[(pages >= 0) & (pages < self.own)].tolist())

    def _gather(self, slab: jax.Array, pages: np.ndarray, fresh=None) -> tuple[list, np.ndarray]:
        """Pages ``pages`` (sorted, of the whole slab) of a sharded host slab -> each whole
        on every device, and each page's index among them. Each device copies in its own
        pages, padded to the same count on every device (``pages`` is the same on every
        device and process, so is every device's count), and all-gathers them."""
        s, P = self.share, self.page_elems
        owner = pages // s
        rows = padded_rows(int(np.bincount(owner, minlength=self.devices).max()), s)
        rank = np.arange(pages.size) - np.searchsorted(owner, owner)  # among its owner's
        where = owner * rows + rank
        if not rows:
            return [], where
        shards = sorted(slab.addressable_shards, key=lambda a: a.index[0].start or 0)
        local = np.zeros((len(shards) * rows, P), self.dtype)
        for i, shard in enumerate(shards):
            n = self.zero.first_slot + i
            mine = pages[owner == n]
            local[i * rows : i * rows + mine.size] = np.asarray(shard.data)[mine - n * s]
            for j, p in enumerate(mine.tolist()):
                if fresh and p - self.first_page in fresh:
                    local[i * rows + j] = fresh[p - self.first_page]
        sharding = self.zero.sharded.slab_device
        copied = jax.make_array_from_process_local_data(sharding, local)
        self.zero.comm["all_gather"] += (self.devices - 1) * rows * P * self.dtype.itemsize
        return self.zero.gather(self.devices * rows)(copied), where


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class GroupedRoutedSlab:
    """A routed block's params as the window holds them under expert parallelism:
    ``gathered``, the dense pages all-gathered (whole on every device), ``zero`` the
    expert group's pages standing as zeros (global ``(G x group pages, page_elems)``,
    split over the expert axis), and ``host``, the sharded host slab the group's pages
    are copied from. A pytree of its device arrays only (the held group's included)."""

    gathered: list
    zero: jax.Array
    host: Any
    groupings: tuple  # the block layout's (``grouped.GroupPages``)
    # the layout's other parts' groups, gathered (the 3-D mesh's attention slices)
    others: tuple = ()
    # the last routing's, (routing, the block's pages)
    held: tuple | None = None

    @property
    def dense(self) -> GroupPages:
        """The block's pages as ``route`` reads them: every expert zero."""
        return GroupPages(self.gathered, (self.zero, *self.others), self.groupings)

    def tree_flatten(self):
        held = [self.held[1].groups[0]] if self.held else []
        aux = (self.zero, self.host, self.groupings, len(self.gathered), len(self.others))
        return (*self.gathered, *self.others, *held), aux

    @classmethod
    def tree_unflatten(cls, aux, children) -> GroupedRoutedSlab:
        zero, host, groupings, n, k = aux
        return cls(list(children[:n]), zero, host, groupings, tuple(children[n : n + k]))


class GroupedExpertFetcher(ZeroFetcher):
    """:class:`ShardedExpertFetcher`'s interface under expert parallelism: device (s, g)
    of S x G holds share s of its expert group g's slab and share n = s G + g of the
    dense slab (``grouped.py``). The window gathers the dense pages whole; after
    ``route`` each device copies in its own pages of its group's routed experts (those
    of the union over every device's rows), padded to the busiest device's count (the
    same on every device: the decision is global), and all-gathers them over the data
    axis only, into its group's pages with the others zero.

    On the data x expert x model mesh the block's layout has the experts by (expert
    group, model slice) as its first part and its attention by model slice as its
    second (``layouts.groupings``): a group is then expert group e's slice
    m (the M slices of a group of experts hold the same experts), and the window
    gathers the attention part (over data x expert) beside the dense pages."""

    def __init__(self, block: RoutedBlock, zero, dtype: Any, num_experts: int):
        self.block, self.zero, self.num_experts = block, zero, num_experts
        layout = block.layout  # experts first (``parallel/layouts.py``)
        experts = layout.parts[0]
        self.groups, self.shares = experts.groups, experts.shares
        self.local = experts.layout.leaves[0].shape[0]  # experts a group holds
        self.slices = self.groups * self.local // num_experts  # groups of the same experts
        self.group_share = experts.share  # pages of its group a device holds
        self.pages = PageExperts.of(
            experts.layout, tuple(range(len(experts.layout.leaves))), self.local
        )
        self.first_page, self.own = zero.own_pages(layout)  # this process's
        self.dtype, self.page_elems = np.dtype(dtype), layout.page_elems
        self.layout = layout
        # the other parts and the dense slab, which the window gathers whole
        self._rest = dataclasses.replace(layout, parts=layout.parts[1:])
        axis = experts.grouping.axis
        self._group_sharding = NamedSharding(zero.mesh, PartitionSpec(axis, None))
        self._index_sharding = NamedSharding(zero.mesh, PartitionSpec(axis))
        shape = (self.groups * experts.layout.num_pages, layout.page_elems)
        self._zero = jax.device_put(np.zeros(shape, dtype), self._group_sharding)
        gathered = zero.sharded.gathered
        self._every = jax.device_put(np.arange(num_experts, dtype=np.int32), gathered)
        self._assemblers: dict[int, Any] = {}
        self.fetched = self.offered = self.bytes = 0

    def dense(self, slab: jax.Array) -> GroupedRoutedSlab:
        """The window's copy of a routed block: its dense pages, each device's own copied
        in and all-gathered (every one: no padding)."""
        lay, rest = self.layout, self._rest
        shards = sorted(slab.addressable_shards, key=lambda a: a.index[0].start or 0)
        local = np.concatenate([np.asarray(s.data)[self.group_share :] for s in shards])
        copied = jax.make_array_from_process_local_data(self.zero.sharded.slab_device, local)
        self.zero.comm["all_gather"] += rest.gathered_size * self.dtype.itemsize
        if not rest.parts:  # the dense pages alone
            gathered = self.zero.gather(rest.num_pages)(copied)
            return GroupedRoutedSlab(gathered, self._zero, slab, lay.groupings)
        pages = self.zero.gather(rest.num_pages, rest)(copied)
        return GroupedRoutedSlab(pages.dense, self._zero, slab, lay.groupings, pages.groups)

    def experts(
        self, slab: GroupedRoutedSlab, routing: Routing, fresh: dict[int, np.ndarray] | None = None
    ) -> tuple[GroupPages, list]:
        """The block's pages with each device's group's routed experts gathered in, and
        the pages copied in (none when the slab holds them from this routing's forward).
        ``fresh``: new params of some of this process's pages, by page within its share
        (deferred updates caught up), which replace the slab's."""
        if slab.held is not None and slab.held[0] is routing:
            return slab.held[1], []
        lay, P, G = self.layout, self.page_elems, self.groups
        gs = self.group_share
        need = [self.pages.routed(self._local_ids(routing.ids, g)) for g in range(G)]
        busiest = max(np.bincount(q // gs, minlength=self.shares).max() for q in need)
        rows = padded_rows(int(busiest), gs)
        if not rows:
            pages = slab.dense
            slab.held = (routing, pages)
            return pages, []
        index = np.zeros((G, lay.parts[0].layout.num_pages), np.int32)  # 0: a zero row
        for g, q in enumerate(need):
            owner = q // gs
            index[g, q] = 1 + owner * rows + np.arange(q.size) - np.searchsorted(owner, owner)
        shards = sorted(slab.host.addressable_shards, key=lambda a: a.index[0].start or 0)
        local = np.zeros((len(shards) * rows, P), self.dtype)
        for i, shard in enumerate(shards):
            n = self.zero.first_slot + i
            s, g = divmod(n, G)
            mine = need[g][need[g] // gs == s] - s * gs  # rows of the shard
            local[i * rows : i * rows + mine.size] = np.asarray(shard.data)[mine]
            for j, r in enumerate(mine.tolist()):
                page = n * lay.share + r - self.first_page  # within this process's
                if fresh and page in fresh:
                    local[i * rows + j] = fresh[page]
        copied = jax.make_array_from_process_local_data(self.zero.sharded.slab_device, local)
        at = jax.device_put(index.reshape(-1), self._index_sharding)
        group = self._assemble(rows)(copied, at)
        self.zero.comm["all_gather"] += (self.shares - 1) * rows * P * self.dtype.itemsize
        self.fetched += routing.ids.size
        self.offered += self.num_experts
        self.bytes += lay.devices * rows * P * self.dtype.itemsize
        pages = lay.pages(slab.gathered, group, *slab.others)
        slab.held = (routing, pages)  # (the copies go once gathered)
        return pages, [copied]

    def zero_pages(self, ids: np.ndarray) -> frozenset[int]:
        """This process's pages (numbered within its share) wholly in experts not in
        ``ids``: their gradient is zero."""
        lay, gs, out = self.layout, self.group_share, []
        for g in range(self.groups):
            q = self.pages.unrouted(self._local_ids(ids, g))
            s = q // gs
            out.append((s * self.groups + g) * lay.share + q - s * gs - self.first_page)
        pages = np.concatenate(out)
        return frozenset(pages[(pages >= 0) & (pages < self.own)].tolist())

    def _local_ids(self, ids: np.ndarray, g: int) -> np.ndarray:
        """Of ``ids`` (global experts), group ``g``'s, as its own (0 .. E/G - 1): its
        expert group's (on the 3-D mesh, the M groups of one expert group's slices)."""
        e = g // self.slices
        mine = ids[(ids >= e * self.local) & (ids < (e + 1) * self.local)]
        return mine - e * self.local

    def _assemble(self, rows: int):
        """The jitted gather of ``rows`` copied pages a device (global ``(N rows,
        page_elems)`` over every device) into each group's pages: all-gathered over the
        data axis, each page placed by its index (0: a zero page)."""
        if rows not in self._assemblers:
            grouping = self.layout.parts[0].grouping  # the experts'
            share_axes = grouping.share_axes  # a group's devices: data

            def per_device(copied, index):  # (rows, P), (group pages,)
                gathered = jax.lax.all_gather(copied, share_axes, tiled=True)  # (S rows, P)
                zero = jnp.zeros((1, gathered.shape[1]), gathered.dtype)
                return jnp.concatenate([zero, gathered])[index]

            axis = grouping.axis
            gather = jax.shard_map(
                per_device,
                mesh=self.zero.mesh,
                in_specs=(PartitionSpec(self.zero.page_axes, None), PartitionSpec(axis)),
                out_specs=PartitionSpec(axis, None),
                check_vma=False,
            )
            self._assemblers[rows] = jax.jit(gather, out_shardings=self._group_sharding)
        return self._assemblers[rows]
