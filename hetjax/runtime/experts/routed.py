"""Expert-aware streaming (``offload.expert_fetch=routed``): a streamed mixture-of-experts
block copies to the device only the experts its tokens were routed to.

A Mixtral-style block's experts are most of its bytes (Mixtral 8x7B: 96%), and a streamed
block is copied in twice a micro-batch (forward, and backward's recompute). With the
routing known, only the experts that got a (token, expert) pair need to cross: a skewed
router, a short micro-batch or many fine-grained experts leave experts without one. The
window (``window.py``) copies a routed block's dense leaves (attention, norms, router)
ahead as for any block, as a :class:`RoutedSlab` that keeps the host's leaves beside
them. Forward then runs the block in two halves (:class:`RoutedBlock`):

    route    attention and the router -> the residual stream, the routing decision
             (top_e), pairs per expert (E,); the host reads the counts (a sync)
    experts  copied in: the rows of the expert leaves with pairs, in expert order
    mlp      the rest of the block over those experts (``ragged_dot`` over the held
             experts only: the routed ones, and zero rows up to a multiple of E/8, so
             that the functions compile for at most 8 sizes), with the decision from
             ``route``

Backward recomputes the block from its boundary with the same decision (kept on the
device from forward, (B T, k) int32) and the same experts, copied in again ahead of it
(the dispatch runs ahead: the copy overlaps the previous block's backward). The
gradient of an expert that got no pair is zero, as when every expert is fetched; the
device writes it into the full gradient's pages, of which those wholly in such experts
do not leave the device (:meth:`ExpertFetcher.zero_pages`: the host takes zeros of its
own), so the optimizer and the stores see the stage as before, and the step equals
``expert_fetch=all`` (the decision is made once, so no recompute can route a token
differently). With the optimizer state on NVMe, the updates of those pages are deferred
until the expert's next use, exactly (``optimizer/deferred.py``: AdamW moves an expert
with a zero gradient too, so they are caught up, not dropped). What it costs: one host
sync per routed block per forward, at which the device waits for the copy of the
experts (and for the catch-up of the routed experts left behind).

Used for the blocks that recompute (boundary blocks), on one device (under ZeRO-3's
data, expert and tensor parallelism by page instead: ``routed_zero.py``, under tensor
parallelism each device's slice of the pages), for models with
``expert_routing``: Mixtral-style Llama blocks (``models/llama.py``) and T5's Switch
blocks (``models/t5.py``: a dense layer, then a sparse one whose attention and router
run in ``route``; the decoder's take the encoder's output as their context, whose
gradient the backward returns); kept, swapped, resident and device-cached blocks are
whole on the device anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.storage.pages import LeafBuffers, SlabLayout
from hetjax.support import supports
from hetjax.types import stage_layout


def expert_leaves(layout: SlabLayout, model) -> tuple[int, ...]:
    """Slab indices of a MoE block's expert leaves (the model's ``is_expert``: Mixtral's
    ``moe/{gate,up,down}_proj``, a Switch layer's ``moe/{wi_0,wi_1,wo}``), the experts
    on their first axis."""
    return tuple(k for k, leaf in enumerate(layout.leaves) if model.is_expert(leaf.path))


def routed_expert_leaves(layout: SlabLayout, model, where: str) -> tuple[int, ...]:
    """:func:`expert_leaves` of a block that routes; a ``ValueError`` naming the fix when
    there are none (its held rows would be taken for every expert's: wrong, not slow)."""
    at = expert_leaves(layout, model)
    if not at:
        raise ValueError(
            f"{where}'s block has no expert leaves named .../moe/<one of "
            f"{model.expert_params}>: set the model's expert_params to its experts' "
            "param names, or expert_routing to False"
        )
    return at


def check_routed_experts(offload, model, layouts, block_names, *, parallelism: str) -> None:
    """Refuses expert-aware streaming of a model whose blocks' expert leaves are not
    found (:func:`routed_expert_leaves`) at start-up, before anything compiles."""
    if offload.expert_fetch != "routed" or not model.expert_routing:
        return
    if supports("routed_experts", parallelism) is not None:
        return  # (not routed: support.fallbacks says so)
    for name in dict.fromkeys(stage_layout(b) for b in block_names):
        routed_expert_leaves(layouts[name], model, f"stage layout {name}")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class RoutedSlab:
    """A routed block's params as the window holds them: ``dense``, its leaf buffers on
    the device with each expert leaf an empty (0, ...) placeholder, and ``host``, every
    leaf as the param store handed it out (views of its host slab), from which the
    routed experts are copied. A pytree of its device arrays only (what the ledger and
    the timeline count)."""

    dense: LeafBuffers
    host: LeafBuffers
    # the last routing's experts on the device, (routing, their rows per expert leaf):
    # a backward that finds the slab still in the window (the last block's, used again
    # right after its forward) copies nothing again
    held: tuple | None = None

    def tree_flatten(self):
        held = list(self.held[1]) if self.held else []
        return (*self.dense, *held), (self.host, len(self.dense), self.held)

    @classmethod
    def tree_unflatten(cls, aux, children) -> RoutedSlab:
        host, n, held = aux
        return cls(LeafBuffers(children[:n]), host, held)

    def with_experts(self, experts: list[jax.Array], at: tuple[int, ...]) -> LeafBuffers:
        """The leaf buffers with the held experts' rows at the expert leaves ``at``."""
        leaves = list(self.dense)
        for k, rows in zip(at, experts, strict=True):
            leaves[k] = rows
        return LeafBuffers(leaves)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Routing:
    """One routed block's decision for one micro-batch, from its forward to its backward:
    ``ids`` the experts with pairs (host, increasing), and on the device the decision
    ``top_e`` (B T, k), ``slots`` (E,) each expert's row among the held, and ``ids``
    padded with E to the held count (:func:`held_experts`)."""

    ids: np.ndarray
    top_e: jax.Array
    slots: jax.Array
    ids_device: jax.Array

    @classmethod
    def of(cls, counts: np.ndarray, top_e: jax.Array, put) -> Routing:
        E = counts.shape[0]
        ids = np.flatnonzero(counts).astype(np.int32)
        slots = np.zeros(E, np.int32)
        slots[ids] = np.arange(ids.size, dtype=np.int32)
        padded = np.full(held_experts(ids.size, E), E, np.int32)  # E: a padding row
        padded[: ids.size] = ids
        return cls(ids, top_e, put(slots), put(padded))

    def tree_flatten(self):  # a pytree of its device arrays (the ledger counts them)
        return (self.top_e, self.slots, self.ids_device), self.ids

    @classmethod
    def tree_unflatten(cls, ids, children) -> Routing:
        return cls(ids, *children)


def held_experts(routed: int, num_experts: int) -> int:
    """The experts a routed block holds on the device for ``routed`` experts with pairs:
    rounded up to a multiple of E/8, so that its functions compile for at most 8 sizes
    (each distinct size is an XLA compilation); the extra rows are zeros made on the
    device, which no pair uses."""
    step = max(1, num_experts // 8)
    return min(num_experts, -(-routed // step) * step)


def expert_rows(leaf, ids: np.ndarray) -> list[np.ndarray]:
    """Each routed expert's rows of a host expert leaf (E, ...), as views of it (no host
    copy: each copies to the device from where it lies)."""
    return [leaf[e : e + 1] for e in ids]


def _assemble(rows: list[list[jax.Array]]) -> list[jax.Array]:
    """On the device: each expert leaf's held rows (one (1, ...) array each) -> one
    (held, ...) array. Compiled once per held count, not per routed count: the padding
    rows are one zero row passed again."""
    return [jnp.concatenate(leaf) for leaf in rows]


class RoutedBlock:
    """The jitted functions of a routed block of stage group ``g`` (module docstring);
    ``b``: a block's leaf buffers with the expert leaves holding the routed experts' rows
    (``route``: any rows, it reads none); ``c``: the group's context (empty for GPT's and
    Llama's one group; ``stages.GroupFunctions``). ``route(b, x, c) -> (x after
    attention, top_e, counts)``; ``mlp(b, x_mid, top_e, slots, c) -> (y, statistics)``;
    ``backward(b, ids, top_e, slots, x, dy, dstats=None, c=(), dcontext=()) -> ((db, its
    norms), dx, dcontext + the block's)``, db the whole block's gradient pages (zero for
    the experts not held). ``cast``: a block gradient (leaf buffers) -> its pages as they
    leave the device, and their norms; ``cotangent``: of the forward's results;
    ``unflatten``: the pages (or leaf buffers) -> the block's params as the compute
    layout computes with them (tensor parallelism: split by their logical axes,
    ``zero.Zero3.constrain``; else ``layout.unflatten_pages``)."""

    def __init__(self, model, g: int, layout: SlabLayout, jit, cast, cotangent, unflatten=None):
        self.expert_leaves = at = routed_expert_leaves(layout, model, f"stage group {g}")
        self.is_expert = model.is_expert  # (a leaf path: the tensor-parallel fetcher's)
        unflatten = unflatten or layout.unflatten_pages

        def route(b, x, c=()):
            return model.route(g, unflatten(b), x, c)

        def mlp(b, x_mid, top_e, slots, c=()):
            return model.routed_block(g, unflatten(b), x_mid, (top_e, slots), c, part="mlp")

        def backward(b, ids, top_e, slots, x, dy, dstats=None, c=(), dcontext=()):
            fwd = lambda b, x, c: model.routed_block(g, unflatten(b), x, (top_e, slots), c)
            _, vjp = jax.vjp(fwd, b, x, c)
            db, dx, dc = vjp(cotangent(dy, dstats))
            if not isinstance(db, LeafBuffers):  # pages, every expert's (``routed_zero.py``)
                return cast(db), dx, jax.tree.map(jnp.add, dcontext, dc)
            whole = list(db)
            for k in at:  # the held experts' rows into the whole leaf's gradient
                leaf = layout.leaves[k]
                zeros = jnp.zeros(leaf.shape, db[k].dtype)
                whole[k] = zeros.at[ids].set(db[k], mode="drop")  # (padding rows: id E)
            return cast(LeafBuffers(whole)), dx, jax.tree.map(jnp.add, dcontext, dc)

        self.route, self.mlp, self.backward = jit(route), jit(mlp), jit(backward)
        self.layout = layout

    def placeholders(self, dtype: Any, sharding) -> dict[int, jax.Array]:
        """The empty (0, ...) arrays standing for the expert leaves in a routed slab's
        dense leaf buffers."""
        return {
            k: jax.device_put(np.zeros((0, *self.layout.leaves[k].shape[1:]), dtype), sharding)
            for k in self.expert_leaves
        }


class ExpertFetcher:
    """Copies routed blocks' params to the device: :meth:`dense` the leaves but the
    experts (the window's copy), :meth:`experts` the routed experts' rows; counts the
    experts copied and the bytes (for the step's metrics). ``stage_to``: pinned host
    memory (``Shardings.pinned_staging``; None on a CPU) the routed rows are gathered
    into before their copy to the device, so that the copy is a DMA from pinned memory,
    not from pageable rows."""

    def __init__(self, block: RoutedBlock, dtype: Any, device, num_experts: int, stage_to=None):
        self.block, self.device, self.num_experts = block, device, num_experts
        self.stage_to = stage_to
        self._empty = block.placeholders(dtype, device)
        self._zero_pages: dict[bytes, frozenset[int]] = {}  # by the routed experts
        self._assemble = jax.jit(_assemble)
        # one zero expert row per expert leaf, on the device: the held rows' padding
        shapes = [(1, *block.layout.leaves[k].shape[1:]) for k in block.expert_leaves]
        self._zero = [jax.device_put(np.zeros(s, dtype), device) for s in shapes]
        self.fetched = self.offered = self.bytes = 0

    def routing(self, counts: np.ndarray, top_e: jax.Array, put) -> Routing:
        """The decision of ``route`` (``counts`` pairs per expert; ``put``: a host array
        onto the device)."""
        return Routing.of(counts, top_e, put)

    def unsent_pages(self, ids: np.ndarray) -> frozenset[int]:
        """Pages of the block's gradient that do not leave the device: those known zero
        (:meth:`zero_pages`; the host takes zeros of its own)."""
        return self.zero_pages(ids)

    def dense(self, leaves: LeafBuffers) -> RoutedSlab:
        """The window's copy of a routed block: its leaves but the experts, and the host
        leaves the experts' rows are copied from later (numpy: a pinned JAX array, as the
        NVMe store stages reads on a GPU, becomes one once, not at every expert copy)."""
        at = self._empty
        on_device = jax.device_put(
            [leaf for k, leaf in enumerate(leaves) if k not in at], self.device
        )
        it = iter(on_device)
        dense = LeafBuffers(at[k] if k in at else next(it) for k in range(len(leaves)))
        host = LeafBuffers(np.asarray(leaf) if k in at else leaf for k, leaf in enumerate(leaves))
        return RoutedSlab(dense, host)

    def experts(
        self, slab: RoutedSlab, routing: Routing, fresh: dict[int, np.ndarray] | None = None
    ) -> tuple[LeafBuffers, list]:
        """The slab's leaf buffers with the routed experts' rows, and the rows copied in
        for them (none when the slab holds them from this routing's forward). ``fresh``:
        new params of some of the block's pages, by page (deferred updates caught up
        since the slab was read: ``optimizer/deferred.py``), which replace the slab's."""
        at = self.block.expert_leaves
        if slab.held is not None and slab.held[0] is routing:
            return slab.with_experts(slab.held[1], at), []
        rows = [expert_rows(slab.host[k], routing.ids) for k in at]
        if fresh:
            rows = [
                self._refreshed(k, leaf, routing.ids, fresh)
                for k, leaf in zip(at, rows, strict=True)
            ]
        self.fetched += routing.ids.size
        self.offered += self.num_experts
        self.bytes += sum(r.nbytes for leaf in rows for r in leaf)
        if self.stage_to is not None:  # (dispatched: the copy to the device queues behind)
            rows = jax.device_put(rows, self.stage_to)
        copied = jax.device_put(rows, self.device)
        pad = held_experts(routing.ids.size, self.num_experts) - routing.ids.size
        padded = zip(copied, self._zero, strict=True)
        held = self._assemble([[*leaf, *[zero] * pad] for leaf, zero in padded])
        slab.held = (routing, held)
        return slab.with_experts(held, at), copied

    def _refreshed(self, k: int, rows: list, ids: np.ndarray, fresh: dict) -> list:
        """Expert leaf ``k``'s rows of the experts ``ids`` with the elements in
        ``fresh``'s pages taken from there (a copy of each row that has some)."""
        layout = self.block.layout
        leaf, P = layout.leaves[k], layout.page_elems
        size = leaf.size // self.num_experts
        out = []
        for e, row in zip(ids, rows, strict=True):
            lo = leaf.offset + int(e) * size
            pages = [p for p in range(lo // P, (lo + size - 1) // P + 1) if p in fresh]
            if pages:
                row = np.array(row)
                flat = row.reshape(-1)
                for p in pages:
                    a, b = max(lo, p * P), min(lo + size, (p + 1) * P)
                    flat[a - lo : b - lo] = fresh[p][a - p * P : b - p * P]
            out.append(row)
        return out

    def zero_pages(self, ids: np.ndarray) -> frozenset[int]:
        """The pages of the block's gradient that lie wholly in experts not in ``ids``
        (zero: those experts got no token), which need not leave the device."""
        key = ids.tobytes()
        if len(self._zero_pages) > 4096:  # routings seen: a bounded cache
            self._zero_pages.clear()
        if key not in self._zero_pages:
            layout, P = self.block.layout, self.block.layout.page_elems
            skipped = np.ones(self.num_experts, bool)
            skipped[ids] = False
            touched = np.zeros(layout.num_pages, bool)
            start = 0  # the elements between skipped experts' rows are touched
            for k in self.block.expert_leaves:  # (in slab order: offsets increase)
                leaf = layout.leaves[k]
                rows = leaf.size // self.num_experts
                for e in np.flatnonzero(skipped):
                    lo = leaf.offset + e * rows
                    if lo > start:
                        touched[start // P : (lo - 1) // P + 1] = True
                    start = lo + rows
            if layout.size > start:  # the padding after the leaves is zero too
                touched[start // P : (layout.size - 1) // P + 1] = True
            self._zero_pages[key] = frozenset(np.flatnonzero(~touched).tolist())
        return self._zero_pages[key]


class ExpertFetchers(dict):
    """The routed stage groups' fetchers, by group index (T5's encoder and decoder
    blocks differ), and the step's counts over all of them."""

    def take(self) -> dict[str, float | int]:
        """The step's counts (and resets them): experts copied in (each copy of a block's
        routed experts, forward and backward), their share of every expert of those
        copies, and the bytes of expert rows copied."""
        fetched = sum(f.fetched for f in self.values())
        offered = sum(f.offered for f in self.values())
        out = {
            "experts_fetched": fetched,
            "experts_fetched_fraction": fetched / offered if offered else 1.0,
            "expert_bytes_fetched": sum(f.bytes for f in self.values()),
        }
        for f in self.values():
            f.fetched = f.offered = f.bytes = 0
        return out


def routed_blocks(
    offload, model, layouts, block_names, resident, device_stages, *, parallelism: str
) -> frozenset[str]:
    """The blocks streamed expert-aware (``offload.expert_fetch=routed``, a model whose
    blocks support it, a ``parallelism`` that does: ``support.supports``): those that
    stream and recompute; the ``resident`` first blocks, device-cached, kept and swapped
    blocks are whole on the device anyway."""
    if offload.expert_fetch != "routed" or not model.expert_routing:
        return frozenset()
    # (where the parallelism does not support it the run says so: support.fallbacks)
    if supports("routed_experts", parallelism) is not None:
        return frozenset()
    first_swap = len(block_names) - offload.keep_blocks - offload.swap_blocks
    whole = {*block_names[:resident], *device_stages}
    return frozenset(n for n in block_names[:first_swap] if n not in whole)


class DeferredExperts:
    """A streaming run's side of deferred expert updates (``optimizer/deferred.py``):
    at each routed block's forward, the pages of experts without a token in any of the
    step's micro-batches so far (told to the update loop at the last micro-batch), and
    the routed experts' pages behind, caught up before they are copied in; their new
    params by stage and page (``fresh``) until the next commit republishes the stages.
    Inactive (``loop`` None): nothing deferred, nothing fresh."""

    def __init__(self, loop):
        self.loop = loop
        self._skipped: dict[str, frozenset[int]] = {}  # intersection over micro-batches
        self.last_micro = False
        self.fresh: dict[str, dict[int, np.ndarray]] = {}

    def begin_step(self) -> None:
        self._skipped = {}

    def committed(self) -> None:
        """Every stage was updated (or not): its params are current."""
        self.fresh = {}

    def forward(self, name: str, fetcher: ExpertFetcher, routing: Routing, training: bool):
        """A routed block's forward has routed: defers (training only: an evaluation
        defers nothing) and catches up."""
        if self.loop is None:
            return
        zero = fetcher.zero_pages(routing.ids)
        if training:
            skipped = self._skipped.get(name)
            self._skipped[name] = zero if skipped is None else skipped & zero
            if self.last_micro:
                self.loop.deferral.defer(name, self._skipped[name])
        caught = self.loop.catch_up(name, keep=zero)  # the routed experts' pages
        if caught:
            self.fresh.setdefault(name, {}).update(caught)

    def flush(self, param_store, pages_of) -> None:
        """Catches up every deferred page, stage by stage, and refreshes the param
        store's copies (``pages_of(stage)``: its new params, asked for only where the
        store keeps params of its own): before a checkpoint, an export, the end."""
        if self.loop is None:
            return
        for stage in self.loop.pending():
            self.loop.catch_up(stage)
            param_store.refresh(stage, functools.partial(pages_of, stage))

    def take(self) -> dict[str, int]:
        """The step's counts (``Deferred.take``), none when inactive."""
        return self.loop.deferral.take() if self.loop is not None else {}
