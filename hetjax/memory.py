"""The memory model: bytes per tier (device, host RAM, NVMe) of a placement, and every
policy constant the runtimes and the planner share.

Pure functions, numbers in and numbers out: no arrays, no I/O. The streaming runtime
builds its device and host plans here at start-up and enforces its budgets with them;
the planner searches placements with the very same functions, so a plan that fits here
fits the runtime (``tests/test_memory_model.py`` checks the two agree byte for byte).

A run is described by :class:`Sizes` (slab elements and bytes per element, activation
sizes; per device for what the device holds, per process for host and NVMe) and an
:class:`Offload` (where params, optimizer state and boundary activations live, the
prefetch window, kept blocks, the device cache of optimizer state). Block-boundary
activations (the input of each block, kept from forward for the block's backward) are
called *boundaries* here; "checkpoint" means a training checkpoint only.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes  # numpy's bfloat16 (a jax dependency)
import numpy as np

from hetjax.config import Config, ConfigError, format_bytes
from hetjax.types import is_block, stage_layout

# -- policy constants ----------------------------------------------------------------------

IO_READAHEAD = 2  # stages (state, params) or boundaries read from NVMe ahead of their use
# Stages' worth of the NVMe tier's pooled optimizer I/O buffers (``storage/iopool.py``):
# those read ahead, the one updating and the one being written back.
IO_SLOTS = IO_READAHEAD + 2
DEVICE_GRAD_SLABS = 2  # gradient slabs on the device: one being produced, one to the host
# Stages' worth of the host optimizer's refreshed compute-dtype params on their way to
# the param store (``optimizer.SlabOptimizer.update_host``): the one updating, and the
# one before it still being written to NVMe (or, in RAM, the one it replaces, until no
# forward holds it). They come from the param store's pool (``iopool.SlabPool``).
PUBLISH_SLABS = 2

# -- gradient buffers on the host -------------------------------------------------------
#
# The host's gradient buffers: how many stages' gradients RAM holds, and where the
# gradients kept for a clipping redo wait (RAM or NVMe).
#
# In sync mode the executor hands each stage's final gradient slab to the optimizer loop
# (``update_loop.py``) the moment it reaches the host, in backward order. What happens to
# it after its speculative update depends on whether the step can still be *redone*
# (``optimizer.grad_clip > 0``: when the global norm turns out above the threshold every
# stage is updated again, in backward order, with the clip factor):
#
# * ``release`` (no clipping): nothing can redo the update, so the slab is dropped as
#   soon as the update consumed it. When not all of them fit ``memory.host_budget``, the
#   executor waits while the loop has :data:`GRAD_QUEUE` stages not yet updated
#   (backpressure), so RAM holds only the stages in flight (:func:`in_flight_slabs`), not
#   all of them; with room (or no budget) backward never waits for the loop.
# * ``keep`` (clipping): every stage's gradient is kept until the step commits. They stay
#   in RAM while they fit ``memory.host_budget``; otherwise the plan keeps as many as fit
#   and spills the others to NVMe (ZeRO-Infinity offloads gradients too): a TensorStore
#   array next to the optimizer state, in the dtype the buffer already has, written right
#   after the stage's speculative update and read back (ahead, in backward order) only
#   by a redo. Spilled are the stages backward produces *first* (head, the last blocks):
#   their writes overlap the rest of backward, and the last ones, which would be written
#   at the very end of the step, stay in RAM.
# * ``accumulate`` (``train.grad_accum > 1``): every stage's buffer sums over the
#   micro-batches, so all are held the whole step. ``lockfree``: all of them twice (the
#   loop's accumulator and the step being filled).
#
# The embed's buffer is held all through backward in every policy: its tied-head part
# arrives first and its own gradient last.

POLICIES = ("release", "keep", "accumulate", "lockfree")
GRAD_QUEUE = 1  # stages the loop holds not yet updated (the one updating) before submit waits
# Gradients handed by the dispatching thread to the step's gradient thread and not yet
# taken (``runtime/grads.py``): device-to-host copies in flight; one more makes the
# hand-off wait.
HANDOFF_DEPTH = 2
# Gradient slabs a bounded host holds besides the embed's and the kept ones: the
# HANDOFF_DEPTH copies in flight plus the one the gradient thread holds (waiting for its
# copy, or for room in the loop), a host slab made of it where one is (a loss-scaled
# gradient is divided in a copy), the GRAD_QUEUE the loop holds and, when gradients are
# kept, one being written to NVMe.
D2H_SLABS = HANDOFF_DEPTH + 1


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


def belady_cache(order: list[str], sizes: dict[str, int], capacity: int) -> list[str]:
    """The stages a cache of ``capacity`` bytes holds in steady state when ``order``
    repeats forever and eviction follows Belady's rule (furthest next use first;
    a stage whose own next use is the furthest is not cached at all). Simulated over
    two cycles: the second starts from the first one's end state."""
    n = len(order)
    trace = order * 2
    position = {stage: k for k, stage in enumerate(order)}  # each stage once per cycle
    cache: set[str] = set()
    held = 0
    for t, stage in enumerate(trace):
        if stage in cache:
            continue
        cache.add(stage)
        held += sizes[stage]
        while held > capacity:
            # the next use of s after time t: the same position in the next cycle
            next_use = lambda s, t=t: (position[s] - t) % n or n
            evicted = max(cache, key=lambda s: (next_use(s), s == stage))
            cache.discard(evicted)
            held -= sizes[evicted]
    return [s for s in order if s in cache]


def grad_policy(config: Config) -> str:
    """How long the host holds gradient buffers (see above): ``lockfree``, all of them
    twice; ``accumulate`` (several micro-batches), all of them all step; ``keep`` (sync
    mode with clipping), until the step commits, for a possible redo; ``release`` (no
    clipping), until the stage's update consumed it."""
    if config.optimizer.mode == "lockfree":
        return "lockfree"
    if config.train.grad_accum > 1:
        return "accumulate"
    return "keep" if config.optimizer.grad_clip > 0 else "release"


def block_grad_dtype(config: Config) -> np.dtype:
    """The dtype block gradient slabs cross to the host and wait there in: bfloat16 when
    that loses nothing, i.e. compute in bf16 (its gradients are bf16 values), one
    micro-batch and one device (no sum), sync mode; else fp32. It halves the
    device-to-host traffic and the host's gradient buffers (4 bytes/param -> 2), as
    Fuyou's fp16 gradients."""
    if (
        config.model.compute_dtype == "bfloat16"
        and config.train.grad_accum == 1
        and config.optimizer.mode == "sync"
        and not config.distributed.sharded  # ZeRO-3 sums gradients over devices
    ):
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32)


# -- what the model is given ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A run's sizes as the memory model takes them. Slab sizes are elements of whole
    pages: ``embed``/``block``/``head`` the whole stage (what the device computes on),
    ``own_*`` the part of it this process stores and updates (ZeRO-3: its shards; else
    the whole).

    A model of several stage groups (an encoder and a decoder, ``models/staged.py``)
    lists them in ``groups``: ``(name, blocks, slab elements, own elements)`` each, in
    forward order; ``num_layers`` counts the blocks of all of them and ``block`` /
    ``own_block`` are the largest group's slab, which the device's window and gradient
    slabs are planned for (any block fits where the largest does). Empty ``groups``:
    one group ``block`` of ``num_layers`` blocks of ``block`` elements."""

    num_layers: int
    embed: int
    block: int
    head: int
    own_embed: int
    own_block: int
    own_head: int
    compute_bytes: int  # per compute-dtype element
    block_grad_bytes: int  # per element of a block's gradient slab (block_grad_dtype)
    state_kinds: int  # optimizer state kinds besides the fp32 master (AdamW: 2)
    boundary: int  # bytes of one block-boundary activation of a micro-batch (B, T, D)
    working_set: int  # device temporaries of the largest stage function, with x / dx
    kept: dict[str, int]  # one kept block's in-block activations, per keep level
    grad_policy: str  # grad_policy(config)
    groups: tuple[tuple[str, int, int, int], ...] = ()  # (name, blocks, elements, own)
    # device bytes of the stage groups' contexts through a micro-batch (an encoder's
    # output, read by every decoder block, with its gradient; ``stages.context_bytes``)
    context: int = 0
    # what a swapped block moves, per level, where measured (the runtime:
    # stages.StageFunctions.swap_bytes); else derived from ``kept`` (swap_bytes)
    swapped: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def state_bytes(self) -> int:
        """Bytes per element of fp32 master + optimizer state."""
        return 4 * (1 + self.state_kinds)

    def swap_bytes(self, level: str) -> int:
        """Bytes a swapped block moves to host memory and back: as measured, or its kept
        residuals at ``level`` without its param pages (``stages.SwappedBlock``; a
        device that takes the params leaf by leaf holds only those its backward uses, so
        the runtime measures)."""
        if level in self.swapped:
            return self.swapped[level]
        return self.kept[level] - self.compute_bytes * self.block

    def stages(self) -> list[str]:
        return list(self._stages)

    @functools.cached_property
    def _groups(self) -> tuple[tuple[str, int, int, int], ...]:
        return self.groups or (("block", self.num_layers, self.block, self.own_block),)

    @functools.cached_property
    def _stages(self) -> tuple[str, ...]:  # the planner asks thousands of times
        blocks = (f"{name}{i}" for name, layers, _, _ in self._groups for i in range(layers))
        return ("embed", *blocks, "head")

    @functools.cached_property
    def _own(self) -> dict[str, int]:  # by slab layout
        groups = {name: own for name, _, _, own in self._groups}
        return {"embed": self.own_embed, "head": self.own_head, **groups}

    @property
    def blocks_total(self) -> int:
        """Elements of every block's slab, all groups."""
        return sum(layers * size for _, layers, size, _ in self._groups)

    @functools.cached_property
    def device_caches(self) -> dict[tuple, DeviceCache]:
        """:meth:`DeviceCache.of` of each placement asked for, kept (the planner asks
        for the same ones again and again)."""
        return {}

    def own(self, stage: str) -> int:
        """Elements of ``stage``'s slab this process holds."""
        return self._own[stage_layout(stage)]

    def grad_bytes(self, stage: str) -> int:
        """Bytes of this process's gradient slab of ``stage`` on the host."""
        return self.own(stage) * (self.block_grad_bytes if is_block(stage) else 4)


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where a streaming run keeps each kind of state (``config.offload``'s choices)."""

    params: str = "host"  # host | nvme: compute-dtype params between steps
    optimizer: str = "host"  # device | host | nvme: fp32 master + optimizer state
    activations: str = "device"  # device | host | nvme: block-boundary activations
    prefetch_depth: int = 2  # requested; the device plan may lower it to fit
    keep_blocks: int = 0  # the last blocks keep their in-block activations to backward
    keep_level: str = "all"
    device_stages: int = 0  # the first stages' optimizer state cached on the device
    swap_blocks: int = 0  # the blocks before the kept ones swap in-block activations
    swap_level: str = "matmuls"
    swap_tier: str = "host"  # host | nvme: where swapped activations wait for backward

    @classmethod
    def from_config(cls, config: Config) -> Offload:
        o = config.offload
        return cls(
            o.params,
            o.optimizer,
            o.activations,
            o.prefetch_depth,
            o.keep_blocks,
            o.keep_level,
            o.optimizer_device_stages,
            o.swap_blocks,
            o.swap_level,
            o.swap_tier,
        )

    def recomputed_blocks(self, num_layers: int) -> int:
        """Blocks that store a boundary and recompute their inside in backward: those
        that neither keep nor swap their in-block activations."""
        return num_layers - self.keep_blocks - self.swap_blocks

    @property
    def uses_nvme(self) -> bool:
        swapped = self.swap_tier if self.swap_blocks else "host"
        return "nvme" in (self.params, self.optimizer, self.activations, swapped)


def params_are_master(o: Offload, compute_bytes: int) -> bool:
    """Whether the params on NVMe are the optimizer state's fp32 master, stored once: fp32
    compute with both on NVMe (``storage/params.py``'s ``MasterPages``). A step then
    writes them once, with the state, and reads a cached stage's from its state in RAM."""
    return o.params == "nvme" and o.optimizer == "nvme" and compute_bytes == 4


@dataclasses.dataclass(frozen=True)
class DeviceCache:
    """The device cache of optimizer state of the first ``k`` stages in forward order
    (embed, block 0, ..., head last; ``offload.optimizer_device_stages``): their state
    (twice: committed and speculative), refreshed compute-dtype params and, in sync
    mode, fp32 gradients (all of them, kept for a clipping redo or summed over
    micro-batches, else the largest: one at a time) live on the device."""

    stages: tuple[str, ...]
    blocks: int  # cached blocks: resident on the device
    params: int  # elements of this process's slabs of the cached stages
    device_bytes: int
    # derived from the sizes once (the planner asks thousands of times; set by ``of``):
    host_grad_bytes: int = 0  # per step: the other stages' gradients, to the host
    host: tuple[str, ...] = ()  # host_stages
    host_own: int = 0  # elements of the host stages' slabs this process holds
    host_biggest: int = 0  # of the largest host stage's
    grad_order: tuple[str, ...] = ()  # grad_stages
    grad_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes by stage

    @classmethod
    def of(cls, s: Sizes, o: Offload) -> DeviceCache:
        key = (o.optimizer, o.device_stages)  # all it depends on besides the sizes
        if key not in s.device_caches:
            cache = cls._of(s, o)
            host, order = tuple(cache.host_stages(s)), tuple(cache.grad_stages(s))
            grads = {n: s.grad_bytes(n) for n in order}
            s.device_caches[key] = dataclasses.replace(
                cache,
                host_grad_bytes=sum(grads.values()),
                host=host,
                host_own=sum(s.own(n) for n in host),
                host_biggest=max((s.own(n) for n in host), default=0),
                grad_order=order,
                grad_sizes=grads,
            )
        return s.device_caches[key]

    @classmethod
    def _of(cls, s: Sizes, o: Offload) -> DeviceCache:
        if o.optimizer == "device":  # every stage's state, twice during a step
            total = sum(s.own(n) for n in s.stages())
            return cls((), 0, 0, 2 * s.state_bytes * total)
        stages = tuple(s.stages()[: o.device_stages])
        sizes = [s.own(n) for n in stages]
        on_device_grads = s.grad_policy != "lockfree"  # lock-free: they go to the host
        kept = s.grad_policy in ("keep", "accumulate")
        grads = (sum(sizes) if kept else max(sizes, default=0)) if on_device_grads else 0
        state = (2 * s.state_bytes + s.compute_bytes) * sum(sizes)
        blocks = sum(is_block(n) for n in stages)
        return cls(stages, blocks, sum(sizes), state + 4 * grads)

    def host_stages(self, s: Sizes) -> list[str]:
        """Stages whose state and params live off the device (all, less the cached)."""
        return [n for n in s.stages() if n not in self.stages]

    def grad_stages(self, s: Sizes) -> list[str]:
        """Stages whose gradient reaches the host, in backward order (update order)."""
        on_device = self.stages if s.grad_policy != "lockfree" else ()
        return [n for n in reversed(s.stages()) if n not in on_device]


# -- device ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceMemoryPlan:
    """What the streaming runtime holds on the device, in bytes, and the window it
    chose (:func:`plan_device`)."""

    budget: int  # 0: no limit
    prefetch_depth: int
    resident_blocks: int  # blocks 0 .. r-1 stay on the device across steps
    parts: dict[str, int]  # bytes by what they hold (device_parts)

    @property
    def required(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        return (
            f"device plan: prefetch depth {self.prefetch_depth}, {self.resident_blocks} "
            f"resident blocks; {held}; total {format_bytes(self.required)}"
            + (f" of budget {format_bytes(self.budget)}" if self.budget else " (no budget)")
        )


def device_parts(s: Sizes, o: Offload, depth: int, resident: int) -> dict[str, int]:
    """Device bytes per device of a streaming run with prefetch ``depth`` and
    ``resident`` blocks, by what they hold."""
    L, cb = s.num_layers, s.compute_bytes
    window = min(depth + 1, L - resident)  # the block computing and those prefetched
    boundaries = o.recomputed_blocks(L) if o.activations == "device" else 2
    return {
        "embed+head": cb * (s.embed + s.head),
        "blocks": cb * s.block * (window + resident),
        "gradients": DEVICE_GRAD_SLABS * max(s.block_grad_bytes * s.block, 4 * s.embed),
        "boundaries": boundaries * s.boundary,
        "contexts": s.context,
        "kept": o.keep_blocks * s.kept[o.keep_level] if o.keep_blocks else 0,
        # a swapped block's residuals on their way out in forward; in backward the one
        # computing and the next one's, copied in ahead of it
        "swapped": min(2, o.swap_blocks) * s.swap_bytes(o.swap_level) if o.swap_blocks else 0,
        "working set": s.working_set,
        "optimizer": DeviceCache.of(s, o).device_bytes,
    }


def plan_device(s: Sizes, o: Offload, budget: int) -> DeviceMemoryPlan:
    """The deepest prefetch window (up to ``o.prefetch_depth``) that fits ``budget``
    (0: no limit), then as many resident blocks as the rest allows, at least the device
    cache's. Raises ``ConfigError`` with the numbers when not even one stage and its
    activations fit."""
    L = s.num_layers
    least = DeviceCache.of(s, o).blocks
    # Only the blocks' part depends on the window: the rest is fixed.
    parts = device_parts(s, o, 0, least)
    fixed = sum(parts.values()) - parts["blocks"]
    slab = s.compute_bytes * s.block
    total = lambda depth, resident: fixed + slab * (min(depth + 1, L - resident) + resident)
    if budget and total(0, least) > budget:
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        need = sum(parts.values())
        raise ConfigError(
            f"memory.device_budget {format_bytes(budget)} cannot hold one stage plus its "
            f"activations in device memory: that needs {format_bytes(need)} ({held}"
            + (f", with {least} resident blocks" if least else "")
            + "); short by "
            f"{format_bytes(need - budget)}. Raise memory.device_budget, "
            + ("lower offload.keep_blocks, " if o.keep_blocks else "")
            + ("lower offload.optimizer_device_stages, " if parts["optimizer"] else "")
            + "set offload.activations=host, or lower train.batch_size / raise "
            "train.grad_accum"
        )
    depth = o.prefetch_depth
    while budget and depth > 0 and total(depth, least) > budget:
        depth -= 1
    resident = least
    if budget and total(depth, L) <= budget:
        resident = L
    elif budget:  # below saturation each resident block adds one slab to the window's
        resident = max(least, min(L, (budget - fixed) // slab - (depth + 1)))
    return DeviceMemoryPlan(budget, depth, resident, device_parts(s, o, depth, resident))


# -- host -----------------------------------------------------------------------------------


def host_boundary_bytes(s: Sizes, o: Offload) -> int:
    """Host RAM of boundary activations: all of a micro-batch's with
    ``offload.activations=host``, the NVMe swap's staging with ``nvme``
    (:func:`swap_staging_bytes`)."""
    slots = o.recomputed_blocks(s.num_layers)
    if o.activations == "host":
        return slots * s.boundary
    if o.activations == "nvme":
        return swap_staging_bytes(s.boundary, slots, IO_READAHEAD)
    return 0


def host_swapped_bytes(s: Sizes, o: Offload) -> int:
    """Host RAM of the swapped blocks' activations: all of a micro-batch's with
    ``offload.swap_tier=host``, the NVMe swap's staging with ``nvme``."""
    if not o.swap_blocks:
        return 0
    one = s.swap_bytes(o.swap_level)
    if o.swap_tier == "nvme":
        return swap_staging_bytes(one, o.swap_blocks, IO_READAHEAD)
    return o.swap_blocks * one


def swap_staging_bytes(boundary: int, slots: int, depth: int) -> int:
    """Host RAM the NVMe swap of boundaries holds at most: ``depth`` in flight to disk
    in forward; in backward, the one being taken plus ``depth`` read ahead."""
    return min(slots, depth + 1) * boundary


def host_param_bytes(s: Sizes, o: Offload) -> int:
    """Host RAM of compute-dtype params: every off-device stage's (``params=host``), or
    the NVMe read-ahead window (``nvme``), and the host
    optimizer's refreshed ones in flight (:data:`PUBLISH_SLABS`)."""
    cache = DeviceCache.of(s, o)
    if not cache.host:
        return 0
    publish = PUBLISH_SLABS * s.compute_bytes * cache.host_biggest
    if o.params == "host":
        return s.compute_bytes * cache.host_own + publish
    # those read ahead, and those the window's device copies were made from (on the CPU
    # backend the device array is the host slab itself)
    held = max(param_reads_ahead(o) + 1, master_reads_kept(o, s.compute_bytes))
    return held * s.compute_bytes * cache.host_biggest + publish


def param_reads_ahead(o: Offload) -> int:
    """Stages of params on NVMe read ahead of the use the window is at: its device copies
    (``prefetch_depth``) and the disk reads before them (:data:`IO_READAHEAD`)."""
    return o.prefetch_depth + IO_READAHEAD


def master_reads_kept(o: Offload, compute_bytes: int) -> int:
    """Params that are the master (:func:`params_are_master`): the latest param reads
    kept for the host optimizer's read of the same stage's state, which copies the
    master from them instead of reading it (``storage/params.py``'s ``MasterPages``).
    The loop reads a block's state a few blocks after backward read its params, and
    further behind while the disk is slow: at 310.8M params, keeping the reads ahead
    (4) caught 8 of 24 blocks a step, twice that all but one (python -m hetjax.launch
    --config configs/gpt310m_peer.py, params and optimizer on NVMe: 5.72-5.90 against
    4.95-5.06 GB read a step; docs/results/2026-11-25.md)."""
    return 2 * param_reads_ahead(o) if params_are_master(o, compute_bytes) else 0


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    """What the streaming runtime holds in host RAM, in bytes, and the state cache
    (:func:`plan_host`)."""

    budget: int  # 0: no limit
    param_slabs: int  # compute-dtype params (all stages, or the NVMe read-ahead window)
    gradients: int  # gradient buffers in RAM (``grads`` says which, and what spills)
    optimizer_state: int  # state kept in RAM (offload.optimizer=host), x2 while speculative
    optimizer_io: int  # NVMe read-ahead, the stage updating and its write-back
    cache: int  # NVMe state cached in RAM
    cached_stages: tuple[str, ...]
    grads: GradientPlan
    boundaries: int = 0  # boundary activations (host) or their NVMe staging (nvme)
    swapped: int = 0  # swapped blocks' in-block activations, forward to backward
    # params on NVMe: blocks whose forward read is kept in RAM for their backward, which
    # then reads nothing (:func:`kept_param_blocks`), and their bytes
    kept_param_blocks: int = 0
    kept_params: int = 0

    @property
    def required(self) -> int:
        return sum(self.parts.values())

    @property
    def pinned(self) -> int:
        """Bytes of it in the device's ``pinned_host`` memory: what moves to and from
        the device (param slabs, gradient buffers, boundary and swapped activations).
        Optimizer state and its I/O live in the host optimizer's own (pageable) memory."""
        return self.param_slabs + self.kept_params + self.gradients + self.boundaries + self.swapped

    def check_pinned(self, limit: int) -> None:
        """Raises ConfigError when the pinned part exceeds ``limit`` (XLA's cap on a GPU
        process's pinned host memory: ``xla_env.pinned_limit``)."""
        if self.pinned > limit:
            raise ConfigError(
                f"the host plan needs {format_bytes(self.pinned)} of pinned host memory "
                f"(param slabs {format_bytes(self.param_slabs)}, gradient buffers "
                f"{format_bytes(self.gradients)}, boundary activations "
                f"{format_bytes(self.boundaries)}, swapped activations "
                f"{format_bytes(self.swapped)}) and XLA allows {format_bytes(limit)}: "
                f"short by {format_bytes(self.pinned - limit)}. Raise "
                "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (python -m hetjax.launch sets it from "
                "memory.host_budget), or set offload.params=nvme"
            )

    @property
    def parts(self) -> dict[str, int]:
        """Bytes by what they hold."""
        return {
            "params": self.param_slabs,
            "params kept for backward": self.kept_params,
            "gradients": self.gradients,
            "optimizer": self.optimizer_state,
            "optimizer I/O": self.optimizer_io,
            "boundaries": self.boundaries,
            "swapped activations": self.swapped,
            "optimizer cache": self.cache,
        }

    def describe(self) -> str:
        parts = [f"param slabs {format_bytes(self.param_slabs)}", self.grads.describe()]
        if self.kept_params:
            parts.append(
                f"params kept for backward {format_bytes(self.kept_params)} "
                f"({self.kept_param_blocks} blocks)"
            )
        if self.optimizer_state:
            parts.append(f"optimizer state {format_bytes(self.optimizer_state)}")
        if self.boundaries:
            parts.append(f"boundary activations {format_bytes(self.boundaries)}")
        if self.swapped:
            parts.append(f"swapped activations {format_bytes(self.swapped)}")
        if self.optimizer_io:
            parts.append(f"optimizer I/O buffers {format_bytes(self.optimizer_io)}")
            parts.append(
                f"state cache {format_bytes(self.cache)} ({len(self.cached_stages)} stages)"
            )
        limit = f" of budget {format_bytes(self.budget)}" if self.budget else " (no budget)"
        total = f"total {format_bytes(self.required)}{limit}, {format_bytes(self.pinned)} pinned"
        return f"host plan: {', '.join(parts)}; {total}"


def plan_host(s: Sizes, o: Offload, budget: int, strict: bool = True) -> HostMemoryPlan:
    """Plans host RAM (``budget`` bytes, 0: no limit) for the off-device stages.
    Speculative updates keep a stage's old and new state until the step commits, so
    state held in RAM counts twice. Gradient buffers get the RAM they need next, bounded
    when all of them do not fit (:func:`plan_gradients`; kept ones may spill to NVMe when
    anything lives there). With the optimizer on NVMe the RAM left after that caches
    whole stages of state, chosen by :func:`belady_cache`; no budget means no cache.
    Raises ``ConfigError`` naming the shortfall when the minimum does not fit (unless
    ``strict`` is False: then the plan is returned, over budget)."""
    cache_of = DeviceCache.of(s, o)
    tier, policy = o.optimizer, s.grad_policy
    param_slabs = host_param_bytes(s, o)
    boundaries = host_boundary_bytes(s, o)
    swapped = host_swapped_bytes(s, o)
    state = 2 * s.state_bytes * cache_of.host_own if tier == "host" else 0
    biggest = s.state_bytes * cache_of.host_biggest
    io = IO_SLOTS * biggest if tier == "nvme" else 0
    others = param_slabs + state + io + boundaries + swapped
    order, sizes = list(cache_of.grad_order), cache_of.grad_sizes
    grads = plan_gradients(sizes, order, policy, budget - others if budget else None, o.uses_nvme)
    required = others + grads.ram_bytes
    if strict and budget and required > budget:
        hints = {
            "host": "set offload.optimizer=nvme",
            "nvme": "set offload.params=nvme" if param_slabs > io else "lower memory.page_size",
            "device": "set offload.optimizer=nvme",
        }
        hint = hints[tier]
        if policy == "keep" and not grads.bounded and not o.uses_nvme:
            hint += " (gradients kept for clipping then spill to NVMe) or optimizer.grad_clip=0"
        if o.activations == "host" and boundaries >= max(param_slabs, io, state):
            hint = "set offload.activations=nvme"
        if swapped >= max(param_slabs, io, state, boundaries):
            hint = "lower offload.swap_blocks"
        raise ConfigError(
            f"memory.host_budget {format_bytes(budget)} is too small for the minimum host "
            f"working set {format_bytes(required)} (param slabs {format_bytes(param_slabs)}, "
            f"gradient buffers {format_bytes(grads.ram_bytes)}"
            + (f", optimizer state {format_bytes(state)}" if state else "")
            + (f", optimizer I/O buffers {format_bytes(io)}" if io else "")
            + (f", boundary activations {format_bytes(boundaries)}" if boundaries else "")
            + (f", swapped activations {format_bytes(swapped)}" if swapped else "")
            + f"); host is short by {format_bytes(required - budget)}. Raise "
            f"memory.host_budget or {hint}"
        )
    cached: list[str] = []
    if tier == "nvme" and budget and required < budget:
        stage_state = {n: s.state_bytes * s.own(n) for n in cache_of.host}
        doubled = {n: 2 * b for n, b in stage_state.items()}
        cached = belady_cache([n for n in order if n in doubled], doubled, budget - required)
    cache = sum(2 * s.state_bytes * s.own(n) for n in cached)
    kept_blocks = kept_param_blocks(s, o, budget - required - cache if budget else 0)
    kept = kept_blocks * s.compute_bytes * s.own_block
    return HostMemoryPlan(
        budget,
        param_slabs,
        grads.ram_bytes,
        state,
        io,
        cache,
        tuple(cached),
        grads,
        boundaries,
        swapped,
        kept_blocks,
        kept,
    )


def kept_param_blocks(s: Sizes, o: Offload, room: int) -> int:
    """With params on NVMe, how many blocks keep in RAM the params their forward read,
    for their backward: those blocks' params are read from disk once a step instead of
    twice. The blocks fetched again for backward are the ones neither kept on the
    device (``offload.keep_blocks``) nor device-cached; ``room`` (bytes of the host
    budget the optimizer state cache left) bounds them. No budget (``room`` 0) keeps
    none, as it caches no optimizer state: without one the plan does not know how much
    RAM there is. They come after the state cache: per byte of RAM a cached stage saves
    half a byte of state read and half a byte written (it holds its old and new state),
    a kept block a byte of params read, and writes are a disk's slower direction
    (measured at 310.8M with a 6 GiB budget, kept blocks first: 0.55 GB/step less read,
    0.60 GB more written, the same step; docs/results/2026-11-25.md)."""
    if o.params != "nvme" or room <= 0:
        return 0
    fetched_again = max(0, s.num_layers - o.keep_blocks - DeviceCache.of(s, o).blocks)
    return min(fetched_again, room // (s.compute_bytes * s.own_block))


def host_minimum(s: Sizes, o: Offload) -> HostMemoryPlan:
    """The least host RAM ``o`` can run in: gradient buffers bounded to the stages in
    flight (what :func:`plan_host` chooses when RAM is short), no state cache."""
    return plan_host(s, o, budget=1, strict=False)


# -- NVMe -----------------------------------------------------------------------------------


def nvme_parts(s: Sizes, o: Offload, host: HostMemoryPlan) -> dict[str, int]:
    """NVMe bytes per process, by what they hold: two generations of optimizer state and
    of params (the committed one and the one being written; none of params that are the
    master, :func:`params_are_master`), every boundary activation
    not kept in a block, and the gradients the host plan spills."""
    own = DeviceCache.of(s, o).host_own
    slots = o.recomputed_blocks(s.num_layers)
    return {
        "optimizer": 2 * s.state_bytes * own if o.optimizer == "nvme" else 0,
        "params": (
            2 * s.compute_bytes * own
            if o.params == "nvme" and not params_are_master(o, s.compute_bytes)
            else 0
        ),
        "boundaries": slots * s.boundary if o.activations == "nvme" else 0,
        "swapped activations": (
            o.swap_blocks * s.swap_bytes(o.swap_level)
            if o.swap_blocks and o.swap_tier == "nvme"
            else 0
        ),
        "gradients": host.grads.spill_bytes,
    }


# -- offload.mode=none -------------------------------------------------------------------------


def in_memory_parts(s: Sizes, remat: bool) -> dict[str, int]:
    """Device bytes of ``offload.mode=none`` (everything on the device, fp32), by what
    they hold: with ``remat`` the blocks keep their boundaries only."""
    params = s.embed + s.blocks_total + s.head
    L = s.num_layers
    acts = (L * s.boundary if remat else L * s.kept["all"]) + s.working_set + s.context
    return {
        "params": 4 * params,
        "gradients": 4 * params,
        "optimizer": 4 * s.state_kinds * params,
        "act": acts,
    }
