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
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax import timeline
from hetjax.checkpoint import (
    MASTER,
    Checkpointer,
    RuntimeState,
    check_compatible,
    checkpoint_dir,
    optax_tree_slots,
)
from hetjax.config import Config, ConfigError
from hetjax.data import make_datasets
from hetjax.hardware import tune_host_allocator
from hetjax.metrics import MetricsWriter, StepTimer, peak_flops, step_record
from hetjax.optim import build_optimizer
from models import build_model


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says what to change."""


@dataclasses.dataclass(frozen=True)
class StepStats:
    loss: float  # mean token loss of the global batch
    grad_norm: float  # global L2 norm of the (unscaled, averaged) gradients
    skipped: bool = False  # the update was skipped (fp16 overflow, or non-finite)
    loss_scale: float = 1.0
    nonfinite: bool = False  # loss or gradient not finite beyond fp16 loss scaling


class Runtime(Protocol):
    def train_step(self, batch: np.ndarray, poison: bool = False) -> StepStats:
        """One optimizer step on a global batch of shape (A, B/A, T+1) int32. A step
        whose loss or gradient is not finite changes no state. ``poison`` (fault
        injection for tests) makes the step's gradients NaN."""

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

    def save_state(self) -> RuntimeState:
        """A snapshot of the complete state in the placement-free form (host copies
        that later steps do not change)."""

    def load_state(self, state: RuntimeState) -> None:
        """Replaces the whole state (a resume or a rollback)."""


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

    def _train_step(self, state: TrainState, batch: jax.Array, poison: jax.Array):
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
        seed = scale * poison  # the loss cotangent; poison is 1, or NaN to inject a fault

        def micro(grad_sum, tokens):  # tokens (B/A, T+1)
            def loss_fn(p):
                loss = self.model.loss(p, tokens[:, :-1], tokens[:, 1:])
                return loss * seed, loss

            (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grad_sum, losses = jax.lax.scan(micro, zeros, batch)  # batch (A, B/A, T+1)
        grads = jax.tree.map(lambda g: g / (batch.shape[0] * scale), grad_sum)
        grad_norm = optax.tree.norm(grads)
        loss = jnp.mean(losses)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)

        def update(_):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state

        # A non-finite step (fp16 overflow, or divergence) leaves the state as it was.
        params, opt_state = jax.lax.cond(
            finite, update, lambda _: (state.params, state.opt_state), None
        )
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if state.loss_scale is not None:
            new = new.replace(loss_scale=state.loss_scale.update(finite))
        return new, (loss, grad_norm, ~finite, scale)

    def train_step(self, batch: np.ndarray, poison: bool = False) -> StepStats:
        self.state, (loss, grad_norm, skipped, scale) = self._step(
            self.state, batch, np.float32(np.nan if poison else 1.0)
        )
        timeline.watch("compute", "train step", loss)
        skipped, scale = bool(skipped), float(scale)
        fp16_overflow = skipped and self.state.loss_scale is not None and scale > 1
        return StepStats(
            float(loss), float(grad_norm), skipped, scale, nonfinite=skipped and not fp16_overflow
        )

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

    # -- checkpoints --------------------------------------------------------------------

    def _opt_slots(self) -> list[str | None]:
        return optax_tree_slots(self.state.opt_state, self.state.params)

    def save_state(self) -> RuntimeState:
        n = len(jax.tree.leaves(self.state.params))
        leaves = jax.tree.leaves(self.state.opt_state)
        trees, scalars, i = {MASTER: self.state.params}, [], 0
        treedef = jax.tree.structure(self.state.params)
        for kind in self._opt_slots():
            if kind is None:
                scalars.append(np.array(leaves[i]))
                i += 1
            else:
                trees[kind] = jax.tree.unflatten(treedef, leaves[i : i + n])
                i += n
        ls = self.state.loss_scale
        loss_scale = (float(ls.scale), int(ls.good_steps)) if ls is not None else None
        return RuntimeState.from_trees(trees, scalars, loss_scale)

    def load_state(self, state: RuntimeState) -> None:
        slots = self._opt_slots()
        kinds = [MASTER, *(k for k in slots if k)]
        if sorted(state.kinds) != sorted(kinds):
            raise ConfigError(
                f"the checkpoint holds optimizer state {state.kinds}, optimizer.name="
                f"{self.config.optimizer.name} needs {kinds}"
            )
        old_leaves = jax.tree.leaves(self.state.opt_state)
        scalars = iter(state.scalars["embed"])
        leaves: list[Any] = []
        i = 0
        for kind in slots:
            if kind is None:
                leaves.append(jnp.asarray(next(scalars), old_leaves[i].dtype))
                i += 1
            else:
                tree = state.kind_tree(kind)
                leaves += [jnp.asarray(a) for a in jax.tree.leaves(tree)]
                i += len(jax.tree.leaves(tree))
        params = jax.tree.map(jnp.asarray, state.params())
        if jax.tree.structure(params) != jax.tree.structure(self.state.params):
            raise ConfigError("the checkpoint's params do not match this model's structure")
        loss_scale = self.state.loss_scale
        if loss_scale is not None and state.loss_scale is not None:
            loss_scale = loss_scale.replace(
                scale=jnp.float32(state.loss_scale[0]), good_steps=jnp.int32(state.loss_scale[1])
            )
        self.state = self.state.replace(
            params=params,
            opt_state=jax.tree.unflatten(jax.tree.structure(self.state.opt_state), leaves),
            loss_scale=loss_scale,
        )


def build_runtime(config: Config, workdir: str | Path | None = None) -> Runtime:
    """The runtime for ``config.offload.mode``. ``workdir`` holds the NVMe state when
    ``memory.nvme_path`` is empty."""
    if config.offload.mode == "auto":
        from hetjax.planner import resolve_auto

        config = resolve_auto(config, workdir)
    if config.offload.mode == "none":
        return InMemoryRuntime(config)
    if config.offload.mode == "stream" and config.distributed.data_parallel != 1:
        from hetjax.zero import ZeroRuntime  # imports this module

        return ZeroRuntime(config, workdir=workdir)
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


class Faults:
    """Fault injection for the crash and divergence tests, from the environment:
    ``HETJAX_FAULTS="nan@3,kill_saving@4"``. ``nan@N`` makes step N's gradients NaN;
    ``kill_mid_step@N`` SIGKILLs the process while step N runs; ``kill_saving@N`` right
    after the checkpoint of step N is handed to the background writer;
    ``kill_saved@N`` once that checkpoint is complete."""

    KINDS = ("nan", "kill_mid_step", "kill_saving", "kill_saved")

    def __init__(self, spec: str = ""):
        self.at: dict[str, set[int]] = {k: set() for k in self.KINDS}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, step = item.partition("@")
            if kind not in self.KINDS or not step.isdigit():
                raise ConfigError(
                    f"HETJAX_FAULTS item {item!r}: expected <kind>@<step> with kind one of "
                    f"{', '.join(self.KINDS)}"
                )
            self.at[kind].add(int(step))

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get("HETJAX_FAULTS", ""))

    def hit(self, kind: str, step: int) -> bool:
        """Whether fault ``kind`` is due at ``step``; each fires once (a step redone
        after a rollback runs clean)."""
        if step in self.at[kind]:
            self.at[kind].discard(step)
            return True
        return False

    @staticmethod
    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_later(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, Faults.kill)
    timer.daemon = True
    timer.start()
    return timer


def train(config: Config, workdir: str | Path, verbose: bool = True) -> TrainResult:
    """Trains to step ``config.train.steps``; writes ``metrics.jsonl``, ``config.json``
    and checkpoints into ``workdir`` and returns the losses, validation loss and params.

    With checkpoints in ``workdir`` (``checkpoint.resume=auto``) the run continues from
    the newest complete one. ``losses`` holds the steps this call ran."""
    tune_host_allocator(bounded=bool(config.memory.host_budget))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t, ck = config.train, config.checkpoint
    faults = Faults.from_env()
    main = jax.process_index() == 0  # metrics, logs and summaries from process 0 only
    out = MetricsWriter(workdir, t.steps, t.log_every, enabled=verbose and main)
    ckpt = (
        _open_checkpoints(config, workdir, out)
        if ck.enabled or t.on_nonfinite == "rollback"
        else None
    )
    runtime = None
    try:
        resume = ckpt.latest() if ckpt is not None and ck.resume == "auto" else None
        if resume is not None:
            t0 = time.perf_counter()
            out.log(f"restoring checkpoint step {resume} from {ckpt.directory} ...")
            state, meta = ckpt.restore(resume)
            out.log(f"checkpoint read in {time.perf_counter() - t0:.1f} s")
            check_compatible(meta, config, ckpt.directory)
        if config.offload.mode == "auto":  # decide the placement first (hetjax/planner.py)
            from hetjax.planner import resolve_auto

            config = resolve_auto(config, workdir, out.log)
        if main:
            (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        train_data, val_data, data_desc = make_datasets(config)
        t0 = time.perf_counter()
        out.log(f"building the {config.offload.mode} runtime: initialising state, planning ...")
        runtime = build_runtime(config, workdir)
        out.log(f"runtime ready in {time.perf_counter() - t0:.1f} s")
        model = build_model(config.model)
        n_params = model.param_count()
        tokens_per_step = t.batch_size * t.seq_len
        flops_per_step = model.flops_per_token(t.seq_len) * tokens_per_step
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
        peak = peak_flops(config.model.compute_dtype)
        out.log(
            f"mfu against {peak / 1e12:.3f} TFLOP/s ({config.model.compute_dtype} matmul, measured)"
        )
        step, data_offset = 0, 0
        if resume is not None:
            runtime.load_state(state)
            step, data_offset = int(meta["step"]), int(meta.get("data_offset", 0))
            out.log(f"resumed from checkpoint step {step} in {ckpt.directory}")
            out.advance(step)
            del state
        losses, records = [], []
        timer = StepTimer()
        bad_streak = 0
        last_saved = step

        def save(at: int) -> None:
            nonlocal last_saved
            t0 = time.perf_counter()
            meta = {"step": at, "data_offset": data_offset, "config": config.to_dict()}
            ckpt.save(at, runtime.save_state(), meta)
            last_saved = at
            out.log(
                f"checkpoint: step {at} snapshot in {time.perf_counter() - t0:.2f} s, "
                f"writing to {ckpt.directory / str(at)} in the background"
            )
            if faults.hit("kill_saving", at):
                Faults.kill()
            if faults.hit("kill_saved", at):
                ckpt.wait()
                Faults.kill()

        while step < t.steps:
            step += 1
            batch = train_data.batch(step - 1 + data_offset)  # (B, T+1)
            batch = batch.reshape(t.grad_accum, -1, t.seq_len + 1)  # this process's rows
            killer = (
                _kill_later(0.5 * (records[-1]["step_time_s"] if records else 0.05))
                if faults.hit("kill_mid_step", step)
                else None
            )
            recorder = (
                timeline.Recorder(step) if t.trace_every and step % t.trace_every == 0 else None
            )
            with timeline.recording(recorder):
                stats = runtime.train_step(batch, poison=faults.hit("nan", step))
            if killer is not None:
                killer.join()  # the step outlived the timer: kill now, still before any save
            trace = recorder.finish() if recorder is not None else None
            step_time = timer.lap()
            losses.append(stats.loss)
            rec = step_record(
                step,
                stats.loss,
                step_time,
                tokens_per_step,
                flops_per_step,
                peak,
                grad_norm=stats.grad_norm,
                **runtime.extra_metrics(),
            )
            if trace is not None:
                trace.write(workdir / "trace")
                overlap = trace.overlap()
                rec.update(
                    trace_busiest_lane=overlap["busiest_lane"],
                    trace_step_over_busiest=overlap["step_over_busiest"],
                )
                timer.lap()  # writing the trace is not the next step's time
            if config.model.compute_dtype == "float16":
                rec.update(loss_scale=stats.loss_scale, skipped=stats.skipped)
            if stats.nonfinite:
                rec["nonfinite"] = True
            records.append(rec)
            out.step(rec)
            if stats.nonfinite:
                bad_streak += 1
                step, data_offset = _on_nonfinite(
                    config, stats, step, data_offset, bad_streak, runtime, ckpt, out
                )
                continue
            bad_streak = 0
            if ck.every_steps and step % ck.every_steps == 0:
                save(step)
        runtime.settle()  # outstanding optimizer work done, state written out
        if ck.at_end and last_saved != step:
            save(step)
        val_loss = evaluate(runtime, val_data, t.eval_batches)
        if t.eval_batches and losses:
            out.log(
                f"final validation loss {val_loss:.4f} over {t.eval_batches} batches "
                f"(train loss first {losses[0]:.4f}, last {losses[-1]:.4f})"
            )
        elif not losses:
            out.log(f"nothing to train: the checkpoint is at step {step} of {t.steps}")
        times = [r["step_time_s"] for r in records]
        summary = {
            "val_loss": val_loss,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps": t.steps,
            "mean_step_time_s": float(np.mean(times[1:] or times)) if times else None,
        }
        if main:
            (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        params = runtime.params()
        if ckpt is not None:
            ckpt.wait()  # the last checkpoint is complete before the run says it is done
    finally:
        out.close()
        if runtime is not None:
            runtime.close()
        if ckpt is not None:
            ckpt.manager.close()
    return TrainResult(losses, val_loss, params, records)


def _open_checkpoints(config: Config, workdir: Path, out: MetricsWriter) -> Checkpointer:
    """Opens ``checkpoint.dir``; with ``resume=never`` refuses to touch existing
    checkpoints unless ``overwrite`` (which deletes them)."""
    ck = config.checkpoint
    ckpt = Checkpointer(checkpoint_dir(config, workdir), ck.keep, ck.async_save)
    steps = ckpt.steps()
    if steps and ck.resume == "never":
        if not ck.overwrite:
            ckpt.manager.close()
            raise TrainingError(
                f"{ckpt.directory} holds checkpoints (steps {steps}) and "
                "checkpoint.resume=never: refusing to overwrite them. Resume with "
                "checkpoint.resume=auto, pass --overwrite (checkpoint.overwrite=true) to "
                "delete them, or use another --workdir"
            )
        out.log(f"checkpoint.overwrite: deleting checkpoints {steps} in {ckpt.directory}")
        ckpt.delete_all()
    return ckpt


def _on_nonfinite(config, stats, step, data_offset, bad_streak, runtime, ckpt, out):
    """A step's loss or gradient was not finite and its update was skipped. Returns the
    (step, data offset) to go on from, per ``train.on_nonfinite``."""
    t = config.train
    what = f"loss {stats.loss}, gradient norm {stats.grad_norm}"
    if t.on_nonfinite == "stop" or bad_streak > t.max_nonfinite:
        why = (
            "train.on_nonfinite=stop"
            if t.on_nonfinite == "stop"
            else f"{bad_streak} non-finite steps in a row (train.max_nonfinite={t.max_nonfinite})"
        )
        raise TrainingError(
            f"step {step}: {what}; the update was skipped and nothing non-finite was saved. "
            f"Stopping ({why}). Lower optimizer.lr, raise optimizer.warmup_steps, or enable "
            "optimizer.grad_clip; the run resumes from its newest checkpoint"
        )
    if t.on_nonfinite == "skip":
        out.log(f"step {step}: {what}; update skipped (train.on_nonfinite=skip)")
        return step, data_offset
    ckpt.wait()
    back = ckpt.latest()
    if back is None:
        raise TrainingError(
            f"step {step}: {what}; train.on_nonfinite=rollback but there is no checkpoint "
            f"yet in {ckpt.directory}. Lower checkpoint.every_steps or use skip"
        )
    state, _ = ckpt.restore(back)
    runtime.load_state(state)
    # Step back + 1 takes the batch after the bad one (step - 1 + data_offset): the
    # batches from the checkpoint to the bad one are skipped, as PaLM does at a spike.
    new_offset = step + data_offset - back
    out.log(
        f"step {step}: {what}; rolled back to checkpoint step {back}, skipping "
        f"{step - back} batches (train.on_nonfinite=rollback)"
    )
    return back, new_offset


def evaluate(runtime: Runtime, data, num_batches: int) -> float:
    if num_batches == 0:
        return float("nan")
    return float(np.mean([runtime.eval_loss(data.batch(i)) for i in range(num_batches)]))
