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

How each block runs is its strategy's (``blocks.py``: recomputed, routed, swapped or
kept, and each group's input), holding its own state from forward to backward; the
per-layer loop walks the schedule worked out at start-up (``schedule.py``: each block's
kind and uses of the window). The runtime's parts (stores, plans, update loop,
strategies) are built in order by ``assemble.assemble``.

The access order is known, so :class:`~hetjax.runtime.loop.window.PrefetchWindow` copies the
next ``offload.prefetch_depth`` slabs in while the current stage computes (JAX's async
dispatch overlaps them) and drops each slab after its last use. Block-boundary
activations (*boundaries*) stay on the device, go to host RAM, or are swapped through
host RAM to NVMe (``offload.activations``, ``storage/swap.py``). Each stage's gradient
goes to the host as soon as its backward is dispatched, with its squared norm from the
backward itself; this thread only dispatches, the step's gradient thread takes the
gradient from there (:class:`~hetjax.runtime.loop.grads.StepGradients`); the host optimizer
loop (``optimizer/update_loop.py``) updates the stage as soon as its final gradient is
there, reading its pages where they landed, while backward goes on, and refreshes the
param slabs for the next step.

With ``offload.optimizer_device_stages = N`` (host or NVMe optimizer) the first N stages
in forward order are a device cache of optimizer state (Angel-PTM): their state and
params live on the device, those blocks are resident, their gradient is summed,
averaged and normed on the device and their update dispatched there
(``UpdateLoop.submit_device``).

Where a stage's pages live and how a stage function is compiled is the run's
parallelism's (``types.Parallelism``: ``parallel/single.py``, one device;
``parallel/zero.py``, ZeRO-3 over a mesh), handed to the runtime. What the runtime may
hold in each tier is the memory model's (``hetjax/memory.py``): the plans are made at
start-up and the ledger records what the step really held (``ledger.py``: what is held
for long is added and removed as it comes and goes, so a dispatch's record walks only
what is held briefly).
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

from hetjax import timeline
from hetjax.checkpoint_state import StateSource, StoredState
from hetjax.config import Config, ConfigError
from hetjax.data import split_window
from hetjax.nvme_copies import nvme_copies
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.parallel.single import SingleDevice
from hetjax.runtime import setup, state_io
from hetjax.runtime.assemble import assemble
from hetjax.runtime.loop.grads import StepGradients, to_host
from hetjax.runtime.loop.step_report import step_report
from hetjax.runtime.loop.window import PrefetchWindow
from hetjax.runtime.setup import layout_name
from hetjax.support import fallbacks
from hetjax.types import LossScale, RuntimeState, StepReport

F32 = jnp.float32


class StreamingRuntime:
    """Trains with params on the host, streamed a stage at a time through the device.
    ``parallel``: how devices split the run, placing pages and compiling stage functions
    (``types.Parallelism``; default: one device); ``probe``: called after every dispatch
    (tests sample live memory). Its parts (``assemble.Parts``: stores, plans, update loop,
    block strategies) are built by ``assemble.assemble`` and are its attributes of the same
    names."""

    def __init__(
        self, config: Config, probe=None, workdir: str | Path | None = None, parallel=None
    ):
        parts = assemble(config, parallel or SingleDevice(), workdir)
        for field in dataclasses.fields(parts):
            setattr(self, field.name, getattr(parts, field.name))
        self.probe = probe
        self.resident: dict[str, jax.Array] = {}
        self._refresh_resident()
        self.io.mark()  # NVMe I/O per step: initialisation's reads and writes are no step's
        self._step: StepGradients | None = None
        t, fp16 = config.train, config.model.compute_dtype == "float16"
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
        for n in self.resident:
            self.ledger.release(("resident", n))
        self.resident = {}
        for n in names:
            self.resident[n] = self._to_device(n, self.param_store.get(n))
            self.ledger.hold(("resident", n), self.resident[n])
            if n not in self.device_stages:
                timeline.watch("host_to_device", n, self.resident[n])

    def _to_device(self, stage: str, slab):
        """A stage's params from the param store -> as its functions compute with them
        (a routed block: its leaves but the experts, ``routed.RoutedSlab``)."""
        if stage in self.routed:
            return self.experts[self.stage_group[stage]].dense(slab)
        return self.parallel.to_device(slab, self.layouts[layout_name(stage)])

    def _window(self, uses: list[str]) -> PrefetchWindow:
        return PrefetchWindow(
            uses, self.plan.prefetch_depth, self.resident, self.param_store, self._to_device,
            keep=self.host_plan.kept_param_blocks, lag=self.plan.wait_lag,
        )  # fmt: skip

    # -- the step -----------------------------------------------------------------------

    def train_step(
        self,
        batch: np.ndarray,
        poison: bool = False,
        loss_limit: float = math.inf,
        loss_gain: float = 1.0,
    ) -> StepReport:
        """One optimizer step on a global batch (A, B/A, T+1) (``loss_limit``,
        ``loss_gain``: :meth:`hetjax.types.Runtime.train_step`).

        Sync mode: the last micro-batch's backward hands each stage's final gradient to
        the optimizer loop as it reaches the host, so the update of block i runs while
        blocks i-1 .. 0 are still in backward; then the step waits for the loop to commit.
        Lock-free mode: the gradients go to the loop's accumulator and the step returns.
        """
        scale = float(self.loss_scale.scale) if self.loss_scale is not None else 1.0
        sync = self.config.optimizer.mode == "sync"
        if not sync:  # pick up whatever the loop has published since the last step
            self._refresh_resident()
        self.ledger.begin_step(probed=self.probe is not None)
        self.boundaries.reset_peak()
        if self.experts:  # the step's count starts here (not an evaluation's)
            self.experts.take()
        step = self._gradients(batch, scale, poison, self.loop if sync else None)
        loss = float(np.mean([float(v) for v in step.losses])) * loss_gain
        grad_norm = step.norm()
        # A non-finite step updates nothing: its speculative updates are dropped (stages
        # after the first non-finite gradient were never submitted, see StepGradients).
        # Nor does a loss spike, though the loss scale counts it as a finite step.
        finite = bool(np.isfinite(grad_norm)) and bool(np.isfinite(loss))
        spike = finite and loss > loss_limit
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.update(jnp.bool_(finite))
        t0 = time.perf_counter()
        if sync:
            work = self.loop.finish(grad_norm, finite and not spike)
            self.deferred.committed()
            self._refresh_resident()
        else:
            if finite and not spike:
                self.loop.submit_step(step.grads)
            work = self.loop.collect()
        waited = time.perf_counter() - t0  # optimizer time not hidden by backward
        fp16_overflow = not finite and self.loss_scale is not None and scale > 1
        return StepReport(
            loss,
            grad_norm,
            not finite or spike,
            scale,
            nonfinite=not finite and not fp16_overflow,
            spike=spike,
            metrics=step_report(self, step, work, waited),
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
            groups=len(self.model.groups),
            micro_batches=batch.shape[0],
            scale=scale,
            seed=seed,
            loop=loop,
            host_grad=self.parallel.host_grad,
            host_sq=self.parallel.host_sq,
            sum_over_processes=self.parallel.sum_over_processes,
            device=self.device_grads,
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
        windows; its gradients go to ``self._step``. Returns the loss (a device scalar).
        The blocks run as their strategies (``blocks.py``) in the schedule's order
        (``schedule.py``)."""
        tokens, targets = self._batch(window_np)
        window = self._window(self.schedule.uses)
        self.boundaries.begin()
        try:
            x, stats = self._forward(window, tokens, targets, training=True)
            loss, dx, dstats = self._head(x, stats, targets)
            del x, stats
            self._backward(window, dx, dstats, tokens, targets)
        finally:  # (a pass that failed leaves no state behind; one that ran, none anyway)
            for part in (*self.blocks, *self.inputs):
                part.reset()
        self._step.micro_batch_sent()
        return loss

    def _batch(self, window_np: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """A micro-batch's windows (B, W) -> tokens and targets on the device."""
        objective, T = self.config.data.objective, self.config.train.seq_len
        return tuple(self.parallel.put_batch(a) for a in split_window(objective, window_np, T))

    def _forward(self, window, tokens, targets, training: bool) -> tuple[Any, list]:
        """Every block's forward in order (each group's input before its first block);
        ``training``: each block keeps what its backward needs (else an evaluation's,
        which keeps nothing). -> (the last block's output (B, T, D), the blocks'
        auxiliary-loss statistics)."""
        embed = self.resident["embed"]
        x, stats = None, []
        for slot, block in zip(self.schedule.blocks, self.blocks, strict=True):
            group = self.inputs[slot.group]
            if slot.group_first:  # the group's input and context
                x = group.forward(embed, x, tokens, targets, keep=training)  # (B, T, D)
            slab = window.get(slot.forward_use)
            if training:
                x, s = block.forward(slab, x, group.context, training)
            else:
                x, s = block.evaluate(slab, x, group.context)
            stats.append(s)
            timeline.watch("compute", f"{slot.name} fwd", x, after=slab)
            del slab  # the window decides when a slab goes; hold no reference past it
            window.done(slot.forward_use, after=x)
            if training:
                self._account(window, x)
        return x, stats

    def _head(self, x, stats, targets):
        """The head's forward and backward (and the auxiliary loss's): its gradient and
        the embed's (tied head) go out. -> (loss, dx (B, T, D), the statistics'
        cotangent: None without an auxiliary loss)."""
        fns = self.fns
        # the loss is fp32 (fp16 cannot hold scales); put explicitly: a planned transfer
        seed = self.parallel.put_scalar(self._step.seed)
        embed, head = self.resident["embed"], self.resident["head"]
        loss, dh, de_head, dx = fns.head_fwd_bwd(head, embed, x, targets, seed)
        dstats = None
        if fns.stats_size:  # + the blocks' auxiliary loss
            loss, dstats = fns.aux_fwd_bwd(loss, stats, seed)
        timeline.watch("compute", "head fwd+bwd", (loss, dx))
        self._grad_out("head", *dh)
        self._grad_out("embed", *de_head)
        return loss, dx, dstats

    def _backward(self, window, dx, dstats, tokens, targets) -> None:
        """Every block's backward in reverse order, each group's input's after its
        first block's; a streamed block's backward inputs come back to the device while
        the block after it computes (``BlockSlot.restore_ahead``)."""
        embed = self.resident["embed"]
        if self.schedule.restore_first is not None:
            self.blocks[self.schedule.restore_first].restore()
        for slot in self.schedule.backward:
            block, group = self.blocks[slot.index], self.inputs[slot.group]
            if slot.group_last:
                group.begin_backward()
            use, slab = slot.backward_use, None
            if use is not None:
                slab = window.get(use)
            db, dx, group.dcontext = block.backward(slab, dx, dstats, group.context, group.dcontext)
            del slab
            if use is not None:
                # while this block computes, dispatched first: the load (and a swap's
                # wait for its read) queues behind the compute, not in front of it
                if slot.restore_ahead is not None:
                    self.blocks[slot.restore_ahead].restore()
                window.done(use, after=dx)
            self._grad_out(slot.name, *db)
            del db
            self._account(window, dx)
            if slot.group_first:  # the group's input: a gradient of the embed
                de, dx = group.backward(embed, tokens, targets, dx)
                self._grad_out("embed", *de)
                # (the first group's: the device cache's updates are dispatched by now)
                if slot.group or self.device_stages:
                    self._account(window, dx, de)
                del de

    def _grad_out(self, name: str, g, sq, zero_pages: frozenset[int] = frozenset()) -> None:
        """Hands a stage's gradient and its pages' squared norms on: summed and updated
        on the device (the device-cached stages in sync mode), or copied to the host and
        handed to the step's gradient thread (nothing here waits for the copy).
        ``zero_pages``: pages known to be zero (a routed block's experts that got no
        token), not copied: the host takes zeros of its own for them."""
        if name in self.device_grad_stages:
            self._step.add_device(name, g)
            return
        self.parallel.sent_grad(g, self.layouts[layout_name(name)])
        on_host, copied = to_host(g, zero_pages)
        timeline.watch("device_to_host", f"{name} grad", copied, after=g)
        self._step.add(name, on_host, sq)

    def _account(self, window, *transients) -> None:
        """Records what the device and host hold after a dispatch (``ledger.Ledger``:
        what is held for long is held there already; this walks what is held briefly),
        then calls the probe. Only in an accounted step (``Ledger.begin_step``)."""
        if not self.ledger.accounting:
            return
        held = [
            *window.cache.values(),
            *self._step.in_flight(),  # gradients on their way to the host
            *transients,
            *(group.state() for group in self.inputs),
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

    # -- evaluation and state -----------------------------------------------------------

    def eval_loss(self, batch: np.ndarray) -> float:
        tokens, targets = self._batch(batch)
        window = self._window(self.schedule.forward_uses)
        try:
            x, stats = self._forward(window, tokens, targets, training=False)
        finally:
            for group in self.inputs:
                group.reset()
        loss = self.fns.head_loss(self.resident["head"], self.resident["embed"], x, targets)
        if self.fns.stats_size:  # + the blocks' auxiliary loss
            loss = self.fns.aux_fwd_bwd(loss, stats, self.parallel.put_scalar(1.0))[0]
        return float(loss)

    def flush_deferred(self) -> None:
        """Catches up every deferred expert update and refreshes the params' copies."""
        pages_of = lambda s: self.optimizer.compute_pages(layout_name(s), self.states.master(s))
        self.deferred.flush(self.param_store, pages_of)

    def params(self) -> Any:
        """The fp32 master params as the model's pytree (host numpy)."""
        self.flush_deferred()
        return state_io.master_params(
            self.stage_names, self.layouts, self.states, self.parallel.whole_slab
        )

    def plan_lines(self) -> list[str]:
        """The start-up plans, for the log."""
        copies = nvme_copies(self.config)
        copy = (self.states.nvme_bytes + self.param_store.nvme_bytes) // copies.count
        return setup.describe_plans(
            self.parallel.describe(self.layouts), self.plan, self.host_plan,
            self.device_stages, self.nvme_dir, self.config.offload,
            copies, copy,
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
            self.stage_names, self.layouts, self.states, self.parallel.own_pages, loss_scale,
            self.optimizer.state_format, self.optimizer.values,
        )  # fmt: skip

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
            state, stages, self.layouts, self._opt_of, self.parallel.own_pages, self.states,
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
        if self.nvme_dir is not None and self.temporary_nvme:
            shutil.rmtree(self.nvme_dir, ignore_errors=True)
