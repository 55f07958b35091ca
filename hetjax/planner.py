"""The planner: decides where every kind of training state lives, from the model's shapes,
the machine (a profile from ``hetjax/hardware.py``, or measured) and the budgets.

    python -m hetjax.launch --config gpt175b --plan --hardware a100-80g

A :class:`Workload` is the model and batch as the planner sees them (stage sizes,
activation sizes, FLOPs, and stage times: measured by :func:`trace` on this machine, or
derived from the profile's FLOP/s). :func:`make_plan` evaluates every placement the
runtimes implement and returns the fastest :class:`Plan` that fits every tier:

* ``offload.mode=none`` (all state on the device, with or without ``model.remat``), or
* ``offload.mode=stream`` with compute-dtype params on the host or NVMe, fp32 master and
  optimizer state on the device, host or NVMe (NVMe state cached in spare host RAM by
  next use), block-boundary activation checkpoints on the device, host or NVMe (through
  a few host buffers: Fuyou's SSD-CPU-GPU activation swap), a prefetch depth, blocks
  kept resident on the device (fewer copies) and blocks that keep their in-block
  activations from forward to backward instead of recomputing them
  (``offload.keep_blocks``: Fuyou's swap-instead-of-recompute), all of them or only
  those of the best swap benefit factor (``offload.keep_level``, hetjax/remat.py),
  and, with the optimizer on the host or NVMe, a device cache of the optimizer state of
  the first stages (``offload.optimizer_device_stages``, Angel-PTM section 4.2): the
  stages the device memory left after everything else holds, updated there at device
  speed with no gradient copy (:func:`_cache_variants` says how residency and the
  cache share that memory).

The cost model is Fuyou's (section 4.5, equations 1-8) extended to our tiers: a step is
its forward phase plus its backward phase; each phase takes the longest of its lanes
(device compute, host->device, device->host, NVMe, the host optimizer overlapped with
the last micro-batch's backward, collectives). On the CPU backend the "device", the
copies and the host optimizer share the same cores, so their times add there, and so
do data-parallel devices' (``Hardware.shared_cores``). Memory per tier follows the
runtimes' own accounting (``executor.plan_device_memory``,
``state_store.plan_host_memory``), so a plan that fits here fits there.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any

from hetjax.config import Config, ConfigError, format_bytes
from hetjax.gradients import in_flight_slabs
from hetjax.hardware import Hardware

IO_READAHEAD = 2  # as hetjax.executor (stages or checkpoints read from NVMe ahead of use)
MARGIN = 0.9  # of a tier's capacity the planner may use when no budget is given
ADAM_BYTES = 28  # bytes a device-side AdamW moves per parameter (reads and writes)


class PlanError(ConfigError):
    """The configuration cannot fit the hardware; the message names the tier and the
    shortfall."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and batch in the numbers the planner needs (bytes, FLOPs, seconds; per
    micro-batch unless named otherwise)."""

    name: str
    num_layers: int
    embed_params: int
    block_params: int
    head_params: int
    compute_bytes: int  # bytes per compute-dtype element
    block_grad_bytes: int  # bytes per element of block gradient slabs (executor.block_grad_dtype)
    state_kinds: int  # optimizer state kinds besides the fp32 master (AdamW: 2)
    micro_batches: int
    tokens_per_step: int  # global
    flops_per_step: float  # model FLOPs (6N + attention) of one optimizer step
    checkpoint: int  # one block-boundary activation
    working_set: int  # device temporaries of the largest stage function, with x / dx
    # one block's in-block activations kept to backward (its vjp residuals), and the
    # FLOPs its backward recomputes, per offload.keep_level the block supports
    kept: dict[str, int]
    recompute_flops: dict[str, float]
    block_fwd_flops: float
    head_fwd_flops: float
    measured: dict[str, float] | None = None  # stage seconds from :func:`trace`
    grad_policy: str = "keep"  # how long gradient buffers are held (executor.grad_policy)

    @property
    def kept_block(self) -> int:
        """One block's in-block activations, every one (``offload.keep_level=all``)."""
        return self.kept["all"]

    @property
    def params(self) -> int:
        return self.embed_params + self.num_layers * self.block_params + self.head_params

    @property
    def state_bytes_per_param(self) -> int:
        return 4 * (1 + self.state_kinds)

    def stage_times(self, hw: Hardware) -> dict[str, float]:
        """Seconds per micro-batch of each stage function: measured, or FLOPs over the
        profile's FLOP/s (backward = 2 x forward; a streamed block recomputes its forward
        first, Fuyou's equation 8; a kept block the part its keep level did not keep:
        its FLOPs, and writing once the bytes of the activations it recomputes).
        ``kept_key(level)`` names a kept block's backward."""
        if self.measured is not None:
            return self.measured
        f, bw = hw.device_flops, hw.device_memory_bw
        block, head = self.block_fwd_flops / f, self.head_fwd_flops / f
        times = {
            "embed_fwd": 0.0,
            "block_fwd": block,
            "block_bwd": 3 * block,
            "head": 3 * head,
            "embed_bwd": 0.0,
        }
        for level, flops in self.recompute_flops.items():
            recomputed = self.kept["all"] - self.kept[level]
            times[kept_key(level)] = 2 * block + flops / f + (recomputed / bw if bw else 0.0)
        return times

    @classmethod
    def from_config(
        cls, config: Config, sizes=None, devices: int = 1, backend: str | None = None
    ) -> Workload:
        """From abstract shapes only (``jax.eval_shape``): nothing is allocated.
        ``sizes``: a measured :class:`hetjax.executor.StageMemory`, else estimated.
        ``devices``: data-parallel devices sharing the batch (per-device sizes).
        ``backend``: the XLA backend the stage functions would compile for ("cpu",
        "gpu", ...; default this process's), which sizes the estimated working set
        (:func:`estimate_working_set`)."""
        import jax
        import jax.numpy as jnp

        from hetjax import remat
        from hetjax.executor import block_grad_dtype, grad_policy
        from models import build_model

        m, t = config.model, config.train
        model = build_model(m)
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        count = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))
        L = m.num_layers
        # slabs are whole pages of fp32 elements, a multiple of the devices' (ZeRO-3 shards)
        page = config.memory.page_size // 4 * devices
        padded = lambda n: -(-n // page) * page
        embed, head = padded(count(shapes["embed"])), padded(count(shapes["head"]))
        block_used = count(shapes["blocks"]) // L
        block = padded(block_used)
        c = 2 if m.compute_dtype in ("bfloat16", "float16") else 4
        b, T, D = max(1, t.micro_batch_size // devices), t.seq_len, m.d_model
        tokens = b * T
        if sizes is None:
            # The residuals of one block's vjp at each keep level, from abstract shapes
            # (its params unflattened, in the compute dtype).
            dtype = jnp.dtype(m.compute_dtype)
            one_block = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape[1:], dtype), shapes["blocks"]
            )
            kept = remat.kept_bytes(model.block, one_block, jax.ShapeDtypeStruct((b, T, D), dtype))
            # Below level all the vjp holds the block's param pages, padding included
            # (at all, the unflattened weights).
            kept = {k: v + (0 if k == "all" else (block - block_used) * c) for k, v in kept.items()}
            working = estimate_working_set(
                m, b, T, block_used, count(shapes["embed"]), backend or jax.default_backend()
            )
            checkpoint = tokens * D * c
        else:
            kept, working, checkpoint = sizes.kept, sizes.working_set, sizes.checkpoint
        # A kept block's backward recomputes, at level matmuls, the attention scores (its
        # other FLOPs are elementwise: their cost is the bytes, see stage_times).
        recompute = {"matmuls": 2 * tokens * T * D, "probs": 0.0, "all": 0.0}
        kinds = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1 if config.optimizer.momentum else 0}
        return cls(
            name=f"{m.family} {L} x {D}, {model.param_count() / 1e9:.3g}B params",
            num_layers=L,
            embed_params=embed,
            block_params=block,
            head_params=head,
            compute_bytes=c,
            block_grad_bytes=jnp.dtype(block_grad_dtype(config)).itemsize,
            state_kinds=kinds[config.optimizer.name],
            micro_batches=t.grad_accum,
            tokens_per_step=t.batch_size * T,
            flops_per_step=model.flops_per_token(T) * t.batch_size * T,
            checkpoint=checkpoint,
            working_set=int(working),
            kept=dict(kept),
            recompute_flops={level: recompute[level] for level in kept},
            block_fwd_flops=tokens * (2 * block_used + 4 * T * D),
            head_fwd_flops=tokens * 2 * m.vocab_size * D,
            grad_policy=grad_policy(config),
        )


# Device temporaries of the stage functions (XLA's temp_size_in_bytes), in bytes per
# element of the block's (B, T, D) activations, its (B, H, T, T) attention scores and its
# params, and of the head's (B, T, V) logits and (V, D) projection. Fitted (minimax
# relative error) to XLA:CPU's compiled memory analysis of the stage functions, per
# family and dtype, over 33 shapes each (d 64-2048, T 64-1024, batch 1-8, d_ff 2-6 x d,
# vocab 256-50257). Where a micro-batch has at least 128 tokens the whole working set
# estimated is within 0.73-1.27 of the compiled one (fp32: GPT 0.76-1.23, Llama
# 0.80-1.20; bf16: GPT 0.74-1.26, Llama 0.73-1.27); at 64 tokens the block's params
# dominate and the compiled sizes jump with XLA's choice of weight copies (0.5-2.1). The
# fp32-GPT fit this replaces, scaled by the compute dtype, was 0.50-2.2 (fp32) and
# 0.46-1.05 (bf16) over the same shapes.
#
# A bf16 step's temporaries on XLA:CPU are nearly fp32-sized: the backend computes bf16
# dots into fp32 outputs (then converts) and converts bf16 weights to fp32 copies for
# them, hence the separate bf16 fit. On an accelerator the dots run in the compute dtype,
# so the activation and param terms scale with it from the fp32 fit, while the attention
# scores and softmax, the logits and the head's gradient stay fp32 (the models cast
# them): that part is not measured (no GPU was at hand). A custom family takes the larger
# of the two families' coefficients.
_BLOCK_TEMPS = {  # (family, compute bytes): per activation, score, param element
    ("gpt", 4): (79.1, 11.7, 1.66),
    ("gpt", 2): (87.6, 10.3, 2.25),
    ("llama", 4): (147.0, 8.9, 1.13),
    ("llama", 2): (73.9, 11.5, 3.1),
}
_HEAD_TEMPS = {4: (6.74, 6.27), 2: (7.22, 6.72)}  # per logit, per projection element


def estimate_working_set(
    m, batch: int, seq_len: int, block_params: int, embed_params: int, backend: str
) -> int:
    """Device bytes of the largest stage function's temporaries plus x / dx (what
    ``StageFunctions.memory_sizes`` measures), from shapes: ``m`` a
    :class:`~hetjax.config.ModelConfig`, one micro-batch of ``batch`` x ``seq_len`` on one
    device, ``block_params`` / ``embed_params`` the stages' param counts, ``backend``
    the XLA backend ("cpu": fitted per dtype; else the fp32 fit scaled, see above)."""
    c = 2 if m.compute_dtype in ("bfloat16", "float16") else 4
    fitted = c if backend == "cpu" else 4
    families = [m.family] if m.family in ("gpt", "llama") else ["gpt", "llama"]
    fits = [_BLOCK_TEMPS[f, fitted] for f in families]
    act, score, param = (max(fit[i] for fit in fits) for i in range(3))
    logit, head = _HEAD_TEMPS[fitted]
    if backend != "cpu":  # dots in the compute dtype; scores, logits, head grads fp32
        act, param = act * c / 4, param * c / 4
    tokens, D, V = batch * seq_len, m.d_model, m.vocab_size
    block = tokens * D * act + batch * m.num_heads * seq_len**2 * score + block_params * param
    head_fwd_bwd = tokens * V * logit + V * D * head
    # the embedding's gradient, fp32, and before that in the compute dtype
    embed_bwd = embed_params * (4 + (c if c < 4 else 0))
    return int(max(block, head_fwd_bwd, embed_bwd) + 3 * tokens * D * c)


@dataclasses.dataclass(frozen=True)
class Candidate:
    mode: str  # none | stream
    remat: bool = False
    params: str = "device"  # device (mode none) | host | nvme
    optimizer: str = "device"  # device | host | nvme
    activations: str = "device"  # device | host | nvme
    prefetch_depth: int = 0
    resident_blocks: int = 0
    keep_blocks: int = 0
    keep_level: str = "all"  # which in-block activations the kept blocks keep
    # the first N stages (embed, block 0, ...) keep their optimizer state on the device
    # (offload.optimizer_device_stages); their blocks are resident
    device_stages: int = 0

    @property
    def rank(self) -> float:
        """Preference among plans of (nearly) equal predicted time: less offloaded first."""
        if self.mode == "none":
            return float(self.remat)
        tiers = {"device": 0, "host": 1, "nvme": 2}
        return (
            10
            + tiers[self.params]
            + tiers[self.optimizer]
            + tiers[self.activations]
            + 0.1 * self.prefetch_depth
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every kind of state lives, and what the step is predicted to cost."""

    hardware: str
    workload: str
    candidate: Candidate
    optimizer_cache: int  # host bytes caching NVMe optimizer state (whole stages)
    device: dict[str, int]  # bytes by what they hold, per device
    host: dict[str, int]  # per process
    nvme: dict[str, int]
    budgets: dict[str, int]  # device, host, nvme
    lanes: dict[str, float]  # seconds per step by lane
    step_s: float
    tokens_per_s: float
    tflops: float  # model FLOP/s per device
    bottleneck: str
    # s/step when global-norm clipping binds (sync mode: the update after backward)
    step_clipped_s: float = 0.0
    num_devices: int = 1

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        """The config sections that train with this plan (``Config.replace(**...)``)."""
        c = self.candidate
        if c.mode == "none":
            return dict(offload=dict(mode="none"), model=dict(remat=c.remat))
        return dict(
            offload=dict(
                mode="stream",
                params=c.params,
                optimizer=c.optimizer,
                activations=c.activations,
                prefetch_depth=c.prefetch_depth,
                keep_blocks=c.keep_blocks,
                keep_level=c.keep_level,
                optimizer_device_stages=c.device_stages,
            )
        )

    def table(self) -> str:
        c = self.candidate
        L = self.num_layers
        lines = [f"plan for {self.workload} on {self.hardware}"]
        if c.mode == "none":
            lines.append(
                "  offload.mode=none: params, gradients, optimizer state and activations on "
                "the device" + (" (model.remat: blocks recompute in backward)" if c.remat else "")
            )
        else:
            k = c.device_stages
            state = lambda cached: "device (cached)" if cached else c.optimizer
            lines += [
                f"  offload.mode=stream, prefetch depth {c.prefetch_depth}",
                f"  {'stage':<16}{'compute params':<22}{'fp32 master + optimizer':<25}activations",
            ]
            if (k >= 1) == (k == L + 2):  # embed and head alike
                lines.append(f"  {'embed, head':<16}{'device':<22}{state(k >= 1):<25}device")
            else:
                lines.append(f"  {'embed':<16}{'device':<22}{state(True):<25}device")
                lines.append(f"  {'head':<16}{'device':<22}{state(False):<25}device")
            rows: list[list] = []  # consecutive blocks placed alike share a row
            for i in range(L):
                where = "device (resident)" if i < c.resident_blocks else f"{c.params}, streamed"
                acts = (
                    f"kept on device ({c.keep_level})"
                    if i >= L - c.keep_blocks
                    else f"{c.activations} checkpoint, recomputed"
                )
                row = [where, state(i < k - 1), acts]
                if rows and rows[-1][2:] == row:
                    rows[-1][1] = i
                else:
                    rows.append([i, i, *row])
            for first, last, where, opt, acts in rows:
                name = f"block {first}" if first == last else f"blocks {first}-{last}"
                lines.append(f"  {name:<16}{where:<22}{opt:<25}{acts}")
            if k:
                lines.append(
                    f"  optimizer state of {k} stage{'s' * (k > 1)} cached on the device "
                    f"(offload.optimizer_device_stages={k}): "
                    f"{format_bytes(self.device.get('optimizer', 0))} with their gradients "
                    "and new params; updated there, no gradient copy"
                )
            if self.optimizer_cache:
                lines.append(
                    f"  optimizer state cached in host RAM: {format_bytes(self.optimizer_cache)}"
                )
        per = " per device" if self.num_devices > 1 else ""
        for tier in ("device", "host", "nvme"):
            held = getattr(self, tier)
            total = sum(held.values())
            if not total:
                continue
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items() if v)
            budget = self.budgets.get(tier, 0)
            lines.append(
                f"  {tier:<7}{format_bytes(total):>12} of {format_bytes(budget)}{per}  ({parts})"
            )
        lanes = ", ".join(f"{k} {v:.3g}" for k, v in self.lanes.items() if v)
        lines += [
            f"  lanes (s/step): {lanes}",
            f"  predicted: {self.step_s:.4g} s/step, {self.tokens_per_s:,.0f} tokens/s, "
            f"{self.tflops / 1e12:.3g} TFLOP/s{per} (bound by {self.bottleneck})",
        ]
        if self.step_clipped_s > self.step_s * 1.005:
            lines.append(
                f"  predicted when clipping binds (the update after backward, not during): "
                f"{self.step_clipped_s:.4g} s/step"
            )
        return "\n".join(lines)

    num_layers: int = 0


# -- evaluating one candidate ------------------------------------------------------------


def _memory(w: Workload, c: Candidate, n: int = 1) -> tuple[dict, dict, dict]:
    """Bytes per tier (device and host per device/process, NVMe per process) of
    candidate ``c`` on ``n`` data-parallel devices, following the runtimes' own
    accounting."""
    P, Pb, cb, L = w.params, w.block_params, w.compute_bytes, w.num_layers
    S = w.state_bytes_per_param
    if c.mode == "none":
        acts = (L * w.checkpoint if c.remat else L * w.kept_block) + w.working_set
        return (
            {"params": 4 * P, "gradients": 4 * P, "optimizer": 4 * w.state_kinds * P, "act": acts},
            {},
            {},
        )
    share = lambda x: math.ceil(x / n)  # ZeRO-3: each device owns 1/n of the state
    cached = _Cache(w, c.device_stages)
    resident = max(c.resident_blocks, cached.blocks)
    window = min(c.prefetch_depth + 1, L - resident)
    biggest = max(w.embed_params, w.block_params, w.head_params)
    device = {
        "embed+head": cb * (w.embed_params + w.head_params),
        "blocks": cb * Pb * (window + resident),
        "gradients": 2 * max(w.block_grad_bytes * Pb, 4 * w.embed_params),
        "checkpoints": ((L - c.keep_blocks) if c.activations == "device" else 2) * w.checkpoint,
        "kept": c.keep_blocks * w.kept[c.keep_level] if c.keep_blocks else 0,
        "working set": w.working_set,
        "optimizer": 2 * S * share(P) if c.optimizer == "device" else cached.device_bytes,
    }
    host_P = P - cached.params  # params whose state and compute copy are off the device
    if c.params == "host":
        params = cb * share(host_P)
    else:
        params = (c.prefetch_depth + IO_READAHEAD + 1) * cb * biggest
    # Gradient buffers (hetjax/gradients.py): all of them, or only the stages in flight
    # when no clipping redo can need them; kept for a redo, those beyond the in-flight
    # ones may spill to NVMe (at most all but the embed's; make_plan keeps what spare
    # RAM holds). The device cache's gradients never reach the host.
    grads = share(cached.host_grad_bytes)
    embed_grad = 0 if cached.embed else share(4 * w.embed_params)
    slab = share(max(w.block_grad_bytes * Pb, 4 * w.head_params))
    spill = w.grad_policy == "keep" and "nvme" in (c.params, c.optimizer, c.activations)
    host_grads, spilled = grads, 0
    window = embed_grad + in_flight_slabs(spill) * slab
    if (w.grad_policy == "release" or spill) and window < grads:
        host_grads, spilled = window, grads - embed_grad if spill else 0
    host = {
        "params": params,
        "gradients": host_grads,
        "optimizer": 2 * S * share(host_P) if c.optimizer == "host" else 0,
        "optimizer I/O": (IO_READAHEAD + 2) * S * biggest if c.optimizer == "nvme" else 0,
        "checkpoints": _host_checkpoints(w, c),
    }
    nvme = {
        "optimizer": 2 * S * share(host_P) if c.optimizer == "nvme" else 0,
        "params": 2 * cb * share(host_P) if c.params == "nvme" else 0,
        "checkpoints": (L - c.keep_blocks) * w.checkpoint if c.activations == "nvme" else 0,
        "gradients": spilled,
    }
    return device, host, nvme


class _Cache:
    """The device cache of optimizer state of candidate's first ``k`` stages in forward
    order (embed, block 0, ..., head last), as the executor holds it
    (``executor.device_optimizer_bytes``)."""

    def __init__(self, w: Workload, k: int):
        L, Pb = w.num_layers, w.block_params
        self.embed, self.head = k >= 1, k == L + 2
        self.blocks = min(max(k - 1, 0), L)  # resident, as the executor keeps them
        sizes = [w.embed_params] * self.embed + [Pb] * self.blocks + [w.head_params] * self.head
        self.params = sum(sizes)
        # state twice (committed and speculative), refreshed compute params, fp32
        # gradients: all kept for a clipping redo or summed over micro-batches, else
        # one at a time
        kept = w.grad_policy in ("keep", "accumulate")
        grads = 4 * (self.params if kept else max(sizes, default=0))
        self.device_bytes = (2 * w.state_bytes_per_param + w.compute_bytes) * self.params + grads
        self.host_grad_bytes = (
            w.block_grad_bytes * (L - self.blocks) * Pb
            + 4 * w.embed_params * (not self.embed)
            + 4 * w.head_params * (not self.head)
        )


def _host_checkpoints(w: Workload, c: Candidate) -> int:
    """Host bytes of activation checkpoints: a micro-batch's all (``host``), or the NVMe
    swap's staging (``nvme``, as ``activations.staging_bytes``)."""
    slots = w.num_layers - c.keep_blocks
    if c.activations == "host":
        return slots * w.checkpoint
    if c.activations == "nvme":
        return min(slots, IO_READAHEAD + 1) * w.checkpoint
    return 0


def _lanes(
    w: Workload,
    hw: Hardware,
    c: Candidate,
    cached: float,
    grad_spill: int = 0,
    after_backward: bool = False,
) -> tuple[float, dict]:
    """Predicted seconds per step and per lane (Fuyou's equations 1-8, our tiers).
    ``cached``: the fraction of NVMe optimizer state cached in host RAM; ``grad_spill``:
    gradient bytes written to NVMe per step (read back only by a clipping redo).
    ``after_backward``: the step of a sync run whose clipping binds (the update loop's
    adaptive speculation then updates every stage once backward has ended, the spilled
    gradients read back; ``update_loop.py``) instead of overlapped with backward."""
    st = w.stage_times(hw)
    n, A, L = hw.num_devices, w.micro_batches, w.num_layers
    P, Pb, cb = w.params, w.block_params, w.compute_bytes
    fwd = st["embed_fwd"] + L * st["block_fwd"]
    if c.mode == "none":
        bwd_blocks = L * (st["block_bwd"] if c.remat else st["block_bwd_kept"])
        compute_b = st["head"] + bwd_blocks + st["embed_bwd"]
        dev_opt = _device_optimizer_s(hw, P)
        step = A * (fwd + compute_b) + dev_opt
        return step, {"compute": A * (fwd + compute_b), "optimizer": dev_opt}
    kept, recomputed = c.keep_blocks, L - c.keep_blocks
    compute_b = st["head"] + recomputed * st["block_bwd"]
    compute_b += kept * st[kept_key(c.keep_level)] if kept else 0.0
    compute_b += st["embed_bwd"]
    frac = 1.0 / n
    cache = _Cache(w, c.device_stages)
    resident = max(c.resident_blocks, cache.blocks)
    streamed_f = L - resident
    streamed_b = max(0, recomputed - resident)
    # Checkpoints on the host or NVMe cross to the host in forward and back in backward;
    # on NVMe, all but the last IO_READAHEAD (held in RAM for backward, which takes them
    # first) are written and read back.
    ckpt = recomputed * w.checkpoint if c.activations in ("host", "nvme") else 0
    h2d_f = streamed_f * cb * Pb * frac
    h2d_b = streamed_b * cb * Pb * frac + ckpt
    grads = cache.host_grad_bytes  # the device cache's gradients stay there
    d2h_f, d2h_b = ckpt, grads * frac
    comm_f = comm_b = 0.0
    # On the CPU backend the devices' memory is host RAM: a collective is copies.
    link = hw.interconnect_bw or (hw.h2d_bw if hw.shared_cores else 0.0)
    if n > 1 and link:  # all-gather params, reduce-scatter gradients
        comm_f = L * cb * Pb * (n - 1) / n / link
        comm_b = (recomputed * cb * Pb + 4 * P) * (n - 1) / n / link
    disk_f = disk_b = disk_step = 0.0
    if c.params == "nvme":
        disk_f = h2d_f / hw.nvme_read_bw * n  # the machine's disks serve n processes
        disk_b = (h2d_b - ckpt) / hw.nvme_read_bw * n
        disk_step += cb * (P - cache.params) / hw.nvme_write_bw
    if c.activations == "nvme":
        disk_f += max(0, recomputed - IO_READAHEAD) * w.checkpoint / hw.nvme_write_bw * n
        disk_b += max(0, recomputed - IO_READAHEAD) * w.checkpoint / hw.nvme_read_bw * n
    if grad_spill:
        disk_step += grad_spill / hw.nvme_write_bw
    S = w.state_bytes_per_param
    if c.optimizer == "nvme":
        moved = S * (P - cache.params) * (1 - cached)
        disk_step += moved / hw.nvme_read_bw + moved / hw.nvme_write_bw
    # The device cache's stages are the last backward reaches: their updates run on the
    # device after it, at device speed (Angel-PTM); the host updates the others,
    # overlapped with backward.
    dev_opt = _device_optimizer_s(hw, cache.params)
    if c.optimizer == "device":  # each device updates its 1/n (on shared cores in turn)
        opt = _device_optimizer_s(hw, P if hw.shared_cores else P * frac)
    else:  # the machine's optimizer serves n processes
        opt = (P - cache.params) / hw.optimizer_params_per_s
    copy_f = h2d_f / hw.h2d_bw + d2h_f / hw.d2h_bw
    copy_b = h2d_b / hw.h2d_bw + d2h_b / hw.d2h_bw
    if hw.shared_cores:  # compute, copies, collectives and optimizer take turns on the
        # same cores, and so do the n devices' (each its rows, its copies, its collectives)
        t_f = max(n * (fwd + copy_f + comm_f), disk_f)
        t_b = max(n * (compute_b + copy_b + comm_b), disk_b)
        t_last = max(n * (compute_b + copy_b + comm_b) + opt + dev_opt, disk_b + disk_step)
    else:
        t_f = max(fwd, h2d_f / hw.h2d_bw, d2h_f / hw.d2h_bw, comm_f, disk_f)
        t_b = max(compute_b, h2d_b / hw.h2d_bw, d2h_b / hw.d2h_bw, comm_b, disk_b)
        if c.optimizer == "device":  # the update shares the device with backward
            t_last = max(t_b, compute_b + opt, disk_b + disk_step)
        else:
            t_last = max(t_b, compute_b + dev_opt, opt, disk_b + disk_step)
    if after_backward and c.mode == "stream":
        disk_step += grad_spill / hw.nvme_read_bw if grad_spill else 0.0
        t_b_last = n * (compute_b + copy_b + comm_b) if hw.shared_cores else t_b
        if hw.shared_cores or c.optimizer == "device":
            t_last = max(t_b_last, disk_b) + max(opt + dev_opt, disk_step)
        else:  # host stages on the host, cached ones on the device, at once
            t_last = max(t_b_last, disk_b) + max(opt, dev_opt, disk_step)
    step = A * t_f + (A - 1) * t_b + t_last
    lanes = {
        "compute": A * (fwd + compute_b),
        "host->device": A * (h2d_f + h2d_b) / hw.h2d_bw,
        "device->host": A * (d2h_f + d2h_b) / hw.d2h_bw,
        "nvme": A * (disk_f + disk_b) + disk_step,
        "optimizer": opt + dev_opt,
        "collectives": A * (comm_f + comm_b),
    }
    return step, lanes


def kept_key(level: str) -> str:
    """The stage time of a kept block's backward at keep ``level``."""
    return "block_bwd_kept" if level == "all" else f"block_bwd_kept_{level}"


def _device_optimizer_s(hw: Hardware, params: int) -> float:
    """An optimizer step on the device: memory-bound at ADAM_BYTES per parameter; on the
    CPU backend the device is the host's cores, as fast as the host optimizer."""
    if hw.shared_cores or not hw.device_memory_bw:
        return params / hw.optimizer_params_per_s
    return params * ADAM_BYTES / hw.device_memory_bw


# -- the search --------------------------------------------------------------------------


def budgets(config: Config, hw: Hardware) -> dict[str, int]:
    """Bytes the plan may use per tier: the config's budgets, else the profile's
    capacity with a margin (host RAM and disks are shared by the machine's devices)."""
    mem, n = config.memory, hw.num_devices
    device, host = int(MARGIN * hw.device_memory), int(MARGIN * hw.host_memory / n)
    return {
        "device": min(mem.device_budget, hw.device_memory) if mem.device_budget else device,
        "host": min(mem.host_budget, hw.host_memory) if mem.host_budget else host,
        "nvme": int(MARGIN * hw.nvme_capacity / n),
    }


def _candidates(w: Workload, one_device: bool):
    """Every placement the runtimes implement; on one device also ``none``, checkpoints
    on NVMe and kept blocks (the data-parallel runtime keeps checkpoints on the device or
    host, and no in-block activations)."""
    L = w.num_layers
    if one_device:
        yield Candidate("none", remat=False)
        yield Candidate("none", remat=True)
    activations = ("device", "host", "nvme") if one_device else ("device", "host")
    keeps = [(0, "all")]
    if one_device:
        keeps += [
            (keep, level)
            for keep in sorted({1, 2, L // 4, L // 2, L} & set(range(1, L + 1)))
            for level in w.kept  # the levels the block supports
        ]
    for params, optimizer, acts in itertools.product(
        ("host", "nvme"), ("device", "host", "nvme"), activations
    ):
        for depth in (0, 1, 2, 3):
            for keep, level in keeps:
                yield Candidate("stream", False, params, optimizer, acts, depth, 0, keep, level)


def _largest(fits, lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with ``fits(x)``, for ``fits`` true up to some point and
    false after (lo when none fits)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _device_bytes(w: Workload, hw: Hardware, c: Candidate) -> int:
    return sum(_memory(w, c, hw.num_devices)[0].values())


def _fill_resident(w: Workload, hw: Hardware, c: Candidate, device_budget: int) -> Candidate:
    """As many resident blocks as the device budget allows (the executor does the same),
    at least the device cache's."""
    fits = lambda r: (
        _device_bytes(w, hw, dataclasses.replace(c, resident_blocks=r)) <= device_budget
    )
    lo = _Cache(w, c.device_stages).blocks
    return dataclasses.replace(c, resident_blocks=_largest(fits, lo, w.num_layers))


def _cache_variants(w: Workload, hw: Hardware, c: Candidate, device_budget: int):
    """Candidate ``c`` with a device cache of the optimizer state of its first k stages,
    for every k the device budget holds, each with as many resident blocks as fit
    besides (at least the cache's own). Angel-PTM caches what fits in the device memory
    left after everything else; here resident blocks compete for that memory (they save
    host->device copies, the cache saves host optimizer time, gradient copies and NVMe
    traffic), so every split is offered to the cost model. Only with the optimizer on
    the host or NVMe, one device and sync mode (lock-free mode takes the optimizer off
    the critical path already)."""
    if c.mode != "stream" or c.optimizer == "device" or hw.num_devices != 1:
        return
    if w.grad_policy == "lockfree":
        return
    L, d = w.num_layers, c.prefetch_depth
    base = _memory(w, dataclasses.replace(c, resident_blocks=0, device_stages=0))[0]
    if sum(base.values()) > device_budget:
        return  # a cache only adds to it
    # Device bytes with k stages cached and r blocks resident, as _memory counts them:
    # the window and resident blocks hold min(d + 1 + r, L) block slabs.
    fixed = sum(base.values()) - base["blocks"]
    slab = w.compute_bytes * w.block_params
    for k in range(1, L + 3):
        cache = _Cache(w, k)
        held = lambda r, cache=cache: fixed + slab * min(d + 1 + r, L) + cache.device_bytes
        if held(cache.blocks) > device_budget:
            break  # nor does any larger cache
        if held(L) <= device_budget:
            resident = L
        else:  # below saturation each resident block adds one slab
            resident = cache.blocks + (device_budget - held(cache.blocks)) // slab
        yield dataclasses.replace(c, device_stages=k, resident_blocks=min(resident, L))


def _evaluate(w: Workload, hw: Hardware, limit: dict[str, int], c: Candidate) -> list[tuple]:
    """Candidate ``c``'s footprint per tier, spare host RAM's use and predicted step, as
    ``[(step, rank, c, device, host, nvme, optimizer cache, lanes)]``; empty when it
    does not fit."""
    device, host, nvme = _memory(w, c, hw.num_devices)
    if (
        sum(device.values()) > limit["device"]
        or sum(host.values()) > limit["host"]
        or sum(nvme.values()) > limit["nvme"]
    ):
        return []
    cache, cached = 0, 0.0
    spare = max(0, limit["host"] - sum(host.values()))
    if nvme.get("gradients"):  # spare host RAM keeps gradients first (the host plan's order)
        kept = min(spare, nvme["gradients"])
        host = {**host, "gradients kept": kept}
        nvme = {**nvme, "gradients": nvme["gradients"] - kept}
        spare -= kept
    if c.optimizer == "nvme":  # then caches whole stages of NVMe state
        state = nvme["optimizer"]
        cache = min(state, spare)
        cached = cache / state if state else 0.0
    step, lanes = _lanes(w, hw, c, cached, nvme.get("gradients", 0))
    clipped, _ = _lanes(w, hw, c, cached, nvme.get("gradients", 0), after_backward=True)
    return [(step, c.rank, c, device, host, nvme, cache, lanes, clipped)]


def make_plan(config: Config, hw: Hardware, workload: Workload | None = None) -> Plan:
    """The fastest placement of ``config``'s model that fits every tier of ``hw`` (and
    the config's budgets). Raises :class:`PlanError` naming the short tier and by how
    much when nothing fits."""
    backend = "cpu" if hw.shared_cores else "gpu"  # the profile's, not this process's
    w = workload or Workload.from_config(config, devices=hw.num_devices, backend=backend)
    limit = budgets(config, hw)
    # ZeRO-3 sharding needs the data-parallel runtime; one device keeps the whole state.
    one_device = hw.num_devices == 1
    best = []
    for base in _candidates(w, one_device):
        if "nvme" in (base.params, base.optimizer, base.activations) and not hw.nvme_capacity:
            continue
        if base.mode == "stream":
            base = _fill_resident(w, hw, base, limit["device"])
        options = _evaluate(w, hw, limit, base)
        for c in _cache_variants(w, hw, base, limit["device"]):
            options += _evaluate(w, hw, limit, c)
        if options:  # this placement's fastest split of device memory
            best.append(min(options, key=lambda b: b[0]))
    if not best:
        raise PlanError(_shortfall(config, w, hw, limit))
    fastest = min(b[0] for b in best)
    step, _, c, device, host, nvme, cache, lanes, clipped = min(
        (b for b in best if b[0] <= 1.02 * fastest), key=lambda b: (b[1], b[0])
    )
    if cache:
        host = {**host, "optimizer cache": cache}
    busiest = max(lanes, key=lanes.get)
    o = config.optimizer
    return Plan(
        hardware=hw.name,
        workload=w.name,
        candidate=c,
        optimizer_cache=cache,
        device=device,
        host=host,
        nvme=nvme,
        budgets=limit,
        lanes=lanes,
        step_s=step,
        tokens_per_s=w.tokens_per_step / step,
        tflops=w.flops_per_step / step / hw.num_devices,
        bottleneck=busiest,
        step_clipped_s=clipped if o.grad_clip > 0 and o.mode == "sync" else step,
        num_devices=hw.num_devices,
        num_layers=w.num_layers,
    )


def _shortfall(config: Config, w: Workload, hw: Hardware, limit: dict[str, int]) -> str:
    """Why nothing fits: the smallest footprint per tier, tier by tier."""
    state = "nvme" if hw.nvme_capacity else "host"  # params and optimizer state
    acts = ("nvme", "host") if hw.num_devices == 1 and hw.nvme_capacity else ("host",)
    smallest = [  # checkpoints on NVMe need the least host, on the host the least NVMe
        _memory(w, Candidate("stream", False, state, state, a, 0, 0, 0), hw.num_devices)
        for a in acts
    ]
    device, host, nvme = (
        min((m[t] for m in smallest), key=lambda d: sum(d.values())) for t in range(3)
    )
    short = []
    hints = {
        "device": "raise memory.device_budget, lower train.batch_size or raise train.grad_accum",
        "host": "raise memory.host_budget or add RAM",
        "nvme": "point memory.nvme_path at a larger disk",
    }
    for tier, held in (("device", device), ("host", host), ("nvme", nvme)):
        need = sum(held.values())
        if need > limit[tier]:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items() if v)
            short.append(
                f"{tier} needs at least {format_bytes(need)} ({parts}) but has "
                f"{format_bytes(limit[tier])}: short by {format_bytes(need - limit[tier])} "
                f"({hints[tier]})"
            )
    if not short:  # each tier fits alone (can't happen with the smallest candidate)
        short.append("no placement fits all tiers at once")
    return f"{w.name} does not fit {hw.name} in any placement: " + "; ".join(short)


# -- the tracer --------------------------------------------------------------------------


def trace(config: Config, repeats: int = 5, devices: int = 1) -> Workload:
    """Measures the model on this machine: each stage function's time for one
    micro-batch (compiled and run on random params and tokens, median of ``repeats``) and
    XLA's memory sizes. Allocates one block's, the embedding's and the head's params.
    ``devices``: data-parallel devices sharing the batch; each runs its rows of the
    micro-batch, so that is what is timed and sized (on one device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.executor import StageFunctions, stage_layouts
    from hetjax.placement import Placement
    from models import build_model

    m, t = config.model, config.train
    model = build_model(m)
    dtype = jnp.dtype(m.compute_dtype)
    layouts = stage_layouts(model, config.memory.page_size)
    dev = Placement.single_device().device
    fns = StageFunctions(
        model,
        layouts,
        lambda fn: jax.jit(fn, out_shardings=dev),
        lambda pages, dtype: [p.astype(dtype) for p in pages],
    )
    rows = max(1, t.micro_batch_size // devices)  # one device's rows of a micro-batch
    sizes = fns.memory_sizes(rows, t.seq_len, dtype)
    rng = np.random.default_rng(0)

    def slab(name):
        L = layouts[name]
        return jax.device_put(
            [jnp.asarray(rng.normal(0, 0.02, L.page_elems), dtype) for _ in range(L.num_pages)],
            dev,
        )

    e, b, h = slab("embed"), slab("block"), slab("head")
    tokens = jax.device_put(rng.integers(0, m.vocab_size, (rows, t.seq_len)).astype(np.int32), dev)
    x = fns.embed_fwd(e, tokens)
    one = jnp.asarray(1.0, jnp.float32)

    def best(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(repeats):
            t1 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t1)
        return float(np.median(times))

    measured = {
        "embed_fwd": best(lambda: fns.embed_fwd(e, tokens)),
        "block_fwd": best(lambda: fns.block_fwd(b, x)),
        "block_bwd": best(lambda: fns.block_bwd(b, x, x)),
        "head": best(lambda: fns.head_fwd_bwd(h, e, x, tokens, one)),
        "embed_bwd": best(lambda: fns.embed_bwd(e, tokens, x)),
    }
    for level in sizes.kept:  # a kept block's backward from each level's residuals
        vjp = fns.kept_forward(level)(b, x)[1]
        measured[kept_key(level)] = best(lambda vjp=vjp: fns.block_bwd_kept(vjp, x))
        del vjp
    w = Workload.from_config(config, sizes, devices)
    w = dataclasses.replace(w, measured=measured)
    return w


# -- offload.mode=auto -------------------------------------------------------------------


def resolve_auto(config: Config, workdir=None, log=print) -> Config:
    """``offload.mode=auto``: the config to train with (see :func:`plan_auto`)."""
    return plan_auto(config, workdir, log)[0]


def plan_auto(config: Config, workdir=None, log=print) -> tuple[Config, Plan | None]:
    """``offload.mode=auto``: the config to train with, and the plan when one was made.
    When the whole state fits the device (``memory.device_budget``, else the device's
    free memory) that is ``offload.mode=none``, decided from shapes alone; otherwise the
    tracer measures this machine and the model, the planner plans, and the plan's
    placement is returned (with the budgets it planned for, so the executor plans within
    them)."""
    if config.offload.mode != "auto":
        return config, None
    if config.distributed.data_parallel != 1:  # ZeRO-3 is the streaming runtime's
        log("offload.mode=auto: data parallelism (ZeRO-3) streams: offload.mode=stream")
        return config.replace(offload=dict(mode="stream")), None
    from pathlib import Path

    from hetjax.hardware import device_capacity, measure_local

    w = Workload.from_config(config)
    capacity = device_capacity()
    budget = config.memory.device_budget or int(MARGIN * capacity)
    for remat in (False, True):
        need = sum(_memory(w, Candidate("none", remat=remat))[0].values())
        if need <= budget:
            log(
                f"offload.mode=auto: the whole state fits the device ({format_bytes(need)} "
                f"of {format_bytes(budget)}): offload.mode=none"
                + (", model.remat=true" if remat else "")
            )
            return config.replace(offload=dict(mode="none"), model=dict(remat=remat)), None
    log("offload.mode=auto: the state does not fit the device; measuring this machine")
    t0 = time.perf_counter()
    nvme = config.memory.nvme_path or (Path(workdir) / "nvme" if workdir else "")
    hw = measure_local(str(nvme), config.model.compute_dtype)
    plan = make_plan(config, hw, trace(config))
    log(f"planned in {time.perf_counter() - t0:.1f} s")
    for line in plan.table().splitlines():
        log(line)
    overrides = plan.config_overrides()
    if plan.candidate.mode == "stream":
        overrides["memory"] = dict(
            device_budget=plan.budgets["device"], host_budget=plan.budgets["host"]
        )
    return config.replace(**overrides), plan
