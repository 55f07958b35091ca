"""A streaming run's parts (:class:`Parts`), built in order by :func:`assemble`: the model
and its stage functions, the memory plans, the stores and the initial state
(``setup.py``), the update loop, the routed blocks' experts, and the per-layer loop's
schedule and block strategies. :class:`~hetjax.runtime.streaming.StreamingRuntime`
receives them finished; nothing here runs during a step."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from hetjax import memory
from hetjax.allocator import tune_host_allocator
from hetjax.config import Config, ConfigError
from hetjax.memory import DeviceCache, Sizes, plan_device, window_wait_lag
from hetjax.memory_host import HostMemoryPlan, plan_host
from hetjax.optimizer.deferred import Deferred, deferred_updates
from hetjax.optimizer.sharded_slab import ShardedSlabOptimizer
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.optimizer.update_loop import LoopSettings, UpdateLoop
from hetjax.parallel.grouped import GroupedSlabLayout
from hetjax.placement import Placement
from hetjax.runtime.experts.routed import (
    DeferredExperts,
    ExpertFetcher,
    ExpertFetchers,
    check_routed_experts,
    routed_blocks,
)
from hetjax.runtime.experts.routed_zero import GroupedExpertFetcher, ShardedExpertFetcher
from hetjax.runtime.loop.blocks import BlockParts, GroupInput, make_blocks
from hetjax.runtime.loop.boundaries import Boundaries, SwappedResiduals
from hetjax.runtime.loop.grads import DeviceGradients
from hetjax.runtime.loop.ledger import IoMeter, Ledger
from hetjax.runtime.loop.schedule import Schedule
from hetjax.runtime.setup import build_stores, init_state, layout_name, memory_sizes
from hetjax.runtime.stages.functions import StageFunctions
from hetjax.runtime.stages.measure import StageMemory
from hetjax.storage.gradients import GradientStore
from hetjax.storage.pages import SlabLayout
from hetjax.storage.swap import BoundarySwap, ResidualSwap
from hetjax.support import model_kinds_of, model_refusal, parallelism, supports
from hetjax.xla_env import PINNED_MARGIN, pinned_limit
from models import build_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
    """A streaming run's parts, built in order by :func:`assemble` and handed finished
    to :class:`~hetjax.runtime.streaming.StreamingRuntime` (its attributes of the same
    names)."""

    config: Config
    parallel: Any  # how devices split the run (types.Parallelism: parallel/single.py, zero.py)
    model: Any  # the model (models/), as stored
    compute_dtype: Any
    num_layers: int  # every group's blocks
    layouts: dict[str, SlabLayout]  # each layout's slab as the device computes with it
    state_layouts: dict[str, SlabLayout]  # ... as this process holds its state
    block_names: list[str]  # every group's blocks, in forward order
    stage_group: dict[str, int]  # a block's stage group
    stage_names: list[str]  # embed, the blocks, head
    update_order: list[str]  # backward order: head, the blocks reversed, embed
    device_stages: tuple[str, ...]  # the device cache of optimizer state
    host_stages: list[str]
    optimizer: SlabOptimizer
    device_optimizer: SlabOptimizer | None  # the device cache's
    fns: StageFunctions
    boundary: jax.ShapeDtypeStruct  # one block-boundary activation (B, T, D)
    sizes: Sizes  # the memory model's sizes, measured ones included
    offload: Placement
    host_plan: HostMemoryPlan
    plan: Any  # the device plan (memory.DevicePlan)
    device_grad_stages: frozenset[str]  # stages whose gradient stays on the device
    nvme_dir: Path | None
    temporary_nvme: bool
    states: Any  # StateStore
    param_store: Any  # ParamStore
    grad_store: GradientStore
    swap: BoundarySwap | None
    residual_swap: ResidualSwap | None  # offload.swap_tier=nvme
    residuals: SwappedResiduals
    loop: UpdateLoop
    device_grads: DeviceGradients | None
    routed: frozenset[str]  # the blocks streamed expert-aware (routed.py)
    experts: ExpertFetchers | None  # their groups' fetchers, by group index
    deferred: DeferredExperts
    ledger: Ledger
    boundaries: Boundaries
    io: IoMeter  # NVMe I/O per step
    schedule: Schedule
    blocks: tuple  # each block's strategy (blocks.py), forward order
    inputs: tuple[GroupInput, ...]  # each stage group's input


def assemble(config: Config, parallel, workdir=None) -> Parts:
    """Builds a streaming run's parts in order: the model and its stage functions, the
    memory plans (host first: it needs sizes only; the device plan once the stage
    functions are measured), the stores and the initial state, the update loop, the
    routed blocks' experts, and the per-layer loop's schedule and block strategies."""
    tune_host_allocator(config.memory.host_budget)
    t, off, mem = config.train, config.offload, config.memory
    model = build_model(config.model)
    dtype = jnp.dtype(config.model.compute_dtype)
    layouts = parallel.stage_layouts(model, mem.page_size)
    state_layouts = parallel.state_layouts(layouts)  # what this process holds
    names = _names(model, off.optimizer_device_stages)
    check_routed_experts(
        off, model, layouts, names["block_names"], parallelism=parallelism(config.distributed)
    )
    optimizer, device_optimizer = _optimizers(config, parallel, state_layouts, dtype, names)
    compute_model = build_model(config.model, parallel.expert_axis)
    fns = _stage_functions(config, parallel, compute_model, layouts, dtype)
    batch = (t.micro_batch_size, t.seq_len, dtype)
    boundary = fns.abstract_args(*batch)["block_fwd"][1]
    sizes = _host_sizes(config, fns, model.groups, layouts, state_layouts, boundary, optimizer)
    offload = Placement.from_config(config)
    host_plan = plan_host(sizes, offload, mem.host_budget)
    if jax.default_backend() == "gpu":  # XLA caps pinned host memory there
        host_plan.check_pinned(pinned_limit(), margin=PINNED_MARGIN)
    # Stages whose gradient stays on the device (memory.DeviceCache): asked per stage
    # in the per-layer loop, so decided once here.
    to_host = DeviceCache.of(sizes, offload).grad_stages(sizes)
    device_stages = names["device_stages"]
    stores = build_stores(
        config, sizes, offload, host_plan, layouts, parallel, device_stages, boundary, workdir,
    )  # fmt: skip
    optimizer.param_buffers = stores.param_buffers
    optimizer_of = lambda s: device_optimizer if s in device_stages else optimizer
    init_state(
        config, model, layouts, names["stage_names"], optimizer_of, parallel.own_slab,
        stores.states, stores.params, parallel.shardings.optimizer,
    )  # fmt: skip
    loop = _update_loop(config, optimizer, device_optimizer, stores, host_plan, names)
    sizes = _measured_sizes(sizes, fns, off, batch)
    # an accelerator's dispatch order (or its two-client emulation's): the same test
    # as where pages are staged in pinned memory
    accelerator = parallel.shardings.pinned_staging() is not None
    # per device: the devices a micro-batch's rows split over hold 1/N of its activations
    per_device = sizes.per_device(
        parallel.batch_degree, shards=parallel.degree, holders=parallel.local_degree
    )
    plan = plan_device(per_device, offload, mem.device_budget, lag=window_wait_lag(accelerator))
    # expert-aware streaming (routed.py): the MoE blocks that stream and recompute
    routed = routed_blocks(
        off, compute_model, layouts, names["block_names"], plan.resident_blocks, device_stages,
        parallelism=parallelism(config.distributed),
    )  # fmt: skip
    experts, deferred = _experts(config, parallel, fns, dtype, routed, loop)
    shared = _block_parts(config, parallel, stores, experts, deferred)
    boundaries, residuals, ledger = shared.boundaries, shared.residuals, shared.ledger
    shardings = parallel.shardings
    schedule, blocks = _per_layer(off, names, routed, fns, shared)
    io = IoMeter([stores.states, stores.params, stores.grads, stores.swap, stores.residual_swap])
    return Parts(
        config=config, parallel=parallel, model=model, compute_dtype=dtype,
        num_layers=config.model.num_blocks, layouts=layouts, state_layouts=state_layouts,
        block_names=names["block_names"], stage_group=names["stage_group"],
        stage_names=names["stage_names"], update_order=names["update_order"],
        device_stages=device_stages, host_stages=names["host_stages"], optimizer=optimizer,
        device_optimizer=device_optimizer, fns=fns, boundary=boundary, sizes=sizes,
        offload=offload, host_plan=host_plan, plan=plan,
        device_grad_stages=frozenset(device_stages) - set(to_host), nvme_dir=stores.nvme_dir,
        temporary_nvme=stores.temporary, states=stores.states, param_store=stores.params,
        grad_store=stores.grads, swap=stores.swap, residual_swap=stores.residual_swap,
        residuals=residuals, loop=loop,
        device_grads=DeviceGradients(shardings.state_on_device) if device_stages else None,
        routed=routed, experts=experts, deferred=deferred, ledger=ledger,
        boundaries=boundaries, io=io, schedule=schedule,
        blocks=blocks,
        inputs=tuple(GroupInput(group) for group in fns.groups),
    )  # fmt: skip


def _measured_sizes(sizes, fns: StageFunctions, offload, batch: tuple):
    """``sizes`` with the stage functions' measured working set, kept and context bytes
    and, on a mesh, the kept and swapped blocks' residuals as XLA lays them out."""
    measured = fns.memory_sizes(*batch)
    sizes = dataclasses.replace(
        sizes, working_set=measured.working_set, kept=measured.kept, context=measured.context
    )
    if not fns.on_mesh:
        return sizes
    held = lambda kind, level: {level: fns.held_bytes(kind, level, *batch)}
    return dataclasses.replace(
        sizes,
        held_kept=held("kept", offload.keep_level) if offload.keep_blocks else {},
        held_swapped=held("swapped", offload.swap_level) if offload.swap_blocks else {},
    )


def _per_layer(offload, names, routed, fns: StageFunctions, shared: BlockParts) -> tuple:
    """The per-layer loop's schedule (``schedule.py``) and each block's strategy
    (``blocks.py``), by its kind there."""
    schedule = Schedule.of(
        names["block_names"], names["group_of"], keep_blocks=offload.keep_blocks,
        swap_blocks=offload.swap_blocks, routed=routed,
    )  # fmt: skip
    return schedule, make_blocks(schedule, fns.groups, shared)


def _names(model, device_cached: int) -> dict[str, Any]:
    """The run's stage names: the blocks in forward order over every group, each
    block's group, embed + blocks + head, the update (backward) order, and the stages
    of the device cache of optimizer state: the first ones in forward order, the last
    ones backward reaches (config.OffloadConfig says why those)."""
    groups = model.groups
    block_names = [g.stage(i) for g in groups for i in range(g.num_layers)]
    group_of = [g for g, group in enumerate(groups) for _ in range(group.num_layers)]
    stage_names = ["embed", *block_names, "head"]
    device_stages = tuple(stage_names[:device_cached])
    return {
        "block_names": block_names,
        "group_of": group_of,
        "stage_group": dict(zip(block_names, group_of, strict=True)),
        "stage_names": stage_names,
        "update_order": ["head", *reversed(block_names), "embed"],
        "device_stages": device_stages,
        "host_stages": [n for n in stage_names if n not in device_stages],
    }


def _optimizers(config: Config, parallel, state_layouts, dtype, names) -> tuple:
    """The host optimizer (or the device one, ``offload.optimizer=device``) and the
    device cache's (None without one)."""
    shardings = parallel.shardings

    def opt(sharding) -> SlabOptimizer:
        # several devices (ZeRO-3): each device's pages held and updated on it
        cls = SlabOptimizer if len(sharding.device_set) == 1 else ShardedSlabOptimizer
        return cls(config.optimizer, config.train.steps, state_layouts, sharding, dtype)

    on_device = config.offload.optimizer == "device"
    optimizer = opt(shardings.state_on_device if on_device else shardings.optimizer)
    return optimizer, opt(shardings.state_on_device) if names["device_stages"] else None


def _stage_functions(config: Config, parallel, compute_model, layouts, dtype) -> StageFunctions:
    """The jitted stage functions, of the model the stage functions run (with expert
    parallelism: blocks holding their device's experts, exchanging tokens over the
    placement's expert axis); checks the keep level and the swapped blocks' support."""
    t, off = config.train, config.offload
    fns = StageFunctions(
        compute_model,
        layouts,
        parallel,
        block_grad_dtype=memory.block_grad_dtype(config),
        keep_level=off.keep_level,
        kept_blocks=supports("keep_blocks", parallelism(config.distributed)) is None,
        batch_chunks=off.batch_chunks,
    )
    fns.check_keep_level(off, t.micro_batch_size, t.seq_len, dtype)
    kinds = model_kinds_of(compute_model)  # (a custom model's: the config cannot know)
    if off.swap_blocks and (why := model_refusal("swap_blocks", kinds, off.swap_blocks)):
        raise ConfigError(why)
    return fns


def _host_sizes(config, fns, groups, layouts, state_layouts, boundary, optimizer) -> Sizes:
    """The sizes the host plan and the disk check need: slabs and boundaries (and the
    swapped blocks' activations, which live in host RAM: from abstract shapes). What the
    device plan needs besides (XLA's working set, the kept blocks' residuals: compiling
    and tracing the stage functions) is measured once those checks passed."""
    t, off = config.train, config.offload
    kept, swapped = {}, {}
    if off.swap_blocks:
        batch = (t.micro_batch_size, t.seq_len, jnp.dtype(config.model.compute_dtype))
        kept, swapped = fns.kept_bytes(*batch), fns.swap_bytes(*batch)
    stage_memory = StageMemory(
        math.prod(boundary.shape) * boundary.dtype.itemsize, 0, kept, swapped=swapped
    )
    state_format = optimizer.state_format  # the state kinds' dtypes
    return memory_sizes(config, groups, layouts, state_layouts, stage_memory, state_format)


def _block_parts(config: Config, parallel, stores, experts, deferred) -> BlockParts:
    """What every block strategy shares: the boundaries, the swapped residuals, the
    ledger, the routed experts and their deferred updates."""
    ledger = Ledger()
    boundaries = Boundaries(
        config.offload.activations, config.model.num_blocks, stores.swap,
        parallel.put_batch, ledger,
    )  # fmt: skip
    return BlockParts(
        boundaries=boundaries,
        residuals=SwappedResiduals(stores.residual_swap),
        ledger=ledger,
        swap_level=config.offload.swap_level,
        put_batch=parallel.put_batch,
        experts=experts,
        deferred=deferred,
    )


def _update_loop(config: Config, optimizer, device_optimizer, stores, host_plan, names):
    """The host optimizer loop (``optimizer/update_loop.py``), updating stages in
    backward order as their gradients come."""
    settings = LoopSettings.of(
        config.optimizer, readahead=memory.IO_READAHEAD, max_queued=host_plan.grads.max_queued
    )
    return UpdateLoop(
        optimizer,
        stores.states,
        stores.params,
        order=names["update_order"],
        layout_of=layout_name,
        settings=settings,
        grads=stores.grads,
        device_optimizer=device_optimizer,
        device_stages=names["device_stages"],
    )


def _experts(config: Config, parallel, fns, dtype, routed, loop) -> tuple:
    """The routed blocks' expert fetchers by group (None without routed blocks) and
    the deferred expert updates (``optimizer/deferred.py``), told to the loop."""
    experts = None
    if routed:
        E, device = config.model.num_experts, parallel.shardings.device
        stage_to = parallel.shardings.pinned_staging()

        def fetcher(group):  # the device takes a block's leaves (one device) or its pages
            if group.layout.leaf_buffers:
                return ExpertFetcher(group.routed(), dtype, device, E, stage_to=stage_to)
            if isinstance(group.layout, GroupedSlabLayout):  # by expert group (and slice)
                return GroupedExpertFetcher(group.routed(), parallel, dtype, E)
            return ShardedExpertFetcher(group.routed(), parallel, dtype, E)

        experts = ExpertFetchers({g: fetcher(group) for g, group in enumerate(fns.groups)})
    deferring = bool(routed) and deferred_updates(config)
    if deferring:
        loop.use_deferred(Deferred(routed))
    return experts, DeferredExperts(loop if deferring else None)
