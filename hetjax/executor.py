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
device or on the host (``offload.activations``), and sends each stage's gradient slab to
the host as soon as its backward is dispatched. After backward the host optimizer
updates every stage and refreshes the host param slabs for the next step.

``memory.device_budget`` bounds what the executor holds on the device; the plan is made
at start-up (:func:`plan_device_memory`) and the ledger records what it really held.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import Config, ConfigError, format_bytes
from hetjax.host_optimizer import HostOptimizer
from hetjax.pages import SlabLayout
from hetjax.placement import Placement
from hetjax.train import LossScale, StepStats
from models import build_model

F32 = jnp.float32


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
    working_set: int  # XLA temporaries of the largest stage function, plus x / dx
    required: int  # the total with this window

    def describe(self) -> str:
        return (
            f"device plan: prefetch depth {self.prefetch_depth}, {self.resident_blocks} "
            f"resident blocks; embed+head {format_bytes(self.embed_head)}, block slab "
            f"{format_bytes(self.block_slab)}, checkpoints {format_bytes(self.checkpoints)}, "
            f"gradients {format_bytes(self.gradients)}, working set "
            f"{format_bytes(self.working_set)}; total {format_bytes(self.required)}"
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
) -> DeviceMemoryPlan:
    """Chooses the deepest prefetch window (up to ``requested_depth``) that fits the
    budget, then keeps as many blocks resident as the rest allows. Raises
    ``ConfigError`` with the numbers when not even one stage and its activations fit."""
    gradients = 2 * grad_slab  # one being produced, one in transfer to the host
    fixed = embed_head + checkpoints + gradients + working_set

    def total(depth: int, resident: int) -> int:
        window = min(depth + 1, num_layers - resident)
        return fixed + (window + resident) * block_slab

    if budget and total(0, 0) > budget:
        need = total(0, 0)
        raise ConfigError(
            f"memory.device_budget {format_bytes(budget)} cannot hold one stage plus its "
            f"activations in device memory: that needs {format_bytes(need)} (embed+head "
            f"{format_bytes(embed_head)}, one block slab {format_bytes(block_slab)}, "
            f"activation checkpoints {format_bytes(checkpoints)}, gradient slabs "
            f"{format_bytes(gradients)}, working set {format_bytes(working_set)}); short by "
            f"{format_bytes(need - budget)}. Raise memory.device_budget, set "
            "offload.activations=host, or lower train.batch_size / raise train.grad_accum"
        )
    depth = requested_depth
    while budget and depth > 0 and total(depth, 0) > budget:
        depth -= 1
    resident = 0
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
        working_set,
        total(depth, resident),
    )


class Ledger:
    """Bytes held per memory kind, recomputed from the executor's own containers at every
    dispatch, with the peak per kind."""

    def __init__(self):
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = collections.defaultdict(int)

    def record(self, arrays) -> None:
        totals: dict[str, int] = collections.defaultdict(int)
        seen = set()
        for a in jax.tree.leaves(arrays):
            if id(a) in seen:
                continue
            seen.add(id(a))
            totals[a.sharding.memory_kind or "device"] += a.nbytes
        self.current = dict(totals)
        for kind, n in totals.items():
            self.peak[kind] = max(self.peak[kind], n)

    def reset_peak(self) -> None:
        self.peak = collections.defaultdict(int)


class StreamingRuntime:
    """Trains with params on the host, streamed a stage at a time through the device."""

    def __init__(self, config: Config, probe=None):
        self.config = config
        self.model = build_model(config.model)
        self.place = Placement.single_device()
        self.compute_dtype = jnp.dtype(config.model.compute_dtype)
        self.num_layers = L = config.model.num_layers
        self.probe = probe  # called after every dispatch (tests sample live memory)
        self.ledger = Ledger()
        t = config.train

        page = config.memory.page_size
        shapes = jax.eval_shape(self.model.init, jax.random.key(0))
        one_block = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"]
        )
        self.layouts = {
            "embed": SlabLayout.from_params(shapes["embed"], page),
            "block": SlabLayout.from_params(one_block, page),
            "head": SlabLayout.from_params(shapes["head"], page),
        }
        self.block_names = [f"block{i}" for i in range(L)]
        self.stage_names = ["embed", *self.block_names, "head"]

        self.optimizer = HostOptimizer(
            config.optimizer, t.steps, self.layouts, self.place.optimizer, self.compute_dtype
        )
        self._init_params(jax.random.key(t.seed))
        self.host_pages = {
            n: jax.device_put(self.optimizer.compute_pages(n, self.layout_name(n)), self.place.host)
            for n in self.stage_names
        }
        self._build_stage_functions()
        self.plan = self._plan_memory()
        self.prefetch_depth = self.plan.prefetch_depth
        self.resident: dict[str, jax.Array] = {}
        self._refresh_resident()
        self.optimizer_s = 0.0
        self.loss_scale = (
            LossScale.create(t.loss_scale_init, t.loss_scale_period)
            if config.model.compute_dtype == "float16"
            else None
        )

    @staticmethod
    def layout_name(stage: str) -> str:
        return "block" if stage.startswith("block") else stage

    # -- set-up -------------------------------------------------------------------------

    def _init_params(self, rng: jax.Array) -> None:
        """Initialises each stage straight into the optimizer's memory as an fp32 slab;
        the same keys as ``model.init``, so the params equal the in-memory runtime's."""
        keys = self.model.stage_keys(rng)
        for name in self.stage_names:
            kind = self.layout_name(name)
            layout = self.layouts[kind]
            key = keys["blocks"][int(name[5:])] if kind == "block" else keys[kind]
            init = jax.jit(
                lambda k, kind=kind, layout=layout: layout.flatten(self.model.init_stage(kind, k)),
                out_shardings=self.place.optimizer,
            )
            self.optimizer.set_master(name, kind, init(key))

    def _build_stage_functions(self) -> None:
        E, B, H = self.layouts["embed"], self.layouts["block"], self.layouts["head"]
        m = self.model
        dev = self.place.device

        def embed_fwd(e, tokens):  # (B, T) -> (B, T, D)
            return m.embed(E.unflatten_pages(e), tokens)

        def block_fwd(b, x):  # (B, T, D) -> (B, T, D)
            return m.block(B.unflatten_pages(b), x)

        def head_loss(h, e, x, targets):
            return m.head_loss(H.unflatten_pages(h), E.unflatten_pages(e), x, targets)

        def head_fwd_bwd(h, e, x, targets, scale):
            loss, vjp = jax.vjp(lambda h, e, x: head_loss(h, e, x, targets), h, e, x)
            dh, de, dx = vjp(scale)  # scale: the fp16 loss scale, else 1
            return loss, _to_f32(dh), _to_f32(de), dx

        def block_bwd(b, x, dy):  # recompute the block's inside, then its vjp
            _, vjp = jax.vjp(block_fwd, b, x)
            db, dx = vjp(dy)
            return _to_f32(db), dx

        def embed_bwd(e, tokens, dx):
            _, vjp = jax.vjp(lambda e: embed_fwd(e, tokens), e)
            return _to_f32(vjp(dx)[0])

        self._embed_fwd = jax.jit(embed_fwd, out_shardings=dev)
        self._block_fwd = jax.jit(block_fwd, out_shardings=dev)
        self._head_loss = jax.jit(head_loss, out_shardings=dev)
        self._head_fwd_bwd = jax.jit(head_fwd_bwd, out_shardings=dev)
        self._block_bwd = jax.jit(block_bwd, out_shardings=dev)
        self._embed_bwd = jax.jit(embed_bwd, out_shardings=dev)

    def _plan_memory(self) -> DeviceMemoryPlan:
        cfg, t = self.config, self.config.train
        B, T, D = t.micro_batch_size, t.seq_len, cfg.model.d_model
        sds = jax.ShapeDtypeStruct
        slab = lambda n: (
            [sds((self.layouts[n].page_elems,), self.compute_dtype)] * (self.layouts[n].num_pages)
        )
        x = sds((B, T, D), self.compute_dtype)
        act = B * T * D * self.compute_dtype.itemsize
        # XLA's temporaries of the largest stage function, measured by compiling it.
        temps = []
        for fn, args in (
            (self._block_bwd, (slab("block"), x, x)),
            (
                self._head_fwd_bwd,
                (
                    slab("head"),
                    slab("embed"),
                    x,
                    sds((B, T), jnp.int32),
                    sds((), F32),
                ),
            ),
            (self._embed_bwd, (slab("embed"), sds((B, T), jnp.int32), x)),
        ):
            analysis = fn.lower(*args).compile().memory_analysis()
            temps.append(getattr(analysis, "temp_size_in_bytes", 0) if analysis else 0)
        on_device_ckpts = cfg.offload.activations == "device"
        return plan_device_memory(
            budget=cfg.memory.device_budget,
            num_layers=self.num_layers,
            requested_depth=cfg.offload.prefetch_depth,
            embed_head=self.layouts["embed"].nbytes(self.compute_dtype)
            + self.layouts["head"].nbytes(self.compute_dtype),
            block_slab=self.layouts["block"].nbytes(self.compute_dtype),
            grad_slab=max(self.layouts[n].nbytes(F32) for n in ("block", "embed")),
            checkpoints=(self.num_layers if on_device_ckpts else 2) * act,
            working_set=max(temps) + 3 * act,
        )

    def _refresh_resident(self) -> None:
        """Copies the always-resident stages (embed, head, the first resident blocks)
        to the device; called after each optimizer step."""
        names = ["embed", "head", *self.block_names[: self.plan.resident_blocks]]
        self.resident = {}
        for n in names:
            self.resident[n] = jax.device_put(self.host_pages[n], self.place.device)

    # -- the step -----------------------------------------------------------------------

    def train_step(self, batch: np.ndarray) -> StepStats:
        """One optimizer step on a global batch (A, B/A, T+1)."""
        A = batch.shape[0]
        scale = float(self.loss_scale.scale) if self.loss_scale is not None else 1.0
        grads: dict[str, np.ndarray] = {}
        self.ledger.reset_peak()
        losses = [self._forward_backward(micro, grads, scale) for micro in batch]
        loss = float(np.mean([float(v) for v in losses]))

        for name in self.stage_names:  # mean over micro-batches, loss scale removed
            grads[name] /= A * scale
        grad_norm = float(np.sqrt(sum(float(np.dot(g, g)) for g in grads.values())))
        finite = np.isfinite(grad_norm)
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.update(jnp.bool_(finite))
        self.optimizer_s = 0.0
        if finite or self.loss_scale is None:
            t0 = time.perf_counter()
            for name in self.stage_names:
                compute = self.optimizer.update(
                    name, self.layout_name(name), grads[name], grad_norm
                )
                self.host_pages[name] = jax.device_put(compute, self.place.host)
            # The next forward needs these pages anyway: waiting here costs nothing and
            # times the optimizer phase.
            jax.block_until_ready(self.host_pages)
            self.optimizer_s = time.perf_counter() - t0
            self._refresh_resident()
        return StepStats(loss, grad_norm, not finite and self.loss_scale is not None, scale)

    def _forward_backward(self, tokens_np: np.ndarray, grads: dict, scale: float):
        """Forward and backward of one micro-batch (B, T+1); adds its gradient slabs into
        ``grads`` (host, fp32). Returns the loss (a device scalar)."""
        dev, L = self.place.device, self.num_layers
        tokens = jax.device_put(tokens_np[:, :-1], dev)
        targets = jax.device_put(tokens_np[:, 1:], dev)
        embed, head = self.resident["embed"], self.resident["head"]
        window = _Window(self, self.block_names + self.block_names[::-1])
        pending: collections.deque = collections.deque()  # grads in flight to the host

        x = self._embed_fwd(embed, tokens)  # (B, T, D)
        ckpts: list[Any] = [None] * L
        for i in range(L):
            slab = window.get(i)
            ckpts[i] = self._store_checkpoint(x)
            x = self._block_fwd(slab, x)
            del slab  # the window decides when a slab goes; hold no reference past it
            window.done(i)
            self._account(window, ckpts, pending, x)

        loss, dh, de_head, dx = self._head_fwd_bwd(
            head,
            embed,
            x,
            targets,
            jnp.asarray(scale, F32),  # the loss is fp32; fp16 cannot hold large scales
        )
        del x
        self._send_grad("head", dh, pending, grads)
        self._send_grad("embed", de_head, pending, grads)
        del dh, de_head

        next_ckpt = self._load_checkpoint(ckpts[L - 1])
        for i in reversed(range(L)):
            j = 2 * L - 1 - i  # position in the window's use order
            slab, x_in = window.get(j), next_ckpt
            if i > 0:  # prefetch the next checkpoint while this block computes
                next_ckpt = self._load_checkpoint(ckpts[i - 1])
            db, dx = self._block_bwd(slab, x_in, dx)
            ckpts[i] = None
            del x_in, slab
            window.done(j)
            self._send_grad(self.block_names[i], db, pending, grads)
            del db
            self._account(window, ckpts, pending, dx)

        de = self._embed_bwd(embed, tokens, dx)
        self._send_grad("embed", de, pending, grads)
        while pending:
            self._drain(pending, grads)
        return loss

    def _store_checkpoint(self, x: jax.Array) -> jax.Array:
        if self.config.offload.activations == "host":
            return jax.device_put(x, self.place.host)
        return x

    def _load_checkpoint(self, ckpt: jax.Array) -> jax.Array:
        return jax.device_put(ckpt, self.place.device)  # a no-op when already there

    def _send_grad(self, name: str, g: jax.Array, pending, grads) -> None:
        """Starts the device-to-host copy of a gradient slab; accumulates older ones."""
        pending.append((name, jax.device_put(g, self.place.host)))
        while len(pending) > 2:
            self._drain(pending, grads)

    @staticmethod
    def _drain(pending, grads) -> None:
        name, g = pending.popleft()
        # Waits for this slab's backward and transfer only.
        g = np.concatenate([np.asarray(page) for page in g])  # a new, owned buffer
        if name in grads:
            grads[name] += g
        else:
            grads[name] = g

    def _account(self, window, ckpts, pending, *transients) -> None:
        held = [
            *self.resident.values(),
            *window.cache.values(),
            *ckpts,
            *(g for _, g in pending),
            *transients,
        ]
        self.ledger.record(held)
        if self.probe is not None:
            self.probe(self)

    # -- evaluation and state -----------------------------------------------------------

    def eval_loss(self, batch: np.ndarray) -> float:
        dev = self.place.device
        tokens = jax.device_put(batch[:, :-1], dev)
        targets = jax.device_put(batch[:, 1:], dev)
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
            self.layouts[self.layout_name(name)].unflatten(np.asarray(self.optimizer.master[name])),
        )
        blocks = [unflat(n) for n in self.block_names]
        return {
            "embed": unflat("embed"),
            "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks),
            "head": unflat("head"),
        }

    def extra_metrics(self) -> dict[str, Any]:
        host = sum(a.nbytes for a in jax.tree.leaves(self.host_pages)) + self.optimizer.nbytes()
        return {
            "device_bytes_peak": int(self.ledger.peak.get("device", 0)),
            "host_bytes": int(host),
            "optimizer_s": self.optimizer_s,  # host optimizer phase of the step
        }


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
            self.cache[name] = jax.device_put(self.rt.host_pages[name], self.rt.place.device)
        return self.cache[name]

    def get(self, j: int) -> jax.Array:
        slab = self._fetch(self.uses[j])
        for k in range(j + 1, min(j + 1 + self.depth, len(self.uses))):
            self._fetch(self.uses[k])
        return slab

    def done(self, j: int) -> None:
        name = self.uses[j]
        if name not in self.uses[j + 1 : j + 1 + max(self.depth, 1)]:
            self.cache.pop(name, None)
