"""The memory model: bytes per tier (device, host RAM, NVMe) of a placement, and every
policy constant the runtimes and the planner share.

Pure functions, numbers in and numbers out: no arrays, no I/O. The streaming runtime
builds its device and host plans here at start-up and enforces its budgets with them;
the planner searches placements with the very same functions, so a plan that fits here
fits the runtime (``tests/test_memory_model.py`` checks the two agree byte for byte).

The host plan, the NVMe parts and the in-memory run's parts are in
``hetjax/memory_host.py``, built on this module.

A run is described by :class:`Sizes` (slab elements and bytes per element, activation
sizes; per device for what the device holds, per process for host and NVMe) and an
:class:`Placement` (where params, optimizer state and boundary activations live, the
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
from hetjax.placement import Placement
from hetjax.state_format import MASTER_DTYPE, StateFormat
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
# Uses the streaming window's dispatching thread may run ahead of the device
# (``runtime/loop/window.py``): before dispatching use j it waits for use j - lag. On the CPU
# backend 1: the device is the host's cores, a queued block only competes with them, and
# its dropped slab is host memory the plan does not count. On an accelerator 2: a thread
# that waits for j - 1 leaves the device's queue empty at every block boundary, so every
# GIL holder (the optimizer's dispatches, timeline watchers, I/O callbacks) becomes device
# idle time; the price is one more slab in device memory (:func:`device_parts`), the
# dropped slab of use j - 1 that its queued computation still holds.
WAIT_LAG_HOST = 1
WAIT_LAG_ACCELERATOR = 2


def window_wait_lag(accelerator: bool) -> int:
    """How many uses the window's dispatching thread runs ahead of the device (see
    :data:`WAIT_LAG_ACCELERATOR`): the one policy the runtime's window and the device
    plan both read. ``accelerator``: a device with memory of its own (or the two-client
    emulation of one, so the CPU tests run the accelerator's order)."""
    return WAIT_LAG_ACCELERATOR if accelerator else WAIT_LAG_HOST


# -- gradient buffers on the host -------------------------------------------------------
#
# The host's gradient buffers: how many stages' gradients RAM holds, and where the
# gradients kept for a clipping redo wait (RAM or NVMe).
#
# In sync mode the runtime hands each stage's final gradient slab to the optimizer loop
# (``update_loop.py``) the moment it reaches the host, in backward order. What happens to
# it after its speculative update depends on whether the step can still be *redone*
# (``optimizer.grad_clip > 0``: when the global norm turns out above the threshold every
# stage is updated again, in backward order, with the clip factor):
#
# * ``release`` (no clipping): nothing can redo the update, so the slab is dropped as
#   soon as the update consumed it. When not all of them fit ``memory.host_budget``, the
#   runtime waits while the loop has :data:`GRAD_QUEUE` stages not yet updated
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
# taken (``runtime/loop/grads.py``): device-to-host copies in flight; one more makes the
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


@dataclasses.dataclass(frozen=True, kw_only=True)
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
        return GradientPlan(
            policy=policy,
            all_bytes=0,
            ram_bytes=0,
            max_queued=0,
            ram_stages=(),
            spilled=(),
            spill_bytes=0,
        )
    total = sum(sizes.values())
    everything = GradientPlan(
        policy=policy,
        all_bytes=total,
        ram_bytes=2 * total if policy == "lockfree" else total,
        max_queued=0,
        ram_stages=tuple(order) if policy == "keep" else (),
        spilled=(),
        spill_bytes=0,
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
        return GradientPlan(
            policy=policy,
            all_bytes=total,
            ram_bytes=window,
            max_queued=GRAD_QUEUE,
            ram_stages=(),
            spilled=(),
            spill_bytes=0,
        )
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
        policy=policy,
        all_bytes=total,
        ram_bytes=ram,
        max_queued=GRAD_QUEUE,
        ram_stages=tuple(s for s in order if s in kept),
        spilled=spilled,
        spill_bytes=spill_bytes,
    )


def belady_cache(order: list[str], sizes: dict[str, int], capacity: int) -> list[str]:
    """The stages a cache of ``capacity`` bytes holds in steady state when ``order`` (each
    stage once) repeats forever and eviction follows Belady's rule (furthest next use
    first). On a cycle the stage just used is the one whose next use is furthest (a
    whole cycle away), so a stage that does not fit beside those held is never cached
    and the cache, once full, never changes: the stages taken in order while they fit
    (tests/test_offload.py checks this against the rule simulated over two cycles)."""
    cached, held = set(), 0
    for stage in order:
        if held + sizes[stage] <= capacity:
            cached.add(stage)
            held += sizes[stage]
    return [s for s in order if s in cached]


def grad_policy(config: Config) -> str:
    """How long the host holds gradient buffers (see above): ``lockfree``, all of them
    twice; ``accumulate`` (several micro-batches), all of them all step; ``keep`` (sync
    mode with clipping), until the step commits, for a possible redo (or, with
    ``optimizer.speculation=never``, for the update after backward); ``release`` (no
    clipping), until the stage's update consumed it."""
    if config.optimizer.mode == "lockfree":
        return "lockfree"
    if config.train.grad_accum > 1:
        return "accumulate"
    o = config.optimizer
    return "keep" if o.grad_clip > 0 or o.speculation == "never" else "release"


def block_grad_dtype(config: Config) -> np.dtype:
    """The dtype block gradient slabs are reduce-scattered in (ZeRO-3), cross to the host
    and wait there in: bfloat16 when that loses nothing, i.e. compute in bf16 (its
    gradients are bf16 values), one micro-batch and one device (no sum), sync mode, and
    under ZeRO-3 where ``distributed.reduce_dtype=compute`` asks for it (the sum over
    devices is then rounded to bf16: once for 2 devices, as one device rounds its
    gradient; up to once per device of the ring for more); else fp32. It halves the
    reduce-scatter's bytes (PatrickStar's 6(p-1)/p M counts them in the compute dtype),
    the device-to-host traffic and the host's gradient buffers (4 bytes/param -> 2), as
    Fuyou's fp16 gradients."""
    dist = config.distributed
    if (
        config.model.compute_dtype == "bfloat16"
        and config.train.grad_accum == 1
        and config.optimizer.mode == "sync"
        and (not dist.sharded or dist.reduce_dtype == "compute")
    ):
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32)


def zero3_scatter_bytes(block_elems: int, grad_bytes: int, devices: int) -> int:
    """Device temporaries a ZeRO-3 block backward holds for its reduce-scatter
    (``zero.Zero3.grad_slab``) beyond what the same backward holds on one device at one
    device's rows: the block's whole gradient, which XLA builds in one ``(pages,
    page_elems)`` buffer (the stack of the pages is fused into the gradient's producers:
    no second copy; on one device that buffer is the stage's result, counted under the
    device plan's ``gradients``), and the device's share summed out of it. Against
    XLA:CPU's compiled temporaries (tiny GPT blocks of 64-256 KiB of fp32 gradient,
    2026-11-27): 0.69-1.08 of the measured difference at 2 and 4 devices (the rest is
    buffer packing: the two compile different schedules)."""
    return grad_bytes * block_elems * (devices + 1) // devices


# -- what the model is given ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
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
    state_format: StateFormat  # the optimizer state's kinds and their dtypes
    boundary: int  # bytes of one block-boundary activation of a micro-batch (B, T, D)
    working_set: int  # device temporaries of the largest stage function, with x / dx
    kept: dict[str, int]  # one kept block's in-block activations, per keep level
    grad_policy: str  # grad_policy(config)
    groups: tuple[tuple[str, int, int, int], ...] = ()  # (name, blocks, elements, own)
    # device bytes of the stage groups' contexts through a micro-batch (an encoder's
    # output, read by every decoder block, with its gradient; ``stages/measure.py``)
    context: int = 0
    # what a swapped block moves, per level, where measured (the runtime:
    # stages.StageFunctions.swap_bytes); else derived from ``kept`` (swap_bytes)
    swapped: dict[str, int] = dataclasses.field(default_factory=dict)
    # per device, per level: what one kept block's vjp and one swapped block's residuals
    # (back on the device) hold, as XLA lays them out over the mesh where a block's
    # compute needs it (tensor and expert parallelism; measured by compiling its forward,
    # stages.StageFunctions.held_bytes: the ledger's count); per_device leaves them. A
    # level not here: derived from ``kept`` and ``swapped`` (kept_held, swapped_held)
    held_kept: dict[str, int] = dataclasses.field(default_factory=dict)
    held_swapped: dict[str, int] = dataclasses.field(default_factory=dict)
    # devices a stage's pages split over (ZeRO-3): a gradient slab leaves the backward
    # reduce-scattered, 1/grad_shards of it on each device (the whole one is a
    # temporary of the backward, in ``working_set``: zero3_scatter_bytes)
    grad_shards: int = 1
    # elements a page of the slabs (int8 moments: each page's blocks their own; 0: not
    # known, a slab's blocks counted as one run)
    page_elems: int = 0

    def per_device(self, devices: int, shards: int | None = None, holders: int = 1) -> Sizes:
        """These sizes as one of ``devices`` devices that split a micro-batch's rows
        (ZeRO-3) holds them: the activations counted for the whole micro-batch
        (boundaries, swapped blocks' residuals, a kept block's residuals but its param
        pages, which every device holds whole) divided among the devices. The slabs and
        the working set are one device's already (``stages.StageFunctions.memory_sizes``);
        contexts stay counted whole (T5's hold a param table on every device).
        ``shards``: the devices the pages split over (default ``devices``; with tensor
        parallelism more: :attr:`grad_shards`). ``holders``: the process's devices its
        own slabs split over (ZeRO-3: each holds and updates its own pages of optimizer
        state on the device, ``optimizer/sharded_slab.py``): the own sizes per device."""
        shards = shards or devices
        if holders > 1:
            self = dataclasses.replace(
                self,
                own_embed=self.own_embed // holders,
                own_block=self.own_block // holders,
                own_head=self.own_head // holders,
                groups=tuple((g, n, size, own // holders) for g, n, size, own in self.groups),
            )
        if devices == 1:
            return dataclasses.replace(self, grad_shards=shards) if shards > 1 else self
        pages = self.compute_bytes * self.block
        return dataclasses.replace(
            self,
            grad_shards=shards,
            boundary=self.boundary // devices,
            kept={level: pages + (n - pages) // devices for level, n in self.kept.items()},
            swapped={level: n // devices for level, n in self.swapped.items()},
        )

    def state_nbytes(self, elems: int) -> int:
        """Bytes of ``elems`` elements of every kind of optimizer state (the master's
        among them), as ``state_format`` stores them (whole pages, int8 moments' scales
        per page)."""
        return self.state_format.nbytes(elems, page_elems=self.page_elems)

    def swap_bytes(self, level: str) -> int:
        """Bytes a swapped block moves to host memory and back: as measured, or its kept
        residuals at ``level`` without its param pages (``stages.SwappedBlock``; a
        device that takes the params leaf by leaf holds only those its backward uses, so
        the runtime measures)."""
        if level in self.swapped:
            return self.swapped[level]
        return self.kept[level] - self.compute_bytes * self.block

    def kept_held(self, level: str) -> int:
        """Device bytes of one kept block at ``level``: as measured on the mesh
        (:attr:`held_kept`), else its residuals, param pages included (:attr:`kept`)."""
        return self.held_kept[level] if level in self.held_kept else self.kept[level]

    def swapped_held(self, level: str) -> int:
        """Device bytes of one swapped block's residuals at ``level``: as measured on the
        mesh (:attr:`held_swapped`), else what it moves (:meth:`swap_bytes`)."""
        return self.held_swapped[level] if level in self.held_swapped else self.swap_bytes(level)

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


def params_are_master(o: Placement, compute_bytes: int) -> bool:
    """Whether the params on NVMe are the optimizer state's fp32 master, stored once: fp32
    compute with both on NVMe (``storage/params.py``'s ``MasterPages``). A step then
    writes them once, with the state, and reads a cached stage's from its state in RAM."""
    return o.params == "nvme" and o.optimizer == "nvme" and compute_bytes == MASTER_DTYPE.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
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
    # the host stages' optimizer state in RAM, by stage: twice (committed and speculative)
    host_state: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, s: Sizes, o: Placement) -> DeviceCache:
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
                host_state={n: 2 * s.state_nbytes(s.own(n)) for n in host},
            )
        return s.device_caches[key]

    @classmethod
    def _of(cls, s: Sizes, o: Placement) -> DeviceCache:
        if o.optimizer == "device":  # every stage's state, twice during a step
            total = sum(s.own(n) for n in s.stages())
            return cls(stages=(), blocks=0, params=0, device_bytes=2 * s.state_nbytes(total))
        stages = tuple(s.stages()[: o.device_stages])
        sizes = [s.own(n) for n in stages]
        on_device_grads = s.grad_policy != "lockfree"  # lock-free: they go to the host
        kept = s.grad_policy in ("keep", "accumulate")
        grads = (sum(sizes) if kept else max(sizes, default=0)) if on_device_grads else 0
        state = 2 * s.state_nbytes(sum(sizes)) + s.compute_bytes * sum(sizes)
        blocks = sum(is_block(n) for n in stages)
        return cls(stages=stages, blocks=blocks, params=sum(sizes), device_bytes=state + 4 * grads)

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
    wait_lag: int = WAIT_LAG_HOST  # the window waits for use j - wait_lag (window_wait_lag)

    @property
    def required(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        return (
            f"device plan: prefetch depth {self.prefetch_depth}, {self.resident_blocks} "
            f"resident blocks; {held}; total {format_bytes(self.required)}"
            + (f" (dispatching {self.wait_lag} uses ahead)" if self.wait_lag > 1 else "")
            + (f" of budget {format_bytes(self.budget)}" if self.budget else " (no budget)")
        )


def device_parts(
    s: Sizes, o: Placement, depth: int, resident: int, *, lag: int = WAIT_LAG_HOST
) -> dict[str, int]:
    """Device bytes per device of a streaming run with prefetch ``depth`` and
    ``resident`` blocks, by what they hold; ``lag``: :func:`window_wait_lag`."""
    L, cb = s.num_layers, s.compute_bytes
    # the block computing, those prefetched, and (lag 2) the one before, still queued
    window = min(depth + lag, L - resident)
    boundaries = o.recomputed_blocks(L) if o.activations == "device" else 2
    return {
        "embed+head": cb * (s.embed + s.head),
        "blocks": cb * s.block * (window + resident),
        # reduce-scattered under ZeRO-3: each device's share (the whole gradient is the
        # backward's temporary, in the working set)
        "gradients": DEVICE_GRAD_SLABS
        * max(s.block_grad_bytes * s.block, 4 * s.embed)
        // s.grad_shards,
        "boundaries": boundaries * s.boundary,
        "contexts": s.context,
        "kept": o.keep_blocks * s.kept_held(o.keep_level) if o.keep_blocks else 0,
        # a swapped block's residuals on their way out in forward; in backward the one
        # computing and the next one's, copied in ahead of it
        "swapped": min(2, o.swap_blocks) * s.swapped_held(o.swap_level) if o.swap_blocks else 0,
        "working set": s.working_set,
        "optimizer": DeviceCache.of(s, o).device_bytes,
    }


def plan_device(
    s: Sizes, o: Placement, budget: int, *, lag: int = WAIT_LAG_HOST
) -> DeviceMemoryPlan:
    """The deepest prefetch window (up to ``o.prefetch_depth``) that fits ``budget``
    (0: no limit), then as many resident blocks as the rest allows, at least the device
    cache's. ``lag``: how far the window's thread runs ahead (:func:`window_wait_lag`),
    one more slab each: a window that cannot hold that slab even without prefetch runs
    at lag 1 (the device's queue runs dry at block boundaries, but the step fits).
    Raises ``ConfigError`` with the numbers when not even one stage and its activations
    fit at lag 1."""
    while lag > WAIT_LAG_HOST:
        parts = device_parts(s, o, 0, DeviceCache.of(s, o).blocks, lag=lag)
        if not budget or sum(parts.values()) <= budget:
            break
        lag -= 1
    L = s.num_layers
    least = DeviceCache.of(s, o).blocks
    # Only the blocks' part depends on the window: the rest is fixed.
    parts = device_parts(s, o, 0, least, lag=lag)
    fixed = sum(parts.values()) - parts["blocks"]
    slab = s.compute_bytes * s.block
    total = lambda depth, resident: fixed + slab * (min(depth + lag, L - resident) + resident)
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
            # chunks of rows shrink the working set (blocks that recompute, rows apart)
            + (
                "run each micro-batch in chunks of rows (offload.batch_chunks: a chunk's "
                "working set), "
                if parts["working set"] >= need - budget and not (o.keep_blocks or o.swap_blocks)
                else ""
            )
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
        resident = max(least, min(L, (budget - fixed) // slab - (depth + lag)))
    parts = device_parts(s, o, depth, resident, lag=lag)
    return DeviceMemoryPlan(budget, depth, resident, parts, wait_lag=lag)
