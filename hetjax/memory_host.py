"""The memory model's host RAM and NVMe parts: the host plan (what the streaming
runtime's process holds in RAM, by part, within ``memory.host_budget``), the NVMe
tier's bytes, and the in-memory run's device bytes. Split from ``hetjax/memory.py``
(its sizes, policy constants, gradient plan and device plan), which it builds on; the
same pure functions serve the runtime and the planner.

The policy constants a test may change (``IO_READAHEAD``) and ``params_are_master``
are read from ``hetjax.memory`` at each call, so a run and its plan always agree."""

from __future__ import annotations

import dataclasses

from hetjax import memory
from hetjax.config import ConfigError, format_bytes
from hetjax.memory import (
    IO_SLOTS,
    PUBLISH_SLABS,
    DeviceCache,
    GradientPlan,
    Sizes,
    belady_cache,
    plan_gradients,
)
from hetjax.placement import Placement
from hetjax.types import MASTER

# -- host -----------------------------------------------------------------------------------


def host_boundary_bytes(s: Sizes, o: Placement) -> int:
    """Host RAM of boundary activations: all of a micro-batch's with
    ``offload.activations=host``, the NVMe swap's staging with ``nvme``
    (:func:`swap_staging_bytes`)."""
    slots = o.recomputed_blocks(s.num_layers)
    if o.activations == "host":
        return slots * s.boundary
    if o.activations == "nvme":
        return swap_staging_bytes(s.boundary, slots, memory.IO_READAHEAD)
    return 0


def host_swapped_bytes(s: Sizes, o: Placement) -> int:
    """Host RAM of the swapped blocks' activations: all of a micro-batch's with
    ``offload.swap_tier=host``, the NVMe swap's staging with ``nvme``."""
    if not o.swap_blocks:
        return 0
    one = s.swap_bytes(o.swap_level)
    if o.swap_tier == "nvme":
        return swap_staging_bytes(one, o.swap_blocks, memory.IO_READAHEAD)
    return o.swap_blocks * one


def swap_staging_bytes(boundary: int, slots: int, depth: int) -> int:
    """Host RAM the NVMe swap of boundaries holds at most: ``depth`` in flight to disk
    in forward; in backward, the one being taken plus ``depth`` read ahead."""
    return min(slots, depth + 1) * boundary


def host_param_bytes(s: Sizes, o: Placement) -> int:
    """Host RAM of compute-dtype params: every off-device stage's (``params=host``), or
    the NVMe read-ahead window (``nvme``), and the host optimizer's refreshed ones in
    flight (:data:`PUBLISH_SLABS`)."""
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


def kept_published(s: Sizes, o: Placement) -> tuple[str, ...]:
    """With params on NVMe, the stages whose params the host optimizer publishes are
    kept in RAM from their update to their first read after the step's commit, instead
    of read back, where the host budget has room (:func:`plan_host`): the
    always-resident embed and head (read right after the commit) and the blocks the next
    forward's window takes first (the first ``1 + prefetch_depth`` off the device). The
    head is updated first in backward, its write lands long before the commit, and its
    read at the commit queued behind the last stages' write-back; the first blocks'
    reads, queued behind the same writes and the optimizer's reads for the next step,
    left the device idle at the next step's start (docs/results/2026-11-26.md)."""
    if o.params != "nvme":
        return ()
    stages = DeviceCache.of(s, o).host  # off the device, in forward order
    first = [n for n in stages if n not in ("embed", "head")][: 1 + o.prefetch_depth]
    return tuple(n for n in stages if n in ("embed", "head")) + tuple(first)


def param_reads_ahead(o: Placement) -> int:
    """Stages of params on NVMe read ahead of the use the window is at: its device copies
    (``prefetch_depth``) and the disk reads before them
    (:data:`~hetjax.memory.IO_READAHEAD`)."""
    return o.prefetch_depth + memory.IO_READAHEAD


def master_reads_kept(o: Placement, compute_bytes: int) -> int:
    """Params that are the master (:func:`~hetjax.memory.params_are_master`): the latest
    param reads kept for the host optimizer's read of the same stage's state, which copies the
    master from them instead of reading it (``storage/params.py``'s ``MasterPages``).
    The loop reads a block's state a few blocks after backward read its params, and
    further behind while the disk is slow: keeping only the reads ahead catches a third
    of the blocks, twice that all but one (docs/results/2026-11-25.md)."""
    return 2 * param_reads_ahead(o) if memory.params_are_master(o, compute_bytes) else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
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
    # params on NVMe: stages whose published params are kept in RAM to their first read
    # after the commit (:func:`kept_published`; none where the budget has no room), and
    # their bytes
    published_stages: tuple[str, ...] = ()
    published: int = 0

    @property
    def required(self) -> int:
        return sum(self.parts.values())

    @property
    def pinned(self) -> int:
        """Bytes of it in the device's ``pinned_host`` memory: what moves to and from
        the device (param slabs, gradient buffers, boundary and swapped activations).
        Optimizer state and its I/O live in the host optimizer's own (pageable) memory."""
        params = self.param_slabs + self.kept_params + self.published
        return params + self.gradients + self.boundaries + self.swapped

    def check_pinned(self, limit: int, margin: int = 0) -> None:
        """Raises ConfigError when the pinned part plus ``margin`` (XLA's own pinned
        allocations: ``xla_env.PINNED_MARGIN``) exceeds ``limit`` (XLA's cap on a GPU
        process's pinned host memory: ``xla_env.pinned_limit``)."""
        if self.pinned + margin > limit:
            raise ConfigError(
                f"the host plan needs {format_bytes(self.pinned)} of pinned host memory "
                f"(param slabs {format_bytes(self.param_slabs)}, gradient buffers "
                f"{format_bytes(self.gradients)}, boundary activations "
                f"{format_bytes(self.boundaries)}, swapped activations "
                f"{format_bytes(self.swapped)})"
                + (f", plus {format_bytes(margin)} for XLA's own," if margin else "")
                + f" and XLA allows {format_bytes(limit)}: "
                f"short by {format_bytes(self.pinned + margin - limit)}. Raise "
                "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (python -m hetjax.launch sets it from "
                "memory.host_budget), or set offload.params=nvme"
            )

    @property
    def parts(self) -> dict[str, int]:
        """Bytes by what they hold."""
        return {
            "params": self.param_slabs,
            "params kept for backward": self.kept_params,
            "params kept to their next read": self.published,
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
        if self.published:
            parts.append(
                f"params kept to their next read {format_bytes(self.published)} "
                f"({len(self.published_stages)} stages)"
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


def plan_host(s: Sizes, o: Placement, budget: int, strict: bool = True) -> HostMemoryPlan:
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
    state = 2 * s.state_nbytes(cache_of.host_own) if tier == "host" else 0
    biggest = s.state_nbytes(cache_of.host_biggest)
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
    # the published params kept to their next read: first, where the budget has room
    # (they save the head's read at the commit and the device's idle start of the next
    # step; a cached stage's state in the same RAM saves I/O the backward overlaps;
    # docs/results/2026-11-26.md)
    published_stages = kept_published(s, o)
    published = s.compute_bytes * sum(s.own(n) for n in published_stages)
    if budget and required + published > budget:
        published_stages, published = (), 0
    required += published
    cached: list[str] = []
    if tier == "nvme" and budget and required < budget:
        doubled = cache_of.host_state
        cached = belady_cache([n for n in order if n in doubled], doubled, budget - required)
    cache = sum(cache_of.host_state[n] for n in cached)
    kept_blocks = kept_param_blocks(s, o, budget - required - cache if budget else 0)
    kept = kept_blocks * s.compute_bytes * s.own_block
    return HostMemoryPlan(
        budget=budget,
        param_slabs=param_slabs,
        gradients=grads.ram_bytes,
        optimizer_state=state,
        optimizer_io=io,
        cache=cache,
        cached_stages=tuple(cached),
        grads=grads,
        boundaries=boundaries,
        swapped=swapped,
        kept_param_blocks=kept_blocks,
        kept_params=kept,
        published_stages=published_stages,
        published=published,
    )


def kept_param_blocks(s: Sizes, o: Placement, room: int) -> int:
    """With params on NVMe, how many blocks keep in RAM the params their forward read,
    for their backward: those blocks' params are read from disk once a step instead of
    twice. The blocks fetched again for backward are the ones neither kept on the
    device (``offload.keep_blocks``) nor device-cached; ``room`` (bytes of the host
    budget the optimizer state cache left) bounds them. No budget (``room`` 0) keeps
    none, as it caches no optimizer state: without one the plan does not know how much
    RAM there is. They come after the state cache: per byte of RAM a cached stage saves
    half a byte of state read and half a byte written (it holds its old and new state),
    a kept block a byte of params read, and writes are a disk's slower direction
    (docs/results/2026-11-25.md)."""
    if o.params != "nvme" or room <= 0:
        return 0
    fetched_again = max(0, s.num_layers - o.keep_blocks - DeviceCache.of(s, o).blocks)
    return min(fetched_again, room // (s.compute_bytes * s.own_block))


def host_minimum(s: Sizes, o: Placement) -> HostMemoryPlan:
    """The least host RAM ``o`` can run in: gradient buffers bounded to the stages in
    flight (what :func:`plan_host` chooses when RAM is short), no state cache."""
    return plan_host(s, o, budget=1, strict=False)


# -- NVMe -----------------------------------------------------------------------------------


def nvme_parts(s: Sizes, o: Placement, host: HostMemoryPlan) -> dict[str, int]:
    """NVMe bytes per process, by what they hold: ``o.copies`` copies of optimizer
    state and of params (two: the committed one and the one being written; one: written
    in place, ``nvme_copies.py``; none of params that are the master,
    :func:`~hetjax.memory.params_are_master`), every boundary activation not kept in a
    block, and the gradients the host plan spills."""
    own = DeviceCache.of(s, o).host_own
    slots = o.recomputed_blocks(s.num_layers)
    g = o.copies
    return {
        "optimizer": g * s.state_nbytes(own) if o.optimizer == "nvme" else 0,
        "params": (
            g * s.compute_bytes * own
            if o.params == "nvme" and not memory.params_are_master(o, s.compute_bytes)
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


def in_memory_parts(s: Sizes, remat: bool, params: int | None = None) -> dict[str, int]:
    """Device bytes of ``offload.mode=none`` (everything on the device: the params are
    the master, fp32 gradients), by what they hold: with ``remat`` the blocks keep their
    boundaries only, else each its residuals as a device holds them (``kept_held``).
    ``params``: the elements of the params a device holds (on a mesh its share,
    ``planning/in_memory.py``); default the whole state's slabs."""
    if params is None:
        params = s.embed + s.blocks_total + s.head
    L = s.num_layers
    acts = (L * s.boundary if remat else L * s.kept_held("all")) + s.working_set + s.context
    state = s.state_format
    return {
        "params": state.nbytes(params, [MASTER]),
        "gradients": 4 * params,
        "optimizer": state.nbytes(params, state.moments),
        "act": acts,
    }
