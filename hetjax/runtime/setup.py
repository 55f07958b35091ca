"""Building a streaming run: its sizes in the memory model's terms, its NVMe directory,
its stores and its initial state. Called once by :class:`StreamingRuntime`'s
constructor; nothing here runs during a step."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from hetjax import memory, memory_host
from hetjax.config import Config
from hetjax.hf import open_checkpoint
from hetjax.memory import DeviceCache, Sizes, grad_policy
from hetjax.memory_host import HostMemoryPlan, nvme_parts
from hetjax.optimizer import moments
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.placement import Placement
from hetjax.runtime.stages.measure import StageMemory
from hetjax.state_format import StateFormat
from hetjax.storage.gradients import GradientStore
from hetjax.storage.iopool import SlabPool
from hetjax.storage.nvme import check_nvme_path
from hetjax.storage.nvme_states import NvmeStateStore
from hetjax.storage.pages import SlabLayout
from hetjax.storage.params import (
    DeviceParamStore,
    HostParamStore,
    LeafViews,
    NvmeParamStore,
    SplitParamStore,
)
from hetjax.storage.scales import ScaledStateStore, has_scales
from hetjax.storage.states import MemoryStateStore, SplitStateStore
from hetjax.storage.stripes import Stripes, stripes_of
from hetjax.storage.swap import BoundarySwap, ResidualSwap
from hetjax.types import group_key, is_block, stage_layout

# The layout a stage's slab has: ``embed``, ``head`` or its group's (``block``, ...).
layout_name = stage_layout


def memory_sizes(
    config: Config,
    groups,
    layouts: dict[str, SlabLayout],
    state_layouts: dict[str, SlabLayout],
    stage_memory: StageMemory,
    state_format: StateFormat,
) -> Sizes:
    """The run's sizes as the memory model takes them (``hetjax/memory.py``); ``groups``
    the model's stage groups (``models.staged.StageGroup``), ``state_format`` the
    optimizer's (``SlabOptimizer.state_format``)."""
    largest = max(groups, key=lambda g: layouts[g.name].padded_size).name
    return Sizes(
        num_layers=config.model.num_blocks,
        embed=layouts["embed"].padded_size,
        block=layouts[largest].compute_size,  # expert parallelism: its device's experts
        head=layouts["head"].padded_size,
        own_embed=state_layouts["embed"].padded_size,
        own_block=state_layouts[largest].padded_size,
        own_head=state_layouts["head"].padded_size,
        compute_bytes=jnp.dtype(config.model.compute_dtype).itemsize,
        block_grad_bytes=memory.block_grad_dtype(config).itemsize,
        state_format=state_format,
        boundary=stage_memory.boundary,
        working_set=stage_memory.working_set,
        kept=stage_memory.kept,
        swapped=stage_memory.swapped,
        grad_policy=grad_policy(config),
        groups=(
            tuple(
                (
                    g.name,
                    g.num_layers,
                    layouts[g.name].padded_size,
                    state_layouts[g.name].padded_size,
                )
                for g in groups
            )
            if len(groups) > 1
            else ()
        ),  # fmt: skip
        context=stage_memory.context,
        page_elems=state_layouts["embed"].page_elems,
    )


def stage_pages(sizes: Sizes, offload: Placement, page_elems: int) -> dict[str, tuple[int, int]]:
    """Each off-device stage's page range in the NVMe arrays, back to back."""
    pages, first = {}, 0
    for name in DeviceCache.of(sizes, offload).host_stages(sizes):
        n = sizes.own(name) // page_elems
        pages[name], first = (first, n), first + n
    return pages


def nvme_directory(
    config: Config, sizes: Sizes, offload: Placement, host: HostMemoryPlan, workdir, subdir: str
) -> tuple[Path | None, bool, Stripes | None]:
    """Checks (and creates) the NVMe directory when anything lives on NVMe: its path
    (None when nothing does; drive 0's with several), whether it is a temporary one to
    remove at close, and the drives its pages stripe over (``memory.nvme_path`` naming
    several: each drive's directory checked for its share of the bytes)."""
    if not offload.uses_nvme:
        return None, False, None
    names = {
        "optimizer": "the optimizer state",
        "params": "the params",
        "boundaries": f"{offload.recomputed_blocks(sizes.num_layers)} boundary activations",
        "swapped activations": f"{offload.swap_blocks} swapped blocks' activations",
        "gradients": "spilled gradients",  # kept for a redo
    }
    needed = {names[k]: v for k, v in nvme_parts(sizes, offload, host).items()}
    drives = config.memory.nvme_paths
    temporary = not drives and workdir is None
    if drives:
        paths = [Path(d) for d in drives]
    elif workdir is not None:
        paths = [Path(workdir) / "nvme"]
    else:
        paths = [Path(tempfile.mkdtemp(prefix="hetjax-nvme-"))]
    stripes = stripes_of(paths, subdir)
    # a drive holds every n-th page of each array: 1/n of it, up to a page more of each
    # (a few arrays a part: 8 pages of slack); of a swap, every n-th row (a boundary or
    # a block's activations, each maybe many pages): drive 0 the most, ceil(rows / n)
    n, slack = stripes.count, 8 * config.memory.page_size
    share = {k: -(-v // n) + slack * (n > 1 and v > 0) for k, v in needed.items()}
    rows = {
        names["boundaries"]: offload.recomputed_blocks(sizes.num_layers),
        names["swapped activations"]: offload.swap_blocks,
    }
    for k, r in rows.items():
        if needed.get(k) and r:
            share[k] = stripes.rows_share(needed[k], r)
    for path in (stripes.root, *stripes.others):
        check_nvme_path(path, share)
    return stripes.root, temporary, stripes


def make_stores(
    config: Config,
    nvme_dir: Path | None,
    pages: dict[str, tuple[int, int]],
    page_elems: int,
    state_format: StateFormat,
    host: HostMemoryPlan,
    shardings,
    device_stages: tuple[str, ...],
    views: LeafViews | None = None,
    slabs: SlabPool | None = None,
    stripes: Stripes | None = None,
):
    """The state store and the param store of the offload tiers: NVMe arrays, host RAM
    or device memory, with the device-cached stages routed to device stores. ``views``:
    the param stores hand stages out as leaf buffers (one device), else as pages;
    ``stripes``: the drives the NVMe arrays' pages stripe over."""
    off = config.offload
    opt_sharding = shardings.state_on_device if off.optimizer == "device" else shardings.optimizer
    dtype = jnp.dtype(config.model.compute_dtype)
    offload = Placement.from_config(config)
    if off.optimizer == "nvme" and pages:
        # int8 moments: their scales in page files of their own (``storage/scales.py``)
        store = NvmeStateStore
        if has_scales(state_format):
            store = functools.partial(ScaledStateStore, blocks=moments.Int8Blocks)
        states = store(
            nvme_dir / "optimizer",
            state_format,
            pages,
            page_elems,
            cached=list(host.cached_stages),
            sharding=shardings.optimizer,
            io_slots=memory.IO_SLOTS,
            master_reads_kept=memory_host.master_reads_kept(offload, dtype.itemsize),
            copies=offload.copies,
            stripes=stripes,
        )
    else:
        states = MemoryStateStore(opt_sharding, on_device=off.optimizer == "device")
    if off.params == "nvme" and pages:
        master = memory.params_are_master(offload, dtype.itemsize)
        params = NvmeParamStore(
            nvme_dir / "params",
            dtype,
            pages,
            page_elems,
            stage_to=shardings.pinned_staging(),
            views=views,
            slabs=slabs,
            master_of=states if master else None,
            keep_published=host.published_stages,
            copies=offload.copies,
            stripes=stripes,
        )
    else:
        params = HostParamStore(shardings.host, views)
    if device_stages:
        device_states = MemoryStateStore(shardings.state_on_device, on_device=True)
        states = SplitStateStore(device_states, states, device_stages)
        device_params = DeviceParamStore(shardings.device, views)
        params = SplitParamStore(device_params, params, device_stages)
    return states, params


def make_grad_store(
    config: Config,
    host: HostMemoryPlan,
    sizes: Sizes,
    page_elems: int,
    nvme_dir: Path | None,
    stripes: Stripes | None = None,
) -> GradientStore:
    """Where gradients wait for a possible clipping redo (``storage/gradients.py``):
    the stages the host plan spills go to ``<nvme>/gradients``, one array per dtype."""
    grad_dtype = lambda n: memory.block_grad_dtype(config) if is_block(n) else jnp.float32
    spilled = {n: (sizes.own(n) // page_elems, grad_dtype(n)) for n in host.grads.spilled}
    path = nvme_dir / "gradients" if spilled else None
    # the sync loop may redo the updates, or updates after backward only
    redo = memory.grad_policy(config) == "keep" or config.optimizer.grad_clip > 0
    return GradientStore(redo, spilled, path, page_elems, stripes)


def make_boundary_swap(
    config: Config,
    nvme_dir: Path | None,
    boundary: jax.ShapeDtypeStruct,
    parallel,
    stripes: Stripes | None = None,
) -> BoundarySwap | None:
    """The NVMe swap of boundary activations (``offload.activations=nvme``): of this
    process's rows (``placement.local_share`` of the batch), striped over the drives."""
    slots = Placement.from_config(config).recomputed_blocks(config.model.num_blocks)
    if config.offload.activations != "nvme" or not slots:
        return None
    itemsize = jnp.dtype(boundary.dtype).itemsize
    rows = boundary.shape[0] * parallel.local_share
    return BoundarySwap(
        nvme_dir / "activations",
        slots,
        (int(rows), *boundary.shape[1:]),
        boundary.dtype,
        chunk_elems=config.memory.page_size // itemsize,
        depth=memory.IO_READAHEAD,
        stage_to=parallel.swap_staging(),
        stripes=stripes,
    )


def progress(stages: list[str], what: str):
    """A progress bar over stages for the long start-up phases (NVMe initialisation,
    restore), on a terminal only (tqdm's ``disable=None``); gone when done."""
    from tqdm import tqdm  # start-up cost: tqdm is needed only here

    return tqdm(stages, desc=what, unit="stage", disable=None, leave=False, dynamic_ncols=True)


def describe_plans(
    placement_lines,
    device_plan,
    host_plan,
    device_stages,
    nvme_dir,
    offload,
    copies=None,
    copy_bytes: int = 0,
) -> list[str]:
    """The start-up plans, for the log (``copies``: the NVMe tier's,
    ``nvme_copies.py``, ``copy_bytes`` one copy of its state and params)."""
    lines = [*placement_lines, device_plan.describe(), host_plan.describe()]
    if device_stages:
        n = len(device_stages)
        lines.append(
            f"optimizer state of {n} stage{'s' * (n > 1)} on the device, updated "
            f"there ({', '.join(device_stages)}; offload.optimizer_device_stages)"
        )
    if nvme_dir is not None:
        lines.append(
            f"nvme: {nvme_dir} (offload.optimizer={offload.optimizer}, "
            f"offload.params={offload.params}, offload.activations={offload.activations})"
        )
        if copies is not None and "nvme" in (offload.optimizer, offload.params):
            lines.append(copies.describe(copy_bytes))
    return lines


def init_state(
    config: Config,
    model,
    layouts: dict[str, SlabLayout],
    stage_names: list[str],
    optimizer_of,
    own_slab,
    states,
    params,
    sharding,
) -> None:
    """Initialises each stage straight into the optimizer's memory as an fp32 slab; the
    same keys as ``model.init``, so the params equal the in-memory runtime's. With
    ``model.init_from`` each stage is read from the checkpoint instead (``hetjax/hf.py``).
    Stages go to their tier one at a time (a model need not fit in RAM at once).
    ``optimizer_of(stage)``: the stage's SlabOptimizer; ``own_slab(layout, slab)``: the
    part of a whole slab this process holds."""
    checkpoint = open_checkpoint(config.model)  # None: random init
    keys = model.stage_keys(jax.random.key(config.train.seed))
    inits = {}  # one jitted init per layout: a block compiles once, not once per block
    for name in progress(stage_names, f"initialising state ({config.offload.optimizer})"):
        kind = layout_name(name)
        layout = layouts[kind]
        key = keys[group_key(kind)][int(name[len(kind) :])] if is_block(name) else keys[kind]
        if checkpoint is None:
            if kind not in inits:
                inits[kind] = jax.jit(
                    lambda k, kind=kind, layout=layout: layout.flatten(model.init_stage(kind, k)),
                    out_shardings=sharding,
                )
            master = inits[kind](key)
        else:  # only this stage's tensors are read, flattened on the host
            slab = layout.flatten_np(checkpoint.stage(name))
            master = jax.device_put(slab, sharding)
            del slab
        master = own_slab(layout, master)
        opt: SlabOptimizer = optimizer_of(name)
        slabs, scalars = opt.init(kind, master)
        states.init_stage(name, slabs, scalars)
        params.publish(name, opt.compute_pages(kind, master))
        del master, slabs
    states.wait_init()
    params.commit()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stores:
    """Where a streaming run's state lives (``build_stores``)."""

    nvme_dir: Path | None
    temporary: bool  # the NVMe directory is a temporary one, removed at close
    states: Any  # StateStore
    params: Any  # ParamStore, as the parallelism hands stages out
    grads: GradientStore
    swap: BoundarySwap | None
    residual_swap: ResidualSwap | None = None  # swapped activations on NVMe
    # the host slabs of compute-dtype params, shared by the NVMe param reads and the host
    # optimizer's refreshed params (``SlabOptimizer.param_buffers``)
    param_buffers: SlabPool | None = None


def build_stores(
    config: Config,
    sizes: Sizes,
    offload: Placement,
    host: HostMemoryPlan,
    layouts: dict[str, SlabLayout],
    parallel,
    device_stages: tuple[str, ...],
    boundary: jax.ShapeDtypeStruct,
    workdir,
) -> Stores:
    """The NVMe directory (checked against what the memory model puts there) and every
    store of the run's tiers (the optimizer state in ``sizes.state_format``)."""
    nvme_dir, temporary, stripes = nvme_directory(
        config, sizes, offload, host, workdir, parallel.nvme_subdir
    )
    page_elems = layouts["embed"].page_elems  # every stage's
    pages = stage_pages(sizes, offload, page_elems)
    # the placement's layouts say how the device takes a stage: leaf by leaf, or pages
    views = LeafViews(layouts) if layouts["embed"].leaf_buffers else None
    slabs = SlabPool(host.param_slabs + host.kept_params + host.published)  # as planned
    states, params = make_stores(
        config, nvme_dir, pages, page_elems, sizes.state_format, host, parallel.shardings,
        device_stages,
        views, slabs, stripes,
    )  # fmt: skip
    # the NVMe store under the device cache's split (``make_stores``), where params are there
    base = params.base if isinstance(params, SplitParamStore) else params
    nvme_params = base if config.offload.params == "nvme" else None
    return Stores(
        nvme_dir=nvme_dir,
        temporary=temporary,
        states=states,
        params=parallel.param_store(params, nvme_params, layouts, device_stages),
        grads=make_grad_store(config, host, sizes, page_elems, nvme_dir, stripes),
        swap=make_boundary_swap(config, nvme_dir, boundary, parallel, stripes),
        residual_swap=make_residual_swap(config, sizes, offload, nvme_dir, parallel, stripes),
        param_buffers=slabs,
    )


def make_residual_swap(
    config: Config,
    sizes: Sizes,
    offload: Placement,
    nvme_dir: Path | None,
    parallel,
    stripes: Stripes | None = None,
) -> ResidualSwap | None:
    """The NVMe swap of the swapped blocks' activations (``offload.swap_tier=nvme``):
    this process's shards of them (``placement.local_share``), striped over the drives."""
    if not offload.swap_blocks or offload.swap_tier != "nvme":
        return None
    return ResidualSwap(
        nvme_dir / "swapped",
        offload.swap_blocks,
        int(sizes.swap_bytes(offload.swap_level) * parallel.local_share),
        chunk_bytes=config.memory.page_size,
        depth=memory.IO_READAHEAD,
        stage_to=parallel.swap_staging(),
        stripes=stripes,
    )
