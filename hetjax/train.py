"""The training loop shared by every runtime, and the in-memory reference runtime.

A *runtime* owns the training state and runs one optimizer step on a global batch;
the loop around it (data, metrics, evaluation) is the same for all of them.
``offload.mode=none`` uses :class:`InMemoryRuntime`: the whole state on the device and
one jitted step. It is the reference every offloaded mode is tested against, so it is
kept plain.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.config import Config
from hetjax.data import make_datasets
from hetjax.metrics import MetricsWriter, StepTimer, step_record
from hetjax.optim import build_optimizer
from models import build_model


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says what to change."""


@dataclasses.dataclass(frozen=True)
class StepStats:
    loss: float  # mean token loss of the global batch
    grad_norm: float  # global L2 norm of the (unscaled, averaged) gradients
    skipped: bool = False  # fp16: the update was skipped on overflow
    loss_scale: float = 1.0


class Runtime(Protocol):
    def train_step(self, batch: np.ndarray) -> StepStats:
        """One optimizer step on a global batch of shape (A, B/A, T+1) int32."""

    def eval_loss(self, batch: np.ndarray) -> float:
        """Mean token loss of a (B, T+1) batch with the current params."""

    def params(self) -> Any:
        """The current fp32 params as a host (numpy) pytree."""

    def extra_metrics(self) -> dict[str, Any]:
        """Runtime-specific metrics for the step just taken (bytes per tier, ...)."""

    def settle(self) -> None:
        """Finishes outstanding optimizer work (lock-free mode) and writes cached state
        out to its tier, so ``params`` and the files on disk hold the final state."""

    def close(self) -> None:
        """Stops background threads; ``params`` still works afterwards."""


# -- fp16 dynamic loss scaling -----------------------------------------------------------


@flax.struct.dataclass
class LossScale:
    """Dynamic loss scale for fp16 compute: halve and skip the step on overflow; double
    after ``period`` steps without one."""

    scale: jax.Array
    good_steps: jax.Array
    period: int = flax.struct.field(pytree_node=False, default=1000)

    @classmethod
    def create(cls, init: float, period: int) -> LossScale:
        return cls(jnp.float32(init), jnp.int32(0), period)

    def update(self, finite: jax.Array) -> LossScale:
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(
            finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0)
        )
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good)


# -- the in-memory reference runtime -----------------------------------------------------


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale | None


class InMemoryRuntime:
    """Everything on the default device; one jitted step with gradient accumulation."""

    def __init__(self, config: Config, params: Any | None = None):
        self.config = config
        self.model = build_model(config.model)
        rng = jax.random.key(config.train.seed)
        if params is None and config.model.init_from:
            from hetjax.hf import open_checkpoint

            params = jax.device_put(open_checkpoint(config.model).params())
        if params is None:
            params = jax.jit(self.model.init)(rng)
        self.tx = build_optimizer(config.optimizer, config.train.steps, params)
        fp16 = config.model.compute_dtype == "float16"
        t = config.train
        self.state = TrainState(
            step=jnp.int32(0),
            params=params,
            opt_state=self.tx.init(params),
            loss_scale=LossScale.create(t.loss_scale_init, t.loss_scale_period) if fp16 else None,
        )
        self._step = jax.jit(self._train_step, donate_argnums=0)
        self._eval = jax.jit(lambda p, b: self.model.loss(p, b[:, :-1], b[:, 1:]))

    def _train_step(self, state: TrainState, batch: jax.Array):
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)

        def micro(grad_sum, tokens):  # tokens (B/A, T+1)
            loss_fn = lambda p: self.model.loss(p, tokens[:, :-1], tokens[:, 1:]) * scale
            scaled_loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return jax.tree.map(jnp.add, grad_sum, grads), scaled_loss / scale

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grad_sum, losses = jax.lax.scan(micro, zeros, batch)  # batch (A, B/A, T+1)
        grads = jax.tree.map(lambda g: g / (batch.shape[0] * scale), grad_sum)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        finite = jnp.isfinite(grad_norm)
        if state.loss_scale is not None:  # fp16: skip the whole update on overflow
            keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)
            new = new.replace(
                params=keep(params, state.params),
                opt_state=keep(opt_state, state.opt_state),
                loss_scale=state.loss_scale.update(finite),
            )
        return new, (jnp.mean(losses), grad_norm, ~finite, scale)

    def train_step(self, batch: np.ndarray) -> StepStats:
        self.state, (loss, grad_norm, skipped, scale) = self._step(self.state, batch)
        return StepStats(float(loss), float(grad_norm), bool(skipped), float(scale))

    def eval_loss(self, batch: np.ndarray) -> float:
        return float(self._eval(self.state.params, batch))

    def params(self) -> Any:
        # np.array copies: on CPU a device_get can alias a buffer the next step donates.
        return jax.tree.map(np.array, self.state.params)

    def extra_metrics(self) -> dict[str, Any]:
        return {}

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


def build_runtime(config: Config, workdir: str | Path | None = None) -> Runtime:
    """The runtime for ``config.offload.mode``. ``workdir`` holds the NVMe state when
    ``memory.nvme_path`` is empty."""
    if config.offload.mode == "none":
        return InMemoryRuntime(config)
    if config.offload.mode == "stream":
        from hetjax.executor import StreamingRuntime  # imports this module

        return StreamingRuntime(config, workdir=workdir)
    raise AssertionError(config.offload.mode)  # validated by OffloadConfig


# -- the loop ----------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    val_loss: float
    params: Any
    records: list[dict[str, Any]]


def train(config: Config, workdir: str | Path, verbose: bool = True) -> TrainResult:
    """Trains for ``config.train.steps`` steps; writes ``metrics.jsonl`` and
    ``config.json`` into ``workdir`` and returns the losses, validation loss and params."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    t = config.train
    train_data, val_data, data_desc = make_datasets(config)
    runtime = build_runtime(config, workdir)
    model = build_model(config.model)
    n_params = model.param_count()
    tokens_per_step = t.batch_size * t.seq_len
    flops_per_step = model.flops_per_token(t.seq_len) * tokens_per_step

    out = MetricsWriter(workdir, t.steps, t.log_every, enabled=verbose)
    out.log(
        f"hetjax: {n_params / 1e6:.2f}M params, offload.mode={config.offload.mode}, "
        f"{jax.devices()[0].platform} x{jax.device_count()}; data: {data_desc}"
    )
    out.log(
        f"batch {t.batch_size} x seq {t.seq_len} = {tokens_per_step:,} tokens/step, "
        f"grad_accum {t.grad_accum}, {t.steps} steps -> {workdir}"
    )
    for line in getattr(runtime, "plan_lines", list)():
        out.log(line)
    losses, records = [], []
    timer = StepTimer()
    try:
        for step in range(1, t.steps + 1):
            batch = train_data.batch(step - 1)  # (B, T+1)
            batch = batch.reshape(t.grad_accum, t.micro_batch_size, t.seq_len + 1)
            stats = runtime.train_step(batch)
            step_time = timer.lap()
            if not math.isfinite(stats.loss) and not stats.skipped:
                raise TrainingError(
                    f"loss is {stats.loss} at step {step} (grad norm {stats.grad_norm}); "
                    "training diverged. Lower optimizer.lr, raise optimizer.warmup_steps, or "
                    "enable optimizer.grad_clip; nothing was saved from this step"
                )
            losses.append(stats.loss)
            rec = step_record(
                step,
                stats.loss,
                step_time,
                tokens_per_step,
                flops_per_step,
                grad_norm=stats.grad_norm,
                **runtime.extra_metrics(),
            )
            if config.model.compute_dtype == "float16":
                rec.update(loss_scale=stats.loss_scale, skipped=stats.skipped)
            records.append(rec)
            out.step(rec)
        runtime.settle()  # outstanding optimizer work done, state written out
        val_loss = evaluate(runtime, val_data, t.eval_batches)
        if t.eval_batches:
            out.log(
                f"final validation loss {val_loss:.4f} over {t.eval_batches} batches "
                f"(train loss first {losses[0]:.4f}, last {losses[-1]:.4f})"
            )
        summary = {
            "val_loss": val_loss,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "steps": t.steps,
            "mean_step_time_s": float(
                np.mean([r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]])
            ),
        }
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        params = runtime.params()
    finally:
        out.close()
        runtime.close()
    return TrainResult(losses, val_loss, params, records)


def evaluate(runtime: Runtime, data, num_batches: int) -> float:
    if num_batches == 0:
        return float("nan")
    return float(np.mean([runtime.eval_loss(data.batch(i)) for i in range(num_batches)]))
