"""The layer-wise streaming runtime (``offload.mode=stream``).

Params live on the host as one page slab per stage (``storage/pages.py``), in the compute
dtype, in the ``pinned_host`` memory kind, and move as that slab's list of pages; fp32
master state and the optimizer live with the host optimizer. A step streams the stages
through a window of device memory:

    forward   embed, block 0 .. block L-1, head + loss (and the head's backward)
    backward  block L-1 .. block 0 (each recomputes its inside with jax.vjp), embed

A model of several stage groups (T5's encoder and decoder, ``models/staged.py``) runs
them in turn: each group's input is made from the embed stage (resident) and the
previous group's output, which stays on the device until that input's backward, as does
the group's context (T5's decoder: the encoder's output), read by every block of the
group. Backward sums the blocks' gradients of the context on the device, block by
block, and the group input's backward turns the sum into the embed stage's gradient and
the previous group's output gradient (T5: the encoder output's, the sum over every
decoder block's cross-attention).

The access order is known, so :class:`~hetjax.runtime.window.PrefetchWindow` copies the
next ``offload.prefetch_depth`` slabs in while the current stage computes (JAX's async
dispatch overlaps them) and drops each slab after its last use. Block-boundary
activations (*boundaries*) stay on the device, go to host RAM, or are swapped through
host RAM to NVMe (``offload.activations``, ``storage/swap.py``). Each stage's gradient
goes to the host as soon as its backward is dispatched, with its squared norm from the
backward itself; this thread only dispatches, the step's gradient thread takes the
gradient from there (:class:`~hetjax.runtime.grads.StepGradients`); the host optimizer
loop (``optimizer/update_loop.py``) updates the stage as soon as its final gradient is
there, reading its pages where they landed, while backward goes on, and refreshes the
param slabs for the next step.

With ``offload.optimizer_device_stages = N`` (host or NVMe optimizer) the first N stages
in forward order are a device cache of optimizer state (Angel-PTM): their state and
params live on the device, those blocks are resident, their gradient is summed,
averaged and normed on the device and their update dispatched there
(``UpdateLoop.submit_device``).

Where a stage's pages live and how a stage function is compiled is the placement
strategy's (``placement.py``: one device; ``zero.py``: ZeRO-3 over devices), handed to
the runtime. What the runtime may hold in each tier is the memory model's
(``hetjax/memory.py``): the plans are made at start-up and the ledger records what the
step really held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import memory, timeline
from hetjax.allocator import tune_host_allocator
from hetjax.checkpoint_state import StateSource, StoredState
from hetjax.config import Config, ConfigError
from hetjax.data import split_window
from hetjax.memory import DeviceCache, Offload, plan_device
from hetjax.memory_host import plan_host
from hetjax.optimizer.deferred import Deferred, deferred_updates
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.optimizer.update_loop import UpdateLoop
from hetjax.runtime import setup, state_io
from hetjax.runtime.boundaries import Boundaries, SwappedResiduals
from hetjax.runtime.grads import DeviceGradients, StepGradients
from hetjax.runtime.ledger import IoMeter, Ledger
from hetjax.runtime.placement import SingleDevice
from hetjax.runtime.routed import (
    DeferredExperts,
    ExpertFetcher,
    ExpertFetchers,
    Routing,
    routed_blocks,
)
from hetjax.runtime.setup import layout_name
from hetjax.runtime.stages import StageFunctions, StageMemory
from hetjax.runtime.window import PrefetchWindow
from hetjax.storage.pages import zero_page
from hetjax.support import fallbacks, parallelism, supports
from hetjax.types import LossScale, RuntimeState, StepReport
from hetjax.xla_env import pinned_limit
from models import build_model

F32 = jnp.float32


class StreamingRuntime:
    """Trains with params on the host, streamed a stage at a time through the device.
    ``placement``: the strategy placing pages and compiling stage functions (default:
    one device); ``probe``: called after every dispatch (tests sample live memory)."""

    def __init__(
        self, config: Config, probe=None, workdir: str | Path | None = None, placement=None
    ):
        tune_host_allocator(config.memory.host_budget)
        self.config, self.probe = config, probe
        self.placement = placement = placement or SingleDevice()
        self.shardings = placement.shardings
        self.model = build_model(config.model)
        self.compute_dtype = jnp.dtype(config.model.compute_dtype)
        self.num_layers = L = config.model.num_blocks  # every group's blocks
        self.ledger = Ledger()
        t, off, mem = config.train, config.offload, config.memory
        self.layouts = placement.stage_layouts(self.model, mem.page_size)
        self.state_layouts = placement.state_layouts(self.layouts)  # what this process holds
        groups = self.model.groups
        self.block_names = [g.stage(i) for g in groups for i in range(g.num_layers)]
        # each block's group, and the first block of each group, in forward order
        self.group_of = [g for g, group in enumerate(groups) for _ in range(group.num_layers)]
        self.group_start = [self.group_of.index(g) for g in range(len(groups))]
        self.stage_group = dict(zip(self.block_names, self.group_of, strict=True))
        self.stage_names = ["embed", *self.block_names, "head"]
        self.update_order = ["head", *reversed(self.block_names), "embed"]  # backward order
        # The device cache of optimizer state: the first stages in forward order, the
        # last ones backward reaches (config.OffloadConfig says why those).
        self.device_stages = tuple(self.stage_names[: off.optimizer_device_stages])
        self.host_stages = [n for n in self.stage_names if n not in self.device_stages]
        opt = lambda sharding: SlabOptimizer(
            config.optimizer, t.steps, self.state_layouts, sharding, self.compute_dtype
        )
        on_device = off.optimizer == "device"
        self.optimizer = opt(self.shardings.device if on_device else self.shardings.optimizer)
        self.device_optimizer = opt(self.shardings.device) if self.device_stages else None
        # The model the stage functions run: with expert parallelism, blocks that hold
        # their device's experts and exchange tokens over the placement's expert axis.
        compute_model = build_model(config.model, placement.expert_axis)
        self.fns = StageFunctions(
            compute_model,
            self.layouts,
            placement.jit,
            placement.grad_slab,
            memory.block_grad_dtype(config),
            off.keep_level,
            kept_blocks=supports("keep_blocks", parallelism(config.distributed)) is None,
            batch_chunks=off.batch_chunks,
        )
        self.fns.check_keep_level(off, t.micro_batch_size, t.seq_len, self.compute_dtype)
        if off.swap_blocks and len(groups) > 1:
            raise ConfigError(
                f"config key 'offload.swap_blocks' ({off.swap_blocks}): swapped activations "
                f"are not supported for a model of several stage groups (model.family="
                f"{config.model.family!r}); leave it 0 (keep_blocks keeps activations instead)"
            )
        args = self.fns.abstract_args(t.micro_batch_size, t.seq_len, self.compute_dtype)
        self.boundary = args["block_fwd"][1]  # one block-boundary activation (B, T, D)

        # The memory model decides what each tier holds (hetjax/memory.py). The host
        # plan and the disk check need the slab and boundary sizes only; what the device
        # plan needs besides (XLA's working set, the kept blocks' residuals: compiling
        # and tracing the stage functions) is measured once those checks passed.
        boundary = math.prod(self.boundary.shape) * self.boundary.dtype.itemsize
        kinds = len(self.optimizer.kinds) - 1
        # (the swapped blocks' activations live in host RAM: their sizes, from abstract
        # shapes, are the host plan's too)
        kept, swapped = {}, {}
        if off.swap_blocks:
            batch = (t.micro_batch_size, t.seq_len, self.compute_dtype)
            kept, swapped = self.fns.kept_bytes(*batch), self.fns.swap_bytes(*batch)
        stage_memory = StageMemory(boundary, 0, kept, swapped=swapped)
        self.sizes = setup.memory_sizes(
            config, groups, self.layouts, self.state_layouts, stage_memory, kinds
        )
        self.offload = Offload.from_config(config)
        self.host_plan = plan_host(self.sizes, self.offload, mem.host_budget)
        if jax.default_backend() == "gpu":  # XLA caps pinned host memory there
            self.host_plan.check_pinned(pinned_limit())
        # Stages whose gradient stays on the device (memory.DeviceCache): asked per stage
        # in the per-layer loop, so decided once here.
        to_host = DeviceCache.of(self.sizes, self.offload).grad_stages(self.sizes)
        self._device_grad_stages = frozenset(self.device_stages) - set(to_host)
        stores = setup.build_stores(
            config, self.sizes, self.offload, self.host_plan, self.layouts, self.optimizer.kinds,
            placement, self.device_stages, self.boundary, workdir,
        )  # fmt: skip
        self.nvme_dir, self._temporary_nvme = stores.nvme_dir, stores.temporary
        self.states, self.param_store = stores.states, stores.params
        self.grad_store, self.swap = stores.grads, stores.swap
        self.residual_swap = stores.residual_swap  # offload.swap_tier=nvme
        self.residuals = SwappedResiduals(self.shardings.device, self.residual_swap)
        self.optimizer.param_buffers = stores.param_buffers
        setup.init_state(
            config, self.model, self.layouts, self.stage_names, self._opt_of,
            placement.own_slab, self.states, self.param_store, self.shardings.optimizer,
        )  # fmt: skip
        self.loop = UpdateLoop(
            self.optimizer,
            self.states,
            self.param_store,
            self.update_order,
            layout_name,
            config.optimizer.grad_clip,
            mode=config.optimizer.mode,
            max_staleness=config.optimizer.max_staleness,
            speculation=config.optimizer.speculation,
            readahead=memory.IO_READAHEAD,
            grads=self.grad_store,
            max_queued=self.host_plan.grads.max_queued,
            device_optimizer=self.device_optimizer,
            device_stages=self.device_stages,
        )
        self.device_grads = DeviceGradients(self.shardings.device) if self.device_stages else None
        measured = self.fns.memory_sizes(t.micro_batch_size, t.seq_len, self.compute_dtype)
        self.sizes = dataclasses.replace(
            self.sizes, working_set=measured.working_set, kept=measured.kept,
            context=measured.context,
        )  # fmt: skip
        self.plan = plan_device(self.sizes, self.offload, mem.device_budget)
        # expert-aware streaming (routed.py): the MoE blocks that stream and recompute
        self.routed = routed_blocks(
            off, compute_model, self.layouts, self.block_names, self.plan.resident_blocks,
            self.device_stages, parallelism=parallelism(config.distributed),
        )  # fmt: skip
        self.experts = None  # their groups' ExpertFetcher, by group index
        if self.routed:
            E, device = config.model.num_experts, self.shardings.device
            self.experts = ExpertFetchers(
                {g: ExpertFetcher(fns.routed(), self.compute_dtype, device, E)
                 for g, fns in enumerate(self.fns.groups)}
            )  # fmt: skip
        # deferred expert updates (optimizer/deferred.py)
        deferring = bool(self.routed) and deferred_updates(config)
        if deferring:
            self.loop.use_deferred(Deferred(self.routed))
        self.deferred = DeferredExperts(self.loop if deferring else None)
        self.resident: dict[str, jax.Array] = {}
        self._refresh_resident()
        self._step: StepGradients | None = None
        self.boundaries = Boundaries(off.activations, L, self.swap, placement.put_batch)
        # NVMe I/O per step: initialisation's writes are no step's
        self.io = IoMeter(
            [self.states, self.param_store, self.grad_store, self.swap, self.residual_swap]
        )
        fp16 = config.model.compute_dtype == "float16"
        self.loss_scale = LossScale.create(t.loss_scale_init, t.loss_scale_period) if fp16 else None

    layout_name = staticmethod(layout_name)

    def _opt_of(self, stage: str) -> SlabOptimizer:
        """The optimizer updating ``stage``: on the device for device-cached stages."""
        return self.device_optimizer if stage in self.device_stages else self.optimizer

    def _refresh_resident(self) -> None:
        """Copies the always-resident stages (embed, head, the first resident blocks)
        to the device; called after each optimizer step. Device-cached stages' params
        are on the device already (no copy)."""
        names = ["embed", "head", *self.block_names[: self.plan.resident_blocks]]
        for n in names:
            self.param_store.prefetch(n)
        self.resident = {}
        for n in names:
            self.resident[n] = self._to_device(n, self.param_store.get(n))
            if n not in self.device_stages:
                timeline.watch("host_to_device", n, self.resident[n])

    def _to_device(self, stage: str, slab):
        """A stage's params from the param store -> as its functions compute with them
        (a routed block: its leaves but the experts, ``routed.RoutedSlab``)."""
        if stage in self.routed:
            return self.experts[self.stage_group[stage]].dense(slab)
        return self.placement.to_device(slab, self.layouts[layout_name(stage)])

    def _routed_forward(self, name: str, group, slab, x, context):
        """A routed block's forward (``routed.py``): attention and the router, the host
        reads which experts got tokens, only those are copied in (their deferred
        updates caught up first), the rest of the block runs. -> (y, statistics, the
        routing, for the block's backward)."""
        fns = group.routed()
        x_mid, top_e, counts = fns.route(slab.dense, x, context)
        routing = Routing.of(np.asarray(counts), top_e, self.placement.put_batch)
        fetcher = self.experts[group.index]
        self.deferred.forward(name, fetcher, routing, training=self._step is not None)
        held, copied = fetcher.experts(slab, routing, self.deferred.fresh.get(name))
        timeline.watch("host_to_device", "experts", copied)
        y, stats = fns.mlp(held, x_mid, routing.top_e, routing.slots, context)
        return y, stats, routing

    def _window(self, uses: list[str]) -> PrefetchWindow:
        return PrefetchWindow(
            uses,
            self.plan.prefetch_depth,
            self.resident,
            self.param_store,
            self._to_device,
            keep=self.host_plan.kept_param_blocks,
        )

    # -- the step -----------------------------------------------------------------------

    def train_step(self, batch: np.ndarray, poison: bool = False) -> StepReport:
        """One optimizer step on a global batch (A, B/A, T+1).

        Sync mode: the last micro-batch's backward hands each stage's final gradient to
        the optimizer loop as it reaches the host, so the update of block i runs while
        blocks i-1 .. 0 are still in backward; then the step waits for the loop to commit.
        Lock-free mode: the gradients go to the loop's accumulator and the step returns.
        """
        scale = float(self.loss_scale.scale) if self.loss_scale is not None else 1.0
        sync = self.config.optimizer.mode == "sync"
        if not sync:  # pick up whatever the loop has published since the last step
            self._refresh_resident()
        self.ledger.reset_peak()
        self.boundaries.reset_peak()
        if self.experts:  # the step's count starts here (not an evaluation's)
            self.experts.take()
        step = self._gradients(batch, scale, poison, self.loop if sync else None)
        loss = float(np.mean([float(v) for v in step.losses]))
        grad_norm = step.norm()
        # A non-finite step updates nothing: its speculative updates are dropped (stages
        # after the first non-finite gradient were never submitted, see StepGradients).
        finite = bool(np.isfinite(grad_norm)) and bool(np.isfinite(loss))
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.update(jnp.bool_(finite))
        t0 = time.perf_counter()
        if sync:
            work = self.loop.finish(grad_norm, finite)
            self.deferred.committed()
            self._refresh_resident()
        else:
            if finite:
                self.loop.submit_step(step.grads)
            work = self.loop.collect()
        waited = time.perf_counter() - t0  # optimizer time not hidden by backward
        fp16_overflow = not finite and self.loss_scale is not None and scale > 1
        return StepReport(
            loss,
            grad_norm,
            not finite,
            scale,
            nonfinite=not finite and not fp16_overflow,
            metrics=self._metrics(step, work, waited),
        )

    def compute_gradients(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Forward and backward of a global batch (A, B/A, T+1) with no update: each
        stage's averaged gradient slab on the host (the benchmarks time the step's parts
        with it)."""
        step = self._gradients(batch, 1.0, False, None)
        step.norm()  # the gradient thread is done
        return step.grads

    def _gradients(self, batch, scale: float, poison: bool, loop) -> StepGradients:
        """Runs every micro-batch's forward and backward; the gradients go to a
        :class:`StepGradients` (and through it to ``loop``, when given)."""
        seed = scale * (np.nan if poison else 1.0)  # the loss cotangent (NaN: a fault)
        step = StepGradients(
            self.stage_names,
            len(self.model.groups),
            batch.shape[0],
            scale,
            seed,
            loop,
            self.placement.host_grad,
            self.placement.host_sq,
            self.placement.sum_over_processes,
            self.device_grads,
        )
        self._step = step
        self.deferred.begin_step()
        try:
            step.losses = []
            for a, micro in enumerate(batch):
                self.deferred.last_micro = a == len(batch) - 1
                step.losses.append(self._forward_backward(micro))
        except BaseException:
            with contextlib.suppress(BaseException):  # the first error is the one raised
                step.close(abandon=True)
            raise
        finally:
            self._step = None
        return step

    def _forward_backward(self, window_np: np.ndarray):
        """Forward and backward of one micro-batch (B, W) of ``data.objective``'s
        windows; its gradients go to ``self._step``. Returns the loss (a device scalar)."""
        L, fns, put = self.num_layers, self.fns, self.placement.put_batch
        objective, T = self.config.data.objective, self.config.train.seq_len
        tokens_np, targets_np = split_window(objective, window_np, T)
        tokens, targets = put(tokens_np), put(targets_np)
        embed, head = self.resident["embed"], self.resident["head"]
        # Blocks first_kept .. L-1 keep their in-block activations from forward to
        # backward (offload.keep_blocks): no boundary, no recompute, no second fetch.
        # Blocks first_swap .. first_kept-1 move theirs to host memory and back
        # (offload.swap_blocks): no boundary, recompute of what their level did not
        # save, their params fetched again. The blocks below store a boundary and
        # recompute their inside.
        off = self.config.offload
        first_kept = L - off.keep_blocks
        first_swap = first_kept - off.swap_blocks
        swap = lambda i: fns.groups[self.group_of[i]].swapped(off.swap_level)
        backward_uses = [self.block_names[i] for i in reversed(range(first_kept))]
        window = self._window(self.block_names + backward_uses)
        boundaries = self.boundaries
        boundaries.begin()

        # each group's input's source (the previous group's output; None for the first),
        # its context, and the sum of its blocks' gradients of the context
        prev: list[Any] = [None] * len(fns.groups)
        context: list[Any] = [()] * len(fns.groups)
        dcontext: list[Any] = [()] * len(fns.groups)
        x = None
        kept: list[Any] = [None] * L  # the kept blocks' vjps (their residuals)
        swapped: list[Any] = [None] * L  # the swapped blocks' residuals, on the host
        stats: list[Any] = [None] * L  # the blocks' auxiliary-loss statistics
        routing: list[Any] = [None] * L  # the routed blocks' decisions (routed.py)
        for i in range(L):
            g = self.group_of[i]
            group = fns.groups[g]
            if i == self.group_start[g]:  # the group's input and context
                prev[g] = x
                x, context[g] = group.input_fwd(embed, x, tokens, targets)  # (B, T, D)
                timeline.watch("compute", "embed fwd" if g == 0 else f"group{g} input", x)
            c = context[g]
            slab = window.get(i)
            if i >= first_kept:
                (x, stats[i]), kept[i] = group.block_fwd_keep(slab, x, c)
            elif i >= first_swap:
                (x, stats[i]), residuals = swap(i).forward(slab, x, c)
                swapped[i] = self.residuals.out(i, i - first_swap, residuals)
                del residuals
            else:
                boundaries.store(i, x)
                if self.block_names[i] in self.routed:
                    x, stats[i], routing[i] = self._routed_forward(
                        self.block_names[i], group, slab, x, c
                    )
                else:
                    x, stats[i] = group.block_fwd(slab, x, c)
            timeline.watch("compute", f"{self.block_names[i]} fwd", x, after=slab)
            del slab  # the window decides when a slab goes; hold no reference past it
            window.done(i, after=x)
            self._account(window, x, kept, swapped, routing, prev, context)

        # the loss is fp32 (fp16 cannot hold scales); put explicitly: a planned transfer
        seed = self.placement.put_scalar(self._step.seed)
        loss, dh, de_head, dx = fns.head_fwd_bwd(head, embed, x, targets, seed)
        dstats = None  # the statistics' cotangent: none without an auxiliary loss
        if fns.stats_size:  # + the blocks' auxiliary loss
            loss, dstats = fns.aux_fwd_bwd(loss, stats, seed)
        del x, stats
        timeline.watch("compute", "head fwd+bwd", (loss, dx))
        self._grad_out("head", *dh)
        self._grad_out("embed", *de_head)
        del dh, de_head

        if first_kept > first_swap:  # the first swapped block's residuals come back
            last = first_kept - 1
            swapped[last] = self.residuals.back(last, last - first_swap, swapped[last])
        next_x = boundaries.load(first_swap - 1) if first_swap == first_kept > 0 else None
        zero_pages: frozenset[int] = frozenset()  # of a routed block's gradient
        for i in reversed(range(L)):
            g = self.group_of[i]
            group, c = fns.groups[g], context[g]
            if i == L - 1 or self.group_of[i + 1] != g:  # the group's last block
                dcontext[g] = group.zero_context(c) if jax.tree.leaves(c) else ()
            if i >= first_kept:
                db, dx, dcontext[g] = group.block_bwd_kept(kept[i], dx, dstats, dcontext[g])
                timeline.watch("compute", f"{self.block_names[i]} bwd", (db, dx), after=kept[i])
                kept[i] = None
            else:
                j = L + first_kept - 1 - i  # position in the window's use order
                slab = window.get(j)
                if i >= first_swap:
                    residuals, swapped[i] = swapped[i], None
                    if i - 1 >= first_swap:  # the next one's come back while this computes
                        swapped[i - 1] = self.residuals.back(
                            i - 1, i - 1 - first_swap, swapped[i - 1]
                        )
                    elif i > 0:  # the first recomputed block's boundary, likewise
                        next_x = boundaries.load(i - 1)
                    db, dx, dcontext[g] = swap(i).backward(
                        slab, residuals, dx, dstats, c, dcontext[g]
                    )
                    watched = (slab, residuals)
                    del residuals
                else:
                    x_in = next_x
                    if i > 0:  # prefetch the next boundary while this block computes
                        next_x = boundaries.load(i - 1)
                    if self.block_names[i] in self.routed:  # its experts copied in again
                        r, routing[i] = routing[i], None
                        fetcher = self.experts[g]
                        fresh = self.deferred.fresh.get(self.block_names[i])
                        held, copied = fetcher.experts(slab, r, fresh)
                        timeline.watch("host_to_device", "experts", copied)
                        db, dx, dcontext[g] = group.routed().backward(
                            held, r.ids_device, r.top_e, r.slots, x_in, dx, dstats, c, dcontext[g]
                        )
                        zero_pages = fetcher.zero_pages(r.ids)
                        del held, copied, r, fetcher
                    else:
                        db, dx, dcontext[g] = group.block_bwd(
                            slab, x_in, dx, dstats, c, dcontext[g]
                        )
                    boundaries.drop(i)
                    watched = (slab, x_in)
                    del x_in
                timeline.watch("compute", f"{self.block_names[i]} bwd", (db, dx), after=watched)
                del slab, watched
                window.done(j, after=dx)
            self._grad_out(self.block_names[i], *db, zero_pages)
            del db
            zero_pages = frozenset()
            self._account(window, dx, kept, swapped, routing, prev, context, dcontext)
            if i == self.group_start[g]:  # the group's input: a gradient of the embed
                de, dx = group.input_bwd(embed, prev[g], tokens, targets, dx, dcontext[g])
                timeline.watch("compute", "embed bwd" if g == 0 else f"group{g} input bwd", de)
                self._grad_out("embed", *de)
                prev[g] = context[g] = dcontext[g] = None
                # (the first group's: the device cache's updates are dispatched by now)
                if g or self.device_stages:
                    self._account(window, dx, de, kept, swapped, prev, context, dcontext)
                del de
        self._step.micro_batch_sent()
        return loss

    def _grad_out(self, name: str, g, sq, zero_pages: frozenset[int] = frozenset()) -> None:
        """Hands a stage's gradient and its pages' squared norms on: summed and updated
        on the device (the device-cached stages in sync mode), or copied to the host and
        handed to the step's gradient thread (nothing here waits for the copy).
        ``zero_pages``: pages known to be zero (a routed block's experts that got no
        token), not copied: the host takes zeros of its own for them."""
        if name in self._device_grad_stages:
            self._step.add_device(name, g)
            return
        self.placement.sent_grad(g, self.layouts[layout_name(name)])
        host = jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), g)
        if zero_pages:
            sent = [k for k in range(len(g)) if k not in zero_pages]
            copied = iter(jax.device_put([g[k] for k in sent], [host[k] for k in sent]))
            on_host = [
                zero_page(p.shape, p.dtype) if k in zero_pages else next(copied)
                for k, p in enumerate(g)
            ]
            watched = [on_host[k] for k in sent]
        else:
            on_host = watched = jax.device_put(g, host)
        timeline.watch("device_to_host", f"{name} grad", watched, after=g)
        self._step.add(name, on_host, sq)

    def _account(self, window, *transients) -> None:
        held = [
            *self.resident.values(),
            *window.cache.values(),
            *self.boundaries.arrays(),
            *self._step.in_flight(),  # gradients on their way to the host
            *transients,
        ]
        if self.device_stages:  # the device cache's params and gradients
            held += self.param_store.device_arrays() + self.loop.device_grads()
            held += list(self._step.device_grads.values())
        staged = self.boundaries.staged_bytes()  # NVMe swap: host RAM outside JAX
        if self.residual_swap is not None:
            staged += self.residual_swap.host_bytes()
        # optimizer state on the device: a running sum (its chunks are many)
        self.ledger.record(held, staged, self.states.device_bytes())
        if self.probe is not None:
            self.probe(self)

    def _metrics(self, step: StepGradients, work, waited: float) -> dict[str, float | int]:
        """The step's report fields: bytes per tier, NVMe I/O, optimizer work."""
        host = self.param_store.host_bytes() + self.states.host_bytes() + step.peak_bytes
        # boundaries in host RAM at their peak during the step (offload.activations)
        host += self.boundaries.peak_host_bytes
        read, written = self.io.take()
        metrics = {
            "device_bytes_peak": int(self.ledger.peak.get("device", 0)),
            "host_bytes": int(host),
            "nvme_bytes": int(self.io.nvme_bytes),
            "optimizer_s": waited,  # optimizer time the step waited for
            # the dispatching thread's time in forward and backward not spent dispatching
            "dispatch_outside_s": step.dispatch_outside_s,
            "dispatch_handoff_wait_s": step.handoff_wait_s,  # of it, the hand-off full
            "grad_copy_wait_s": step.copy_wait_s,  # the gradient thread's waits ...
            "grad_loop_wait_s": step.loop_wait_s,  # ... for copies, for the optimizer
            "optimizer_busy_s": work.busy_s,  # time the loop worked (overlapped or not)
            "optimizer_params": work.params,  # parameters updated (padded slabs, redos too)
            "optimizer_device_params": work.device_params,  # of the device cache
            "nvme_read_bytes": int(read),
            "nvme_write_bytes": int(written),
            "optimizer_redo": work.redo,
            "optimizer_deferred": work.deferred,
            **self.placement.step_metrics(),
            **(self.experts.take() if self.experts else {}),
            **self.deferred.take(),
        }
        if self.config.optimizer.mode == "lockfree":
            metrics["optimizer_lag_steps"] = self.loop.unapplied
        return metrics

    # -- evaluation and state -----------------------------------------------------------

    def eval_loss(self, batch: np.ndarray) -> float:
        put = self.placement.put_batch
        objective, T = self.config.data.objective, self.config.train.seq_len
        tokens, targets = (put(a) for a in split_window(objective, batch, T))
        window = self._window(self.block_names)
        embed, head = self.resident["embed"], self.resident["head"]
        x, context = None, ()
        stats = [None] * self.num_layers
        for i in range(self.num_layers):
            group = self.fns.groups[self.group_of[i]]
            if i == self.group_start[self.group_of[i]]:
                x, context = group.input_fwd(embed, x, tokens, targets)
            if self.block_names[i] in self.routed:
                name = self.block_names[i]
                x, stats[i], _ = self._routed_forward(name, group, window.get(i), x, context)
            else:
                x, stats[i] = group.block_fwd(window.get(i), x, context)
            window.done(i, after=x)
        loss = self.fns.head_loss(head, embed, x, targets)
        if self.fns.stats_size:  # + the blocks' auxiliary loss
            loss = self.fns.aux_fwd_bwd(loss, stats, self.placement.put_scalar(1.0))[0]
        return float(loss)

    def flush_deferred(self) -> None:
        """Catches up every deferred expert update and refreshes the params' copies."""
        pages_of = lambda s: self.optimizer.compute_pages(layout_name(s), self.states.master(s))
        self.deferred.flush(self.param_store, pages_of)

    def params(self) -> Any:
        """The fp32 master params as the model's pytree (host numpy)."""
        self.flush_deferred()
        return state_io.master_params(
            self.stage_names, self.layouts, self.states, self.placement.whole_slab
        )

    def plan_lines(self) -> list[str]:
        """The start-up plans, for the log."""
        return setup.describe_plans(
            self.placement.describe(self.layouts), self.plan, self.host_plan,
            self.device_stages, self.nvme_dir, self.config.offload,
        ) + fallbacks(self.config)  # fmt: skip

    def settle(self) -> None:
        if self.config.optimizer.mode == "lockfree":
            self.loop.drain()
            self._refresh_resident()
        self.flush_deferred()
        self.states.flush()

    def save_state(self) -> StateSource:
        """This process's committed state, taken where it lives: the checkpoint writes
        it (or hard-links its NVMe files) stage by stage, no copy in RAM."""
        if self.config.optimizer.mode == "lockfree":  # apply what is buffered first
            self.loop.drain()
            self._refresh_resident()
        self.flush_deferred()  # the checkpoint is exact
        ls = self.loss_scale
        loss_scale = (float(ls.scale), int(ls.good_steps)) if ls is not None else None
        return state_io.source(
            self.stage_names, self.layouts, self.states, self.placement.own_pages, loss_scale
        )

    def load_state(self, state: RuntimeState | StoredState) -> None:
        """Replaces every stage's state and params (the loop is idle between steps;
        lock-free mode is drained first)."""
        if sorted(state.kinds) != sorted(self.optimizer.kinds):
            raise ConfigError(
                f"the checkpoint holds the state kinds {state.kinds}, this run's optimizer "
                f"(optimizer.name={self.config.optimizer.name}) needs "
                f"{self.optimizer.kinds}: resume with the optimizer settings that wrote it, "
                "or start over with a new --workdir"
            )
        if self.config.optimizer.mode == "lockfree":
            self.loop.drain()
        self.loop.reload()
        self.deferred.committed()  # (the restore republished every stage)
        what = f"restoring state ({self.config.offload.optimizer})"
        stages = setup.progress(self.stage_names, what)
        state_io.restore(
            state, stages, self.layouts, self._opt_of, self.placement.own_pages, self.states,
            self.param_store,
        )  # fmt: skip
        if self.loss_scale is not None and state.loss_scale is not None:
            self.loss_scale = self.loss_scale.replace(
                scale=jnp.float32(state.loss_scale[0]), good_steps=jnp.int32(state.loss_scale[1])
            )
        self._refresh_resident()
        self.io.mark()  # the restore's writes are no step's

    def close(self) -> None:
        self.loop.close()
        self.param_store.close()  # its read-ahead for a next step: landed, dropped
        if self.swap is not None:
            self.swap.close()
        if self.residual_swap is not None:
            self.residual_swap.close()
        if self.nvme_dir is not None and self._temporary_nvme:
            shutil.rmtree(self.nvme_dir, ignore_errors=True)
