"""The layer-wise streaming executor (``offload.mode=stream``).

Params live on the host as one page slab per stage (``pages.py``), in the compute dtype,
in the ``pinned_host`` memory kind, and move as that slab's list of pages; fp32 master
state and the optimizer live with the host optimizer. A step streams the stages through
a window of device memory:

    forward   embed, block 0 .. block L-1, head + loss (and the head's backward)
    backward  block L-1 .. block 0 (each recomputes its inside with jax.vjp), embed

The access order is known, so a Python loop copies the next ``offload.prefetch_depth``
slabs in while the current stage computes (JAX's async dispatch overlaps them), drops
each slab after its last use in the window, keeps block-boundary activations on the
device, on the host, or swaps them through the host to NVMe (``offload.activations``,
``activations.py``), and sends each stage's gradient slab to the host as soon as its
backward is dispatched. The host optimizer loop (``update_loop.py``) updates each stage
as soon as its final gradient is on the host, while backward goes on, and refreshes the
param slabs for the next step; optimizer state and params live in the tiers
``offload.optimizer`` and ``offload.params`` name (``state_store.py``).

With ``offload.optimizer_device_stages = N`` (host or NVMe optimizer) the first N
stages in forward order (embed, block 0, ...) are a device cache of optimizer state
(Angel-PTM): their state and params live on the device, those blocks are resident,
their gradient is summed, averaged and normed on the device, and their update is
dispatched there as soon as backward produces the final gradient
(``UpdateLoop.submit_device``); nothing of theirs crosses to the host (in lock-free
mode their gradients do, into the loop's accumulator; only the update stays).

``memory.device_budget`` bounds what the executor holds on the device; the plan is made
at start-up (:func:`plan_device_memory`) and the ledger records what it really held.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import remat, timeline
from hetjax.activations import NvmeCheckpoints, staging_bytes
from hetjax.checkpoint import MASTER, RuntimeState
from hetjax.config import Config, ConfigError, format_bytes
from hetjax.gradients import GradientStore
from hetjax.hardware import tune_host_allocator
from hetjax.host_optimizer import SlabOptimizer
from hetjax.nvme import check_nvme_path
from hetjax.pages import SlabLayout, aligned_concatenate
from hetjax.placement import Placement
from hetjax.state_store import (
    DeviceParamStore,
    HostMemoryPlan,
    HostParamStore,
    MemoryStateStore,
    NvmeParamStore,
    NvmeStateStore,
    SplitParamStore,
    SplitStateStore,
    flat,
    plan_host_memory,
)
from hetjax.train import LossScale, StepStats
from hetjax.update_loop import UpdateLoop
from models import build_model

F32 = jnp.float32
IO_READAHEAD = 2  # stages (state, params) or checkpoints read from NVMe ahead of their use


@dataclasses.dataclass(frozen=True)
class DeviceMemoryPlan:
    """What the executor will hold on the device, in bytes, and the window it chose."""

    budget: int  # 0: no limit
    prefetch_depth: int
    resident_blocks: int  # blocks 0 .. r-1 stay on the device across steps
    embed_head: int  # embed + head slabs (always resident)
    block_slab: int
    checkpoints: int
    gradients: int  # gradient slabs in flight to the host
    kept: int  # in-block activations of the kept blocks (offload.keep_blocks)
    working_set: int  # XLA temporaries of the largest stage function, plus x / dx
    required: int  # the total with this window
    # optimizer state on the device (offload.optimizer=device, or the device-cached
    # stages' with their gradients and refreshed params: executor.device_optimizer_bytes)
    optimizer: int = 0

    def describe(self) -> str:
        return (
            f"device plan: prefetch depth {self.prefetch_depth}, {self.resident_blocks} "
            f"resident blocks; embed+head {format_bytes(self.embed_head)}, block slab "
            f"{format_bytes(self.block_slab)}, checkpoints {format_bytes(self.checkpoints)}, "
            f"gradients {format_bytes(self.gradients)}, kept activations "
            f"{format_bytes(self.kept)}, working set "
            f"{format_bytes(self.working_set)}"
            + (f", optimizer {format_bytes(self.optimizer)}" if self.optimizer else "")
            + f"; total {format_bytes(self.required)}"
            + (f" of budget {format_bytes(self.budget)}" if self.budget else " (no budget)")
        )


def plan_device_memory(
    budget: int,
    num_layers: int,
    requested_depth: int,
    embed_head: int,
    block_slab: int,
    grad_slab: int,
    checkpoints: int,
    working_set: int,
    kept: int = 0,
    optimizer: int = 0,
    min_resident: int = 0,
) -> DeviceMemoryPlan:
    """Chooses the deepest prefetch window (up to ``requested_depth``) that fits the
    budget, then keeps as many blocks resident as the rest allows, at least
    ``min_resident`` (the blocks whose optimizer state is on the device: ``optimizer``
    bytes). Raises ``ConfigError`` with the numbers when not even one stage and its
    activations fit."""
    gradients = 2 * grad_slab  # one being produced, one in transfer to the host
    fixed = embed_head + checkpoints + gradients + working_set + kept + optimizer

    def total(depth: int, resident: int) -> int:
        window = min(depth + 1, num_layers - resident)
        return fixed + (window + resident) * block_slab

    if budget and total(0, min_resident) > budget:
        need = total(0, min_resident)
        raise ConfigError(
            f"memory.device_budget {format_bytes(budget)} cannot hold one stage plus its "
            f"activations in device memory: that needs {format_bytes(need)} (embed+head "
            f"{format_bytes(embed_head)}, one block slab {format_bytes(block_slab)}, "
            f"activation checkpoints {format_bytes(checkpoints)}, gradient slabs "
            f"{format_bytes(gradients)}, working set {format_bytes(working_set)}"
            + (f", kept activations {format_bytes(kept)}" if kept else "")
            + (f", optimizer state {format_bytes(optimizer)}" if optimizer else "")
            + (f" and its {min_resident} resident blocks" if min_resident else "")
            + "); short by "
            f"{format_bytes(need - budget)}. Raise memory.device_budget, "
            + ("lower offload.keep_blocks, " if kept else "")
            + ("lower offload.optimizer_device_stages, " if min_resident or optimizer else "")
            + "set offload.activations=host, or lower train.batch_size / raise "
            "train.grad_accum"
        )
    depth = requested_depth
    while budget and depth > 0 and total(depth, min_resident) > budget:
        depth -= 1
    resident = min_resident
    if budget:
        while resident < num_layers and total(depth, resident + 1) <= budget:
            resident += 1
    return DeviceMemoryPlan(
        budget,
        depth,
        resident,
        embed_head,
        block_slab,
        checkpoints,
        gradients,
        kept,
        working_set,
        total(depth, resident),
        optimizer,
    )


def device_bytes(a: jax.Array) -> int:
    """Bytes of ``a`` on each device holding it: the whole array on one device or
    replicated, 1/N of it sharded over N devices."""
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def stage_layouts(model, page_size: int, page_multiple: int = 1) -> dict[str, SlabLayout]:
    """The slab layouts of a model's stages (``embed``, one ``block``, ``head``), from
    abstract shapes: nothing is allocated. Slabs pad to a multiple of ``page_multiple``
    pages (ZeRO-3: one equal share per device)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    one_block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"])
    return {
        "embed": SlabLayout.from_params(shapes["embed"], page_size, page_multiple),
        "block": SlabLayout.from_params(one_block, page_size, page_multiple),
        "head": SlabLayout.from_params(shapes["head"], page_size, page_multiple),
    }


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Device bytes of one micro-batch's stage functions, as XLA compiles them."""

    checkpoint: int  # one block-boundary activation (B, T, D)
    working_set: int  # temporaries of the largest stage function, plus x / dx
    # one block's in-block activations kept from forward to backward (its vjp residuals,
    # inputs included), per offload.keep_level the block supports (remat.py)
    kept: dict[str, int]


class StageFunctions:
    """The jitted per-stage functions the executor runs (and the tracer times). Each takes
    its stage's params as a list of pages and unflattens them inside the jit.

    ``block_bwd`` recomputes the block's inside from its input checkpoint, then runs its
    vjp. ``block_fwd_keep`` instead returns the vjp (its residuals: the in-block
    activations ``keep_level`` keeps, ``remat.py``) with the output, and
    ``block_bwd_kept`` applies it, recomputing only what the level did not keep, for the
    cost of holding the residuals on the device until backward (``offload.keep_blocks``).
    ``kept_forward(level)`` is ``block_fwd_keep`` at any level (the tracer times each).

    ``jit`` compiles a stage function (one device: ``jax.jit`` onto it; ZeRO-3: per
    device with collectives) and ``grad_slab(pages, dtype)`` shapes a gradient as it
    leaves the device; block gradients leave in ``block_grad_dtype``.
    """

    def __init__(
        self,
        model,
        layouts: dict[str, SlabLayout],
        jit,
        grad_slab,
        block_grad_dtype=F32,
        keep_level: str = "all",
    ):
        E, B, H = layouts["embed"], layouts["block"], layouts["head"]
        cast = lambda pages: grad_slab(pages, block_grad_dtype)
        self.layouts = layouts
        m = model

        def embed_fwd(e, tokens):  # (B, T) -> (B, T, D)
            return m.embed(E.unflatten_pages(e), tokens)

        def block_fwd(b, x):  # (B, T, D) -> (B, T, D)
            return m.block(B.unflatten_pages(b), x)

        def head_loss(h, e, x, targets):
            return m.head_loss(H.unflatten_pages(h), E.unflatten_pages(e), x, targets)

        def head_fwd_bwd(h, e, x, targets, scale):
            loss, vjp = jax.vjp(lambda h, e, x: head_loss(h, e, x, targets), h, e, x)
            dh, de, dx = vjp(scale)  # scale: the fp16 loss scale, else 1
            return loss, grad_slab(dh, F32), grad_slab(de, F32), dx

        def block_bwd(b, x, dy):  # recompute the block's inside, then its vjp
            _, vjp = jax.vjp(block_fwd, b, x)
            db, dx = vjp(dy)
            return cast(db), dx

        def block_bwd_kept(vjp, dy):
            db, dx = vjp(dy)
            return cast(db), dx

        def embed_bwd(e, tokens, dx):
            _, vjp = jax.vjp(lambda e: embed_fwd(e, tokens), e)
            return grad_slab(vjp(dx)[0], F32)

        self.embed_fwd = jit(embed_fwd)
        self.block_fwd = jit(block_fwd)
        self.head_loss = jit(head_loss)
        self.head_fwd_bwd = jit(head_fwd_bwd)
        self.block_bwd = jit(block_bwd)
        self._block_fwd, self._kept_forward = block_fwd, {}
        self.block_fwd_keep = self.kept_forward(keep_level)
        self.block_bwd_kept = jax.jit(block_bwd_kept)  # any level's vjp
        self.embed_bwd = jit(embed_bwd)

    def kept_forward(self, level: str):
        """The jitted forward of a kept block at keep ``level``: (b, x) -> (y, the vjp
        holding the residuals). One device only (kept blocks are not ZeRO-3's)."""
        if level not in self._kept_forward:
            fwd = remat.kept_forward(self._block_fwd, level)
            self._kept_forward[level] = jax.jit(lambda b, x: jax.vjp(fwd, b, x))
        return self._kept_forward[level]

    def abstract_args(self, batch: int, seq_len: int, dtype) -> dict[str, tuple]:
        """Abstract arguments of each function for a micro-batch (batch, seq_len)."""
        sds = jax.ShapeDtypeStruct
        slab = lambda n: [sds((self.layouts[n].page_elems,), dtype)] * self.layouts[n].num_pages
        tokens = sds((batch, seq_len), jnp.int32)
        x = jax.eval_shape(self.embed_fwd, slab("embed"), tokens)
        return {
            "embed_fwd": (slab("embed"), tokens),
            "block_fwd": (slab("block"), x),
            "head_fwd_bwd": (slab("head"), slab("embed"), x, tokens, sds((), F32)),
            "block_bwd": (slab("block"), x, x),
            "embed_bwd": (slab("embed"), tokens, x),
        }

    def memory_sizes(self, batch: int, seq_len: int, dtype) -> StageMemory:
        """XLA's own measure of the stage functions' temporaries (by compiling them)."""
        args = self.abstract_args(batch, seq_len, dtype)
        x = args["block_fwd"][1]
        act = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        temps = []
        for name in ("block_bwd", "head_fwd_bwd", "embed_bwd"):
            analysis = getattr(self, name).lower(*args[name]).compile().memory_analysis()
            temps.append(getattr(analysis, "temp_size_in_bytes", 0) if analysis else 0)
        return StageMemory(act, max(temps) + 3 * act, self.kept_bytes(batch, seq_len, dtype))

    def keep_levels(self, batch: int, seq_len: int, dtype) -> tuple[str, ...]:
        """The keep levels the block supports (``remat.levels``)."""
        return remat.levels(
            self._block_fwd, *self.abstract_args(batch, seq_len, dtype)["block_fwd"]
        )

    def kept_bytes(self, batch: int, seq_len: int, dtype) -> dict[str, int]:
        """Bytes a kept block holds from forward to backward (its vjp's residuals: the
        kept activations, its param pages and input), per keep level the block
        supports, from abstract shapes."""
        return remat.kept_bytes(
            self._block_fwd, *self.abstract_args(batch, seq_len, dtype)["block_fwd"]
        )


class Ledger:
    """Bytes held per memory kind on each device, recomputed from the executor's own
    containers at every dispatch, with the peak per kind."""

    def __init__(self):
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = collections.defaultdict(int)

    def record(self, arrays, host_buffers: int = 0, device_buffers: int = 0) -> None:
        """``arrays``: the JAX arrays held; ``host_buffers``: bytes of host RAM held
        outside JAX (NVMe staging), counted in the ``pinned_host`` kind;
        ``device_buffers``: device bytes counted without their arrays (optimizer state
        on the device, whose chunks are too many to walk at every dispatch)."""
        totals: dict[str, int] = collections.defaultdict(int)
        if host_buffers:
            totals["pinned_host"] = host_buffers
        if device_buffers:
            totals["device"] = device_buffers
        seen = set()
        for a in jax.tree.leaves(arrays):
            if id(a) in seen:
                continue
            seen.add(id(a))
            totals[a.sharding.memory_kind or "device"] += device_bytes(a)
        self.current = dict(totals)
        for kind, n in totals.items():
            self.peak[kind] = max(self.peak[kind], n)

    def reset_peak(self) -> None:
        self.peak = collections.defaultdict(int)


class StreamingRuntime:
    """Trains with params on the host, streamed a stage at a time through the device.

    ZeRO-3 (``zero.py``) is this runtime with the page slabs sharded over devices: it
    overrides the hooks in the "placement hooks" section below, not the loop."""

    page_multiple = 1  # stage slabs pad to a multiple of this many pages

    def __init__(self, config: Config, probe=None, workdir: str | Path | None = None):
        tune_host_allocator(bounded=bool(config.memory.host_budget))
        self.config = config
        self.model = build_model(config.model)
        self.place = self._placement()
        self.compute_dtype = jnp.dtype(config.model.compute_dtype)
        self.num_layers = L = config.model.num_layers
        self.probe = probe  # called after every dispatch (tests sample live memory)
        self.ledger = Ledger()
        t, off, mem = config.train, config.offload, config.memory

        self.layouts = stage_layouts(self.model, mem.page_size, self.page_multiple)
        self.state_layouts = self._state_layouts()  # the slabs this process updates
        self.block_names = [f"block{i}" for i in range(L)]
        self.stage_names = ["embed", *self.block_names, "head"]
        self.update_order = ["head", *reversed(self.block_names), "embed"]  # backward order
        # The device cache of optimizer state: the first stages in forward order, the
        # last ones backward reaches (config.OffloadConfig says why those).
        self.device_stages = tuple(self.stage_names[: off.optimizer_device_stages])
        self.host_stages = [n for n in self.stage_names if n not in self.device_stages]

        opt_sharding = self.place.device if off.optimizer == "device" else self.place.optimizer
        self.optimizer = SlabOptimizer(
            config.optimizer, t.steps, self.state_layouts, opt_sharding, self.compute_dtype
        )
        self.device_optimizer = None
        if self.device_stages:
            self.device_optimizer = SlabOptimizer(
                config.optimizer, t.steps, self.state_layouts, self.place.device, self.compute_dtype
            )
            self._device_grad_slab = jax.jit(  # a gradient's pages -> one fp32 slab
                lambda pages: jnp.concatenate([p.astype(F32) for p in pages]),
                out_shardings=self.place.device,
            )
            self._average_device_grad = jax.jit(lambda g, d: (g / d, jnp.dot(g / d, g / d)))
        self._build_stage_functions()
        args = self.fns.abstract_args(t.micro_batch_size, t.seq_len, self.compute_dtype)
        self.checkpoint = args["block_fwd"][1]  # one block-boundary checkpoint (B, T, D)
        self.checkpoint_slots = L - off.keep_blocks  # blocks that store one (not kept)
        self.host_plan = self._plan_host_memory()
        self._nvme_dir = self._nvme_directory(workdir)
        self.states, self.param_store = self._make_stores(opt_sharding)
        self.grad_store = self._make_grad_store()
        self.swap = self._make_checkpoint_swap()
        self._init_params(jax.random.key(t.seed))
        self.loop = UpdateLoop(
            self.optimizer,
            self.states,
            self.param_store,
            self.update_order,
            self.layout_name,
            config.optimizer.grad_clip,
            mode=config.optimizer.mode,
            max_staleness=config.optimizer.max_staleness,
            speculation=config.optimizer.speculation,
            readahead=IO_READAHEAD,
            grads=self.grad_store,
            max_queued=self.host_plan.grads.max_queued,
            device_optimizer=self.device_optimizer,
            device_stages=self.device_stages,
        )
        self.plan = self._plan_memory()
        self.prefetch_depth = self.plan.prefetch_depth
        self.resident: dict[str, jax.Array] = {}
        self._refresh_resident()
        self.optimizer_s = 0.0
        self._grad_bytes = 0
        self._checkpoint_host_peak = 0  # offload.activations=host: their peak this step
        self._io_mark = self._nvme_io_totals()  # initialisation's writes are no step's
        self.loss_scale = (
            LossScale.create(t.loss_scale_init, t.loss_scale_period)
            if config.model.compute_dtype == "float16"
            else None
        )

    @staticmethod
    def layout_name(stage: str) -> str:
        return "block" if stage.startswith("block") else stage

    def _opt_of(self, stage: str) -> SlabOptimizer:
        """The optimizer updating ``stage``: on the device for device-cached stages."""
        return self.device_optimizer if stage in self.device_stages else self.optimizer

    @property
    def _device_grad_stages(self) -> tuple[str, ...]:
        """Stages whose gradient stays on the device: the device-cached ones in sync
        mode (lock-free mode accumulates every stage's on the host)."""
        return self.device_stages if self.config.optimizer.mode == "sync" else ()

    # -- set-up -------------------------------------------------------------------------

    def _stage_pages(self) -> dict[str, tuple[int, int]]:
        """Each stage's page range in the NVMe arrays: the host stages (the only ones
        whose state or params can be there) back to back."""
        pages, first = {}, 0
        for name in self.host_stages:
            n = self.state_layouts[self.layout_name(name)].num_pages
            pages[name], first = (first, n), first + n
        return pages

    def _plan_host_memory(self) -> HostMemoryPlan:
        cfg, off = self.config, self.config.offload
        slab = lambda n, dtype: self.state_layouts[self.layout_name(n)].nbytes(dtype)
        host = self.host_stages  # device-cached stages hold nothing on the host
        if not host:
            param_slabs = 0
        elif off.params == "host":
            param_slabs = sum(slab(n, self.compute_dtype) for n in host)
        else:  # the NVMe read-ahead window
            biggest = max(slab(n, self.compute_dtype) for n in host)
            param_slabs = (off.prefetch_depth + IO_READAHEAD + 1) * biggest
        on_device = self._device_grad_stages
        plan = plan_host_memory(
            budget=cfg.memory.host_budget,
            tier=off.optimizer,
            param_slabs=param_slabs,
            grad_sizes={
                n: slab(n, self.grad_dtype(n)) for n in self.update_order if n not in on_device
            },
            grad_policy=grad_policy(cfg),
            spill_grads="nvme" in (off.optimizer, off.params, off.activations),
            stage_state={n: self.optimizer.state_bytes(self.layout_name(n)) for n in host},
            order=[n for n in self.update_order if n in host],
            readahead=IO_READAHEAD,
            checkpoints=self._host_checkpoint_bytes(),
            activations=off.activations,
        )
        return plan

    def device_optimizer_bytes(self) -> int:
        """Device bytes of optimizer state and its working data. ``offload.optimizer=
        device``: every stage's state, twice during a step (the committed one and the
        speculative update, ``state_store.py``). Device-cached stages: that for their
        state, plus their refreshed compute-dtype params (published while the step's
        resident copies are still in use) and, in sync mode, their fp32 gradients
        (all of them, kept for a clipping redo or summed over micro-batches, else the
        largest: one at a time)."""
        if self.config.offload.optimizer == "device":
            return 2 * sum(
                self.optimizer.state_bytes(self.layout_name(n)) for n in self.stage_names
            )
        if not self.device_stages:
            return 0
        layouts = [self.state_layouts[self.layout_name(n)] for n in self.device_stages]
        state = 2 * len(self.optimizer.kinds) * sum(lay.nbytes(F32) for lay in layouts)
        pages = sum(lay.nbytes(self.compute_dtype) for lay in layouts)
        grads = [lay.nbytes(F32) for lay in layouts] if self._device_grad_stages else [0]
        kept = grad_policy(self.config) in ("keep", "accumulate")
        return state + pages + (sum(grads) if kept else max(grads))

    def grad_dtype(self, stage: str):
        """The dtype of a stage's gradient buffer on the host."""
        return block_grad_dtype(self.config) if stage.startswith("block") else F32

    def _checkpoint_bytes(self) -> int:
        """Bytes of one block-boundary checkpoint of a micro-batch."""
        return math.prod(self.checkpoint.shape) * jnp.dtype(self.checkpoint.dtype).itemsize

    def _host_checkpoint_bytes(self) -> int:
        """Host RAM of activation checkpoints: all of a micro-batch's with
        ``offload.activations=host``, the NVMe swap's staging with ``nvme``."""
        tier, slots = self.config.offload.activations, self.checkpoint_slots
        if tier == "host":
            return slots * self._checkpoint_bytes()
        if tier == "nvme":
            return staging_bytes(self._checkpoint_bytes(), slots, IO_READAHEAD)
        return 0

    def _nvme_directory(self, workdir) -> Path | None:
        """Checks (and creates) the NVMe directory when anything lives on NVMe."""
        off, mem = self.config.offload, self.config.memory
        if "nvme" not in (off.optimizer, off.params, off.activations):
            return None
        num_pages = sum(n for _, n in self._stage_pages().values())  # the host stages'
        page_elems = self.layouts["block"].page_elems
        needed = {}
        if off.optimizer == "nvme":  # two generations of each
            needed["the optimizer state"] = (
                2 * num_pages * page_elems * 4 * len(self.optimizer.kinds)
            )
        if off.params == "nvme":
            needed["the params"] = 2 * num_pages * page_elems * self.compute_dtype.itemsize
        if off.activations == "nvme":
            needed[f"{self.checkpoint_slots} activation checkpoints"] = (
                self.checkpoint_slots * self._checkpoint_bytes()
            )
        needed["spilled gradients"] = self.host_plan.grads.spill_bytes  # kept for a redo
        self._temporary_nvme = not mem.nvme_path and workdir is None
        if mem.nvme_path:
            path = Path(mem.nvme_path)
        elif workdir is not None:
            path = Path(workdir) / "nvme"
        else:
            path = Path(tempfile.mkdtemp(prefix="hetjax-nvme-"))
        path = path / self.nvme_subdir if self.nvme_subdir else path
        self._nvme_created = not path.exists() or self._temporary_nvme
        return check_nvme_path(path, needed)

    def _make_stores(self, opt_sharding):
        off = self.config.offload
        stage_pages = self._stage_pages()
        page_elems = self.layouts["block"].page_elems
        if off.optimizer == "nvme" and self.host_stages:
            states = NvmeStateStore(
                self._nvme_dir / "optimizer",
                self.optimizer.kinds,
                stage_pages,
                page_elems,
                list(self.host_plan.cached_stages),
                self.place.optimizer,
            )
        else:
            states = MemoryStateStore(opt_sharding, on_device=off.optimizer == "device")
        if off.params == "nvme" and self.host_stages:
            params = NvmeParamStore(
                self._nvme_dir / "params", self.compute_dtype, stage_pages, page_elems
            )
        else:
            params = HostParamStore(self.place.host)
        if self.device_stages:
            device_states = MemoryStateStore(self.place.device, on_device=True)
            states = SplitStateStore(device_states, states, self.device_stages)
            device_params = DeviceParamStore(self.place.device)
            params = SplitParamStore(device_params, params, self.device_stages)
        return states, params

    def _make_grad_store(self) -> GradientStore:
        """Where gradients wait for a possible clipping redo (``gradients.py``): the
        stages the host plan spills go to ``<nvme>/gradients``, one array per dtype."""
        grads = self.host_plan.grads
        spilled = {
            n: (self.state_layouts[self.layout_name(n)].num_pages, self.grad_dtype(n))
            for n in grads.spilled
        }
        path = self._nvme_dir / "gradients" if spilled else None
        page_elems = self.layouts["block"].page_elems
        redo = self.config.optimizer.grad_clip > 0  # the sync loop may redo the updates
        return GradientStore(redo, spilled, path, page_elems)

    def _make_checkpoint_swap(self) -> NvmeCheckpoints | None:
        if self.config.offload.activations != "nvme" or not self.checkpoint_slots:
            return None
        return NvmeCheckpoints(
            self._nvme_dir / "activations",
            self.checkpoint_slots,
            self.checkpoint.shape,
            self.checkpoint.dtype,
            chunk_elems=self.config.memory.page_size // jnp.dtype(self.checkpoint.dtype).itemsize,
            depth=IO_READAHEAD,
        )

    def _init_params(self, rng: jax.Array) -> None:
        """Initialises each stage straight into the optimizer's memory as an fp32 slab;
        the same keys as ``model.init``, so the params equal the in-memory runtime's.
        With ``model.init_from`` each stage is read from the checkpoint instead
        (hetjax/hf.py). Stages go to their tier one at a time (a model need not fit in
        RAM at once)."""
        from hetjax.hf import open_checkpoint

        checkpoint = open_checkpoint(self.config.model)  # None: random init
        keys = self.model.stage_keys(rng)
        tier = self.config.offload.optimizer
        for name in _progress(self.stage_names, f"initialising state ({tier})"):
            kind = self.layout_name(name)
            layout = self.layouts[kind]
            key = keys["blocks"][int(name[5:])] if kind == "block" else keys[kind]
            init = jax.jit(
                lambda k, kind=kind, layout=layout: layout.flatten(self.model.init_stage(kind, k)),
                out_shardings=self.place.optimizer,
            )
            if checkpoint is None:
                master = init(key)
            else:  # only this stage's tensors are read, flattened on the host
                slab = layout.flatten_np(checkpoint.stage(name))
                master = jax.device_put(slab, self.place.optimizer)
                del slab
            master = self._own_slab(kind, master)
            opt = self._opt_of(name)
            slabs, scalars = opt.init(kind, master)
            self.states.init_stage(name, slabs, scalars)
            self.param_store.publish(name, opt.compute_pages(kind, master))
            del master, slabs
        self.states.wait_init()
        self.param_store.commit()

    def _build_stage_functions(self) -> None:
        fns = StageFunctions(
            self.model,
            self.layouts,
            self._stage_jit,
            self._grad_slab,
            block_grad_dtype(self.config),
            self.config.offload.keep_level,
        )
        self.fns = fns
        off, t = self.config.offload, self.config.train
        if off.keep_blocks and off.keep_level != "all":
            levels = fns.keep_levels(t.micro_batch_size, t.seq_len, self.compute_dtype)
            if off.keep_level not in levels:
                raise ConfigError(
                    f"config key 'offload.keep_level' is {off.keep_level!r}, but this "
                    f"model's block supports only {', '.join(levels)}: "
                    f"{off.keep_level!r} keeps the values the block tags 'attn_probs' "
                    "(jax.ad_checkpoint.checkpoint_name(probs, 'attn_probs') in its "
                    "forward, as models/gpt.py does); tag them or choose another level"
                )
        self._embed_fwd, self._block_fwd = fns.embed_fwd, fns.block_fwd
        self._head_loss, self._head_fwd_bwd = fns.head_loss, fns.head_fwd_bwd
        self._block_bwd, self._embed_bwd = fns.block_bwd, fns.embed_bwd
        self._block_fwd_keep, self._block_bwd_kept = fns.block_fwd_keep, fns.block_bwd_kept

    def _plan_memory(self) -> DeviceMemoryPlan:
        cfg, t = self.config, self.config.train
        sizes = self.fns.memory_sizes(t.micro_batch_size, t.seq_len, self.compute_dtype)
        act = sizes.checkpoint
        on_device_ckpts = cfg.offload.activations == "device"
        keep, level = cfg.offload.keep_blocks, cfg.offload.keep_level
        return plan_device_memory(
            budget=cfg.memory.device_budget,
            num_layers=self.num_layers,
            requested_depth=cfg.offload.prefetch_depth,
            embed_head=self.layouts["embed"].nbytes(self.compute_dtype)
            + self.layouts["head"].nbytes(self.compute_dtype),
            block_slab=self.layouts["block"].nbytes(self.compute_dtype),
            grad_slab=max(
                self.layouts["block"].nbytes(block_grad_dtype(cfg)),
                self.layouts["embed"].nbytes(F32),
            ),
            checkpoints=((self.num_layers - keep) if on_device_ckpts else 2) * act,
            working_set=sizes.working_set,
            kept=keep * sizes.kept[level] if keep else 0,
            optimizer=self.device_optimizer_bytes(),
            # device-cached blocks are resident: their params are updated there
            min_resident=sum(n.startswith("block") for n in self.device_stages),
        )

    def _refresh_resident(self) -> None:
        """Copies the always-resident stages (embed, head, the first resident blocks)
        to the device; called after each optimizer step. Device-cached stages' params
        are on the device already (no copy)."""
        names = ["embed", "head", *self.block_names[: self.plan.resident_blocks]]
        for n in names:
            self.param_store.prefetch(n)
        self.resident = {}
        for n in names:
            self.resident[n] = self._to_device(self.param_store.get(n))
            if n not in self.device_stages:
                timeline.watch("host_to_device", n, self.resident[n])

    # -- placement hooks (overridden by ZeRO-3, zero.py) ---------------------------------

    def _placement(self) -> Placement:
        return Placement.single_device()

    def _state_layouts(self) -> dict[str, SlabLayout]:
        """Layouts of the slabs this process's optimizer and stores hold: whole slabs."""
        return self.layouts

    nvme_subdir = ""  # this process's directory under the NVMe path ("": the path)

    def _own_slab(self, kind: str, slab):
        """A whole stage slab (fp32) -> the part this process holds: all of it."""
        return slab

    def _whole_slab(self, slab) -> np.ndarray:
        """This process's part of a stage slab -> the whole slab (host numpy)."""
        return flat(slab)

    def _stage_jit(self, fn):
        return jax.jit(fn, out_shardings=self.place.device)

    def _grad_slab(self, pages: list[jax.Array], dtype=F32):
        """Inside a stage's jit: the gradient of its pages as it leaves the device."""
        return [p.astype(dtype) for p in pages]

    def _to_device(self, pages):
        """A stage's params from the param store -> pages on the device for compute."""
        return jax.device_put(pages, self.place.device)

    def _put_batch(self, rows: np.ndarray) -> jax.Array:
        return jax.device_put(rows, self.place.device)

    def _host_slab(self, grad) -> np.ndarray:
        """A gradient on the host (its pages) -> this process's flat fp32 numpy slab,
        aligned so the host optimizer reads it without a copy."""
        return aligned_concatenate(grad)

    def _sum_over_processes(self, value: float) -> float:
        return value

    # -- the step -----------------------------------------------------------------------

    def train_step(self, batch: np.ndarray, poison: bool = False) -> StepStats:
        """One optimizer step on a global batch (A, B/A, T+1).

        Sync mode: the last micro-batch's backward hands each stage's final gradient to
        the optimizer loop as it reaches the host, so the update of block i runs while
        blocks i-1 .. 0 are still in backward; then the step waits for the loop to commit.
        Lock-free mode: the gradients go to the loop's accumulator and the step returns.
        """
        A = batch.shape[0]
        scale = float(self.loss_scale.scale) if self.loss_scale is not None else 1.0
        sync = self.config.optimizer.mode == "sync"
        if not sync:  # pick up whatever the loop has published since the last step
            self._refresh_resident()
        seed = scale * (np.nan if poison else 1.0)  # the loss cotangent (NaN: a fault)
        self._step = _StepGrads(self, A, scale, seed, self.loop if sync else None)
        self.ledger.reset_peak()
        self._checkpoint_host_peak = 0
        if self.swap is not None:
            self.swap.reset_peak()
        losses = [self._forward_backward(micro, last=a == A - 1) for a, micro in enumerate(batch)]
        loss = float(np.mean([float(v) for v in losses]))
        grads, grad_norm = self._step.grads, self._step.norm()
        self._grad_bytes = self._step.peak_bytes
        # A non-finite step updates nothing: its speculative updates are dropped (stages
        # after the first non-finite gradient were never submitted, see _StepGrads).
        finite = bool(np.isfinite(grad_norm)) and bool(np.isfinite(loss))
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.update(jnp.bool_(finite))
        t0 = time.perf_counter()
        if sync:
            self.loop.finish(grad_norm, finite)
            self._refresh_resident()
        elif finite:
            self.loop.submit_step(grads)
        self.optimizer_s = time.perf_counter() - t0  # optimizer time not hidden by backward
        self._step = None
        fp16_overflow = not finite and self.loss_scale is not None and scale > 1
        return StepStats(
            loss, grad_norm, not finite, scale, nonfinite=not finite and not fp16_overflow
        )

    def _forward_backward(self, tokens_np: np.ndarray, last: bool):
        """Forward and backward of one micro-batch (B, T+1); its gradient slabs go to
        ``self._step`` (host, fp32). Returns the loss (a device scalar)."""
        L = self.num_layers
        tokens = self._put_batch(tokens_np[:, :-1])
        targets = self._put_batch(tokens_np[:, 1:])
        embed, head = self.resident["embed"], self.resident["head"]
        # Blocks first_kept .. L-1 keep their in-block activations from forward to
        # backward (offload.keep_blocks): no checkpoint, no recompute, no second fetch.
        first_kept = L - self.config.offload.keep_blocks
        backward_uses = [self.block_names[i] for i in reversed(range(first_kept))]
        window = _Window(self, self.block_names + backward_uses)
        pending: collections.deque = collections.deque()  # grads in flight to the host
        if self.swap is not None:
            self.swap.begin()  # the previous micro-batch's checkpoint writes are done

        x = self._embed_fwd(embed, tokens)  # (B, T, D)
        timeline.watch("compute", "embed fwd", x)
        ckpts: list[Any] = [None] * L
        kept: list[Any] = [None] * L  # the kept blocks' vjps (their residuals)
        for i in range(L):
            slab = window.get(i)
            if i >= first_kept:
                x, kept[i] = self._block_fwd_keep(slab, x)
            else:
                ckpts[i] = self._store_checkpoint(i, x)
                x = self._block_fwd(slab, x)
            timeline.watch("compute", f"block{i} fwd", x, after=slab)
            del slab  # the window decides when a slab goes; hold no reference past it
            window.done(i)
            self._account(window, ckpts, pending, x, kept)

        loss, dh, de_head, dx = self._head_fwd_bwd(
            head,
            embed,
            x,
            targets,
            jnp.asarray(self._step.seed, F32),  # the loss is fp32; fp16 cannot hold large scales
        )
        del x
        timeline.watch("compute", "head fwd+bwd", (loss, dx))
        self._grad_out("head", dh, pending)
        self._grad_out("embed", de_head, pending)
        del dh, de_head

        next_ckpt = self._load_checkpoint(first_kept - 1, ckpts) if first_kept else None
        for i in reversed(range(L)):
            if i >= first_kept:
                db, dx = self._block_bwd_kept(kept[i], dx)
                timeline.watch("compute", f"block{i} bwd", (db, dx), after=kept[i])
                kept[i] = None
            else:
                j = L + first_kept - 1 - i  # position in the window's use order
                slab, x_in = window.get(j), next_ckpt
                if i > 0:  # prefetch the next checkpoint while this block computes
                    next_ckpt = self._load_checkpoint(i - 1, ckpts)
                db, dx = self._block_bwd(slab, x_in, dx)
                timeline.watch("compute", f"block{i} bwd", (db, dx), after=(slab, x_in))
                ckpts[i] = None
                del x_in, slab
                window.done(j)
            self._grad_out(self.block_names[i], db, pending)
            del db
            self._account(window, ckpts, pending, dx, kept)

        de = self._embed_bwd(embed, tokens, dx)
        timeline.watch("compute", "embed bwd", de)
        self._grad_out("embed", de, pending)
        if self.device_stages:  # the device cache's updates are dispatched by now
            self._account(window, ckpts, pending, de)
        del de
        while pending:
            self._step.add(*pending.popleft())
        return loss

    def _store_checkpoint(self, i: int, x: jax.Array) -> jax.Array | None:
        """Keeps block i's input checkpoint: on the device (returned as is), in host RAM
        (its copy is returned), or swapped to NVMe through host RAM (None: the swap holds
        it)."""
        tier = self.config.offload.activations
        if tier == "device":
            return x
        ckpt = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        timeline.watch("device_to_host", "checkpoint", ckpt, after=x)
        if tier == "nvme":
            self.swap.put(i, ckpt)
            return None
        return ckpt

    def _load_checkpoint(self, i: int, ckpts: list) -> jax.Array:
        """Block i's input checkpoint on the device (for its backward)."""
        if self.swap is not None:
            x = self._put_batch(self.swap.get(i))  # waits for its read from NVMe
            timeline.watch("host_to_device", "checkpoint", x)
            return x
        ckpt = ckpts[i]
        x = jax.device_put(ckpt, ckpt.sharding.with_memory_kind("device"))  # no-op if there
        if x is not ckpt:
            timeline.watch("host_to_device", "checkpoint", x, after=ckpt)
        return x

    def _grad_out(self, name: str, g, pending) -> None:
        """Hands a stage's gradient on: summed and updated on the device (the
        device-cached stages in sync mode), or copied to the host."""
        if name in self._device_grad_stages:
            self._step.add_device(name, g)
        else:
            self._send_grad(name, g, pending)

    def _send_grad(self, name: str, g, pending) -> None:
        """Starts the device-to-host copy of a gradient slab (its pages, or its shards);
        hands older ones on."""
        host = jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), g)
        pending.append((name, jax.device_put(g, host)))
        timeline.watch("device_to_host", f"{name} grad", pending[-1][1], after=g)
        while len(pending) > 2:
            self._step.add(*pending.popleft())

    def _account(self, window, ckpts, pending, *transients) -> None:
        held = [
            *self.resident.values(),
            *window.cache.values(),
            *ckpts,
            *(g for _, g in pending),
            *transients,
        ]
        if self.device_stages:  # the device cache's params and gradients
            held += self.param_store.device_arrays() + self.loop.device_grads()
            if self._step is not None:
                held += list(self._step.device_grads.values())
        staged = 0  # NVMe swap: checkpoints in host RAM, outside JAX
        if self.swap is not None:
            staged = self.swap.host_bytes()
        elif self.config.offload.activations == "host":
            in_ram = sum(device_bytes(c) for c in ckpts if c is not None)
            self._checkpoint_host_peak = max(self._checkpoint_host_peak, in_ram)
        # optimizer state on the device: a running sum (its chunks are many)
        self.ledger.record(held, staged, self.states.device_bytes())
        if self.probe is not None:
            self.probe(self)

    # -- evaluation and state -----------------------------------------------------------

    def eval_loss(self, batch: np.ndarray) -> float:
        tokens = self._put_batch(batch[:, :-1])
        targets = self._put_batch(batch[:, 1:])
        window = _Window(self, self.block_names)
        x = self._embed_fwd(self.resident["embed"], tokens)
        for i in range(self.num_layers):
            x = self._block_fwd(window.get(i), x)
            window.done(i)
        return float(self._head_loss(self.resident["head"], self.resident["embed"], x, targets))

    def params(self) -> Any:
        """The fp32 master params as the model's pytree (host numpy)."""
        unflat = lambda name: jax.tree.map(
            np.array,
            self.layouts[self.layout_name(name)].unflatten(
                self._whole_slab(self.states.master(name))
            ),
        )
        blocks = [unflat(n) for n in self.block_names]
        return {
            "embed": unflat("embed"),
            "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks),
            "head": unflat("head"),
        }

    def plan_lines(self) -> list[str]:
        """The start-up plans, for the log."""
        lines = [self.plan.describe(), self.host_plan.describe()]
        if self.device_stages:
            lines.append(
                f"optimizer state of {len(self.device_stages)} stage"
                f"{'s' * (len(self.device_stages) > 1)} on the device, updated "
                f"there ({', '.join(self.device_stages)}; offload.optimizer_device_stages)"
            )
        if self._nvme_dir is not None:
            off = self.config.offload
            lines.append(
                f"nvme: {self._nvme_dir} (offload.optimizer={off.optimizer}, "
                f"offload.params={off.params}, offload.activations={off.activations})"
            )
        return lines

    def settle(self) -> None:
        if self.config.optimizer.mode == "lockfree":
            self.loop.drain()
            self._refresh_resident()
        self.states.flush()

    def save_state(self) -> RuntimeState:
        if self.config.optimizer.mode == "lockfree":  # apply what is buffered first
            self.loop.drain()
            self._refresh_resident()
        stages, scalars = {}, {}
        for name in self.stage_names:
            layout = self.layouts[self.layout_name(name)]
            slabs, scalars[name] = self.states.committed(name)
            stages[name] = {
                k: layout.unflatten(self._whole_slab(slab)) for k, slab in slabs.items()
            }
        ls = self.loss_scale
        loss_scale = (float(ls.scale), int(ls.good_steps)) if ls is not None else None
        return RuntimeState(stages, scalars, loss_scale)

    def load_state(self, state: RuntimeState) -> None:
        """Replaces every stage's state and params (the loop is idle between steps;
        lock-free mode is drained first)."""
        if sorted(state.kinds) != sorted(self.optimizer.kinds):
            raise ConfigError(
                f"the checkpoint holds optimizer state {state.kinds}, optimizer.name="
                f"{self.config.optimizer.name} needs {self.optimizer.kinds}"
            )
        if self.config.optimizer.mode == "lockfree":
            self.loop.drain()
        self.loop.reload()
        tier = self.config.offload.optimizer
        for name in _progress(self.stage_names, f"restoring state ({tier})"):
            kind = self.layout_name(name)
            layout = self.layouts[kind]
            opt = self._opt_of(name)
            slabs = {
                k: opt.as_chunks(
                    kind, self._own_slab(kind, layout.flatten_np(state.stages[name][k]))
                )
                for k in opt.kinds
            }
            scalars = [jax.device_put(np.asarray(a), opt.sharding) for a in state.scalars[name]]
            self.states.init_stage(name, slabs, scalars)
            self.param_store.publish(name, opt.compute_pages(kind, slabs[MASTER]))
        self.states.wait_init()
        self.param_store.commit()
        if self.loss_scale is not None and state.loss_scale is not None:
            self.loss_scale = self.loss_scale.replace(
                scale=jnp.float32(state.loss_scale[0]), good_steps=jnp.int32(state.loss_scale[1])
            )
        self._refresh_resident()
        self._io_mark = self._nvme_io_totals()  # the restore's writes are no step's

    def close(self) -> None:
        self.loop.close()
        if self.swap is not None:
            self.swap.close()
        if self._nvme_dir is not None and self._temporary_nvme:
            shutil.rmtree(self._nvme_dir, ignore_errors=True)

    def _nvme_io_totals(self) -> tuple[int, int]:
        stores = [self.states, self.param_store, self.swap, self.grad_store]
        return (
            sum(getattr(s, "read_bytes", 0) for s in stores),
            sum(getattr(s, "write_bytes", 0) for s in stores),
        )

    def extra_metrics(self) -> dict[str, Any]:
        host = self.param_store.host_bytes() + self.states.host_bytes() + self._grad_bytes
        # checkpoints in host RAM at their peak during the step (offload.activations)
        host += self.swap.peak_host_bytes if self.swap is not None else self._checkpoint_host_peak
        nvme = self.states.nvme_bytes + self.param_store.nvme_bytes + self.grad_store.nvme_bytes
        nvme += self.swap.nvme_bytes if self.swap is not None else 0
        io = self._nvme_io_totals()
        read, written = io[0] - self._io_mark[0], io[1] - self._io_mark[1]
        self._io_mark = io
        busy, self.loop.busy_s = self.loop.busy_s, 0.0
        updated, self.loop.updated_params = self.loop.updated_params, 0
        on_device, self.loop.device_params = self.loop.device_params, 0
        metrics = {
            "device_bytes_peak": int(self.ledger.peak.get("device", 0)),
            "host_bytes": int(host),
            "nvme_bytes": int(nvme),
            "optimizer_s": self.optimizer_s,  # optimizer time the step waited for
            "optimizer_busy_s": busy,  # time the optimizer loop worked (overlapped or not)
            "optimizer_params": int(updated),  # parameters updated (padded slabs, redos too)
            "optimizer_device_params": int(on_device),  # of the device cache, on the device
            "nvme_read_bytes": int(read),
            "nvme_write_bytes": int(written),
            "optimizer_redo": self.loop.redo,
            "optimizer_deferred": self.loop.deferred,
        }
        if self.config.optimizer.mode == "lockfree":
            metrics["optimizer_lag_steps"] = self.loop.unapplied
        return metrics


class _StepGrads:
    """One step's gradient slabs, accumulated on the host (fp32) over micro-batches.

    A stage's slab is final after its last contribution of the last micro-batch (embed
    has two per micro-batch: the tied head and its own backward). It is then averaged
    (loss scale removed), its squared norm added to the global norm, and, in sync mode,
    handed to the optimizer loop at once, which owns it from then on (``gradients.py``):
    it is not held here. Lock-free mode keeps them all for the loop's accumulator.

    Device-cached stages (sync mode) take the same steps on the device
    (:meth:`add_device`): their squared norms stay device scalars until :meth:`norm`."""

    def __init__(
        self, runtime: StreamingRuntime, micro_batches: int, scale: float, seed: float, loop
    ):
        self.remaining = {
            n: micro_batches * (2 if n == "embed" else 1) for n in runtime.stage_names
        }
        self.divisor = micro_batches * scale
        self.scale = scale
        self.seed = seed  # the loss cotangent: the scale (NaN when a fault is injected)
        self.loop = loop
        self.host_slab, self.sum_over_processes = runtime._host_slab, runtime._sum_over_processes
        self.finite = True  # once a gradient is not finite, nothing more is submitted
        self.grads: dict[str, np.ndarray] = {}
        self.peak_bytes = 0  # gradient bytes held on the host (here and by the loop)
        self._sq = 0.0
        self.device_grads: dict[str, jax.Array] = {}  # device-cached stages' sums
        self._device_sq: list[jax.Array] = []
        self._rt = runtime

    def add(self, name: str, pages) -> None:
        g = self.host_slab(pages)  # waits for this slab only
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g
        self.remaining[name] -= 1
        if self.remaining[name] == 0:
            g = self.grads[name]
            if self.divisor != 1:
                g /= self.divisor
            g32 = g if g.dtype == np.float32 else g.astype(np.float32)  # bf16: one block
            sq = float(np.dot(g32, g32))
            del g32
            self._sq += sq
            self.finite = self.finite and bool(np.isfinite(sq))
        held = sum(a.nbytes for a in self.grads.values())
        if self.loop is not None:
            held += self.loop.grad_host_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
        if self.remaining[name] == 0 and self.loop is not None:
            g = self.grads.pop(name)
            if self.finite:  # never write non-finite state
                self.loop.submit(name, g)

    def add_device(self, name: str, pages) -> None:
        """A device-cached stage's gradient pages: summed on the device over the
        micro-batches (as :meth:`add` does on the host), then averaged, its squared norm
        taken and its update dispatched, all without leaving the device."""
        g = self._rt._device_grad_slab(pages)
        if name in self.device_grads:
            g = self.device_grads[name] + g
        self.device_grads[name] = g
        self.remaining[name] -= 1
        if self.remaining[name] == 0:
            g, sq = self._rt._average_device_grad(self.device_grads.pop(name), self.divisor)
            self._device_sq.append(sq)
            self.loop.submit_device(name, g)

    def norm(self) -> float:
        assert not any(self.remaining.values()), self.remaining
        sq = self._sq + sum(float(s) for s in self._device_sq)  # waits for the device's
        return float(np.sqrt(self.sum_over_processes(sq)))


def grad_policy(config: Config) -> str:
    """How long the host holds gradient buffers (``gradients.py``): ``lockfree``, all
    of them twice; ``accumulate`` (several micro-batches), all of them all step; ``keep``
    (sync mode with clipping), until the step commits, for a possible redo; ``release``
    (no clipping), until the stage's update consumed it."""
    if config.optimizer.mode == "lockfree":
        return "lockfree"
    if config.train.grad_accum > 1:
        return "accumulate"
    return "keep" if config.optimizer.grad_clip > 0 else "release"


def block_grad_dtype(config: Config):
    """The dtype block gradient slabs cross to the host and wait there in: bfloat16 when
    that loses nothing, i.e. compute in bf16 (its gradients are bf16 values), one
    micro-batch and one device (no sum), sync mode; else fp32. It halves the device-to-host traffic
    and the host's gradient buffers (4 bytes/param -> 2), as Fuyou's fp16 gradients."""
    if (
        config.model.compute_dtype == "bfloat16"
        and config.train.grad_accum == 1
        and config.optimizer.mode == "sync"
        and config.distributed.data_parallel == 1  # ZeRO-3 sums gradients over devices
    ):
        return jnp.bfloat16
    return F32


def _progress(stages: list[str], what: str):
    """A progress bar over stages for the long start-up phases (NVMe initialisation,
    restore), on a terminal only (tqdm's ``disable=None``); gone when done."""
    from tqdm import tqdm

    return tqdm(stages, desc=what, unit="stage", disable=None, leave=False, dynamic_ncols=True)


def _to_f32(pages):
    return [p.astype(F32) for p in pages]


class _Window:
    """Device copies of block slabs for a known order of uses: prefetches the next
    ``depth`` uses, drops a slab after a use unless it is used again within the window.
    Resident blocks are served from the runtime and never dropped."""

    def __init__(self, runtime: StreamingRuntime, uses: list[str]):
        self.rt, self.uses = runtime, uses
        self.depth = runtime.prefetch_depth
        self.cache: dict[str, jax.Array] = {}

    def _fetch(self, name: str) -> jax.Array:
        if name in self.rt.resident:
            return self.rt.resident[name]
        if name not in self.cache:
            self.cache[name] = self.rt._to_device(self.rt.param_store.get(name))
            timeline.watch("host_to_device", name, self.cache[name])
        return self.cache[name]

    def get(self, j: int) -> jax.Array:
        # Params on NVMe: disk reads start IO_READAHEAD uses before the device copies.
        end = min(j + 1 + self.depth + IO_READAHEAD, len(self.uses))
        for k in range(j, end):
            if self.uses[k] not in self.rt.resident and self.uses[k] not in self.cache:
                self.rt.param_store.prefetch(self.uses[k])
        slab = self._fetch(self.uses[j])
        for k in range(j + 1, min(j + 1 + self.depth, len(self.uses))):
            self._fetch(self.uses[k])
        return slab

    def done(self, j: int) -> None:
        name = self.uses[j]
        if name not in self.uses[j + 1 : j + 1 + max(self.depth, 1)]:
            self.cache.pop(name, None)
