"""The training loop shared by every runtime.

A *runtime* (``hetjax/runtime/``) owns the training state and runs one optimizer step
on a global batch, returning a :class:`~hetjax.types.StepReport`; the loop around it
(data, metrics, checkpoints, evaluation, the divergence guard) is the same for all of
them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax import census, timeline
from hetjax.allocator import tune_host_allocator
from hetjax.chat import sources_line
from hetjax.checkpoint import Checkpointer, check_compatible, checkpoint_dir
from hetjax.config import Config, format_bytes
from hetjax.data import decoder_length
from hetjax.distributed import any_process, is_main_process
from hetjax.faults import Faults
from hetjax.guards import (
    SpikeGuard,
    checkpoints_sharing,
    damaged_page,
    fall_back,
    restore_good,
    set_aside,
)
from hetjax.instruct import make_datasets
from hetjax.metrics import MetricsWriter, StepTimer, peak_flops, plot_losses, step_record
from hetjax.parallel.zero import Zero3
from hetjax.planning.auto import plan_auto, resolve_auto
from hetjax.preemption import Preempted, StopSignals
from hetjax.run_lock import LOCK_NAME, RunLocks
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.summary import report as report_run
from hetjax.types import CheckpointDamaged, CheckpointError, Runtime, TrainingError
from models import build_model
from models.attention import probe_for
from models.staged import row_flops


def build_runtime(config: Config, workdir: str | Path | None = None) -> Runtime:
    """The runtime for ``config.offload.mode``. ``workdir`` holds the NVMe state when
    ``memory.nvme_path`` is empty."""
    if config.offload.mode == "auto":
        config = resolve_auto(config, workdir)
    if config.offload.mode == "none":
        return InMemoryRuntime(config)
    if config.offload.mode == "stream" and config.distributed.sharded:
        return StreamingRuntime(config, workdir=workdir, parallel=Zero3(config))
    if config.offload.mode == "stream":
        return StreamingRuntime(config, workdir=workdir)
    raise AssertionError(config.offload.mode)  # validated by OffloadConfig


# -- the loop ----------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    losses: list[float]  # the steps this call ran
    val_loss: float  # NaN without train.eval_batches
    params: Any
    records: list[dict[str, Any]]
    workdir: Path  # where metrics.jsonl and summary.json were written (process 0)


# the runtime's start-up plan lines printed with --verbose only (the mesh's and the
# fallbacks' always): the memory plans' parts (hetjax/runtime/setup.py, describe_plans)
PLAN_DETAILS = ("device plan:", "host plan:", "nvme:", "NVMe copies:", "optimizer state of")


def train(
    config: Config,
    workdir: str | Path,
    verbose: bool = True,
    return_params: bool = True,
    details: bool = False,
) -> TrainResult:
    """Trains to step ``config.train.steps``; writes ``metrics.jsonl``, ``config.json``
    and checkpoints into ``workdir`` and returns the losses, validation loss and params
    (``return_params`` False: None, and the model is never gathered into RAM whole; the
    command line's choice, where state on NVMe is bigger than RAM). ``verbose``: log at
    all; ``details`` (``--verbose``): the plans' parts and the summary's breakdown too.

    With checkpoints in ``workdir`` (``checkpoint.resume=auto``) the run continues from
    the newest complete one. ``losses`` holds the steps this call ran.

    The run holds a lock on ``workdir`` (and on ``memory.nvme_path`` when it may place
    state there) until it returns; another live run holding either makes it raise
    ConfigError at once (``hetjax/run_lock.py``). With checkpoints on, SIGTERM or SIGUSR1
    stop it between steps: it writes a checkpoint of the step reached, waits for it and
    raises :class:`~hetjax.preemption.Preempted` (``hetjax/preemption.py``)."""
    tune_host_allocator(config.memory.host_budget)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    process = jax.process_index()
    with RunLocks() as locks, StopSignals(active=config.checkpoint.enabled) as signals:
        if process == 0:  # one run per workdir; a run's processes share it
            locks.hold(workdir, f"workdir {workdir}", "use another --workdir")
        nvme, o = config.memory.nvme_path, config.offload
        tiers = (o.params, o.optimizer, o.activations)
        if nvme and (o.mode == "auto" or (o.mode == "stream" and "nvme" in tiers)):
            # each process writes its own part there (<nvme_path>/proc<k> with ZeRO-3);
            # with several drives, on each
            for drive in config.memory.nvme_paths:
                locks.hold(
                    drive,
                    f"memory.nvme_path {drive}",
                    "point memory.nvme_path at another directory",
                    name=LOCK_NAME if process == 0 else f"hetjax.proc{process}.lock",
                )
        return _train(config, workdir, verbose, signals, return_params, details)


def _train(
    config: Config,
    workdir: Path,
    verbose: bool,
    signals: StopSignals,
    return_params: bool,
    details: bool = False,
) -> TrainResult:
    """The run: start-up (:func:`_start`), the steps (:meth:`_Run.step`), the end
    (:meth:`_Run.finish`); what it opened closed whatever happens."""
    t = config.train
    out = MetricsWriter(
        workdir, t.steps, t.log_every, enabled=verbose and is_main_process(), details=details
    )
    out.log(f"hetjax: {sources_line(config)}")  # where the weights and the tokens come from
    uses_checkpoints = config.checkpoint.enabled or t.on_nonfinite == "rollback"
    ckpt = _open_checkpoints(config, workdir, out) if uses_checkpoints else None
    run = None
    failed = False  # an error is on its way out: closing must not mask it
    try:
        run = _start(config, workdir, out, ckpt, signals, Faults.from_env())
        while run.step < t.steps:
            run.step_once()
        return run.finish(return_params)
    except BaseException:
        failed = True
        raise
    finally:
        Faults.disarm()
        out.close()
        if run is not None:
            run.runtime.close()
        if ckpt is not None:
            ckpt.close_manager(quiet=failed)


def _start(config, workdir, out, ckpt, signals, faults) -> _Run:
    """Start-up, the cheap checks first: data, the checkpoint to resume (read), the
    placement (``offload.mode=auto``), the runtime; only then is the workdir changed
    (:func:`_begin_writing`: a start that fails leaves the last run's files as they
    were), the run described and the checkpoint's state loaded."""
    t, ck = config.train, config.checkpoint
    train_data, val_data, data_desc = make_datasets(config)
    resume = ckpt.latest() if ckpt is not None and ck.resume == "auto" else None
    if resume is not None:
        t0 = time.perf_counter()
        out.log(f"restoring checkpoint step {resume} from {ckpt.directory} ...")
        state, meta, resume = restore_good(ckpt, resume, out.log)
        out.log(f"checkpoint read in {time.perf_counter() - t0:.1f} s")
        check_compatible(meta, config, ckpt.directory)
    probe_for(config.model, t.seq_len)  # cuDNN's attention, before the plan counts on it
    plan = None  # the planner's, where offload.mode=auto made one (the summary's batch cost)
    if config.offload.mode == "auto":  # decide the placement first (hetjax/planning/)
        config, plan = plan_auto(config, workdir, out.log, out.detail)
    t0 = time.perf_counter()
    out.log(f"building the {config.offload.mode} runtime: initialising state, planning ...")
    runtime = build_runtime(config, workdir)
    try:
        out.log(f"runtime ready in {time.perf_counter() - t0:.1f} s")
        _begin_writing(config, workdir, ckpt, signals, resume, out, is_main_process())
        run = _Run(config, workdir, out, ckpt, signals, faults, runtime, train_data, val_data)
        run.plan = plan
        run.describe(data_desc)
        while resume is not None:
            try:
                runtime.load_state(state)
                break
            except CheckpointDamaged as e:  # its pages fail their CRC-32 as they are read
                state, meta, resume = fall_back(ckpt, resume, e, out.log)
                check_compatible(meta, config, ckpt.directory)
    except BaseException:
        runtime.close()
        raise
    if resume is not None:
        run.step = run.last_saved = int(meta["step"])
        run.data_offset = int(meta.get("data_offset", 0))
        out.log(f"resumed from checkpoint step {run.step} in {ckpt.directory}")
        out.advance(run.step)
    if run.step < t.steps:
        out.log(
            f"step {run.step + 1} compiles the step functions first: seconds more than the rest ..."
        )
    return run


@dataclasses.dataclass
class _Run:
    """A run between its start-up and its end: what its steps share."""

    config: Config
    workdir: Path
    out: MetricsWriter
    ckpt: Checkpointer | None
    signals: StopSignals
    faults: Faults
    runtime: Runtime
    train_data: Any
    val_data: Any
    plan: Any = None  # offload.mode=auto's (planning/search.py Plan)
    step: int = 0  # the last step done
    data_offset: int = 0  # batches skipped by rollbacks
    losses: list[float] = dataclasses.field(default_factory=list)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    timer: StepTimer = dataclasses.field(default_factory=StepTimer)
    guard: SpikeGuard | None = None
    bad_streak: int = 0  # non-finite or spiking steps in a row
    damaged_streak: int = 0  # steps in a row that read a damaged page
    last_saved: int = 0
    last_saved_at: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self):
        t = self.config.train
        self.guard = SpikeGuard(t.spike_factor, t.spike_window)
        model = build_model(self.config.model)
        self.n_params = model.param_count()
        self.tokens_per_step = t.batch_size * t.seq_len
        target_len = decoder_length(self.config.data, t.seq_len)
        self.flops_per_step = row_flops(model, t.seq_len, target_len) * t.batch_size
        self.peak = peak_flops(self.config.model.compute_dtype)

    def describe(self, data_desc: str) -> None:
        """The run's first lines: the model, the batch, the plans, the NVMe tier."""
        config, out, t = self.config, self.out, self.config.train
        out.log(
            f"hetjax: {self.n_params / 1e6:.2f}M params, offload.mode={config.offload.mode}, "
            f"{jax.devices()[0].platform} x{jax.device_count()}; data: {data_desc}"
        )
        out.log(
            f"batch {t.batch_size} x seq {t.seq_len} = {self.tokens_per_step:,} tokens/step, "
            f"grad_accum {t.grad_accum}, {t.steps} steps -> {self.workdir}"
        )
        for line in self.runtime.plan_lines():  # the terms: docs/guide/running.md#the-runs-output
            (out.detail if line.startswith(PLAN_DETAILS) else out.log)(line)
        _log_nvme(config, self.runtime, out)
        out.detail(
            f"mfu against {self.peak / 1e12:.3f} TFLOP/s ({config.model.compute_dtype} "
            "matmul, measured)"
        )

    def save(self, at: int) -> None:
        """A checkpoint of step ``at``, handed to the background writer."""
        t0 = time.perf_counter()
        meta = {"step": at, "data_offset": self.data_offset, "config": self.config.to_dict()}
        self.ckpt.save(at, self.runtime.save_state(), meta)
        self.last_saved, self.last_saved_at = at, time.monotonic()
        _log_completed(self.ckpt, self.out)
        linked = self.ckpt.report.linked_bytes
        self.out.log(
            f"checkpoint: step {at} snapshot in {time.perf_counter() - t0:.2f} s"
            + (f" ({format_bytes(linked)} of NVMe state hard-linked)" if linked else "")
            + f", writing to {self.ckpt.directory / str(at)} in the background"
        )
        self.faults.checkpoint_handed_over(at, self.ckpt.wait)

    def safe_point(self) -> None:
        """Between steps: stop on a signal, or save if one is due by time. Every process
        takes the same decision (one tiny all-gather)."""
        ck = self.config.checkpoint
        minutes = (time.monotonic() - self.last_saved_at) / 60
        stop, due = any_process(
            self.signals.received is not None, ck.every_minutes and minutes >= ck.every_minutes
        )
        if stop:
            unsaved = self.last_saved != self.step
            _preempt(self.signals, self.step, unsaved, self.save, self.ckpt, self.out)
        if due and self.last_saved != self.step:
            self.save(self.step)

    def step_once(self) -> None:
        """The next step: the safe point before it, the step, its record, then what its
        outcome asks for (a rollback, a skip, a checkpoint)."""
        t = self.config.train
        self.safe_point()
        self.step += 1
        step = self.step
        batch = self.train_data.batch(step - 1 + self.data_offset)  # (B, W): windows
        batch = batch.reshape(t.grad_accum, -1, batch.shape[-1])  # this process's rows
        last_s = self.records[-1]["step_time_s"] if self.records else 0.05
        faults = self.faults.start_step(step, last_s)
        traced = t.trace_every and step % t.trace_every == 0
        recorder = timeline.Recorder(step) if traced else None
        try:
            with timeline.recording(recorder):
                stats = self.runtime.train_step(
                    batch,
                    poison=faults.poison,
                    loss_limit=self.guard.limit(),
                    loss_gain=faults.loss_gain,
                )
        except Exception as e:
            damaged = damaged_page(e)
            if damaged is None:
                raise
            self.damaged_streak += 1
            self.runtime, self.step, self.data_offset = _on_damaged_page(
                self.config, self.workdir, damaged, e, step, self.damaged_streak,
                self.runtime, self.ckpt, self.out,
            )  # fmt: skip
            Faults.disarm()
            self.timer.lap()
            return
        faults.step_ended()
        self.records.append(rec := self.record(stats, recorder))
        self.out.step(rec)
        if stats.nonfinite or stats.spike:
            self.bad_streak += 1
            self.step, self.data_offset = _on_nonfinite(
                self.config, self.bad_news(stats), step, self.data_offset, self.bad_streak,
                self.runtime, self.ckpt, self.out,
            )  # fmt: skip
            return
        if not stats.skipped:  # an fp16 overflow's loss is not one to compare with
            self.guard.add(stats.loss)
        self.bad_streak = self.damaged_streak = 0
        every = self.config.checkpoint.every_steps
        if every and step % every == 0:
            self.save(step)

    def record(self, stats, recorder) -> dict[str, Any]:
        """The step's record (metrics.jsonl): its loss, time and rates, its trace's
        overlap, the fp16 scale, the guards' flags, the validation loss when due."""
        t, step = self.config.train, self.step
        trace = recorder.finish() if recorder is not None else None
        step_time = self.timer.lap()
        self.losses.append(stats.loss)
        rec = step_record(
            step, stats.loss, step_time, self.tokens_per_step, self.flops_per_step, self.peak,
            grad_norm=stats.grad_norm,
            **stats.metrics,
            **census.step_fields(),  # the process's RSS and what malloc holds
        )  # fmt: skip
        if trace is not None:
            trace.write(self.workdir / "trace")
            overlap = trace.overlap()
            rec.update(
                trace_busiest_lane=overlap["busiest_lane"],
                trace_step_over_busiest=overlap["step_over_busiest"],
            )
            self.timer.lap()  # writing the trace is not the next step's time
        if self.config.model.compute_dtype == "float16":
            rec.update(loss_scale=stats.loss_scale, skipped=stats.skipped)
        if stats.nonfinite:
            rec["nonfinite"] = True
        if stats.spike:
            self.guard.spikes += 1
            rec.update(loss_spike=True, loss_spikes=self.guard.spikes)
        if t.eval_every and t.eval_batches and step % t.eval_every == 0 and step < t.steps:
            self.runtime.settle()  # lock-free: the updates so far applied
            rec["val_loss"] = evaluate(self.runtime, self.val_data, t.eval_batches)
            self.timer.lap()  # the evaluation is not the next step's time
        return rec

    def bad_news(self, stats) -> str:
        """What was wrong with a non-finite or spiking step, in words."""
        if not stats.spike:
            return f"loss {stats.loss}, gradient norm {stats.grad_norm}"
        t = self.config.train
        return (
            f"loss spike: loss {stats.loss:.4g} > train.spike_factor {t.spike_factor:g} x "
            f"{self.guard.median():.4g}, the median loss of the last {t.spike_window} steps"
        )

    def finish(self, return_params: bool) -> TrainResult:
        """The end: outstanding work done, the last checkpoint, the validation loss,
        ``summary.json`` and the run's report (:meth:`report`)."""
        t, ck, out, step = self.config.train, self.config.checkpoint, self.out, self.step
        self.runtime.settle()  # outstanding optimizer work done, state written out
        if ck.at_end and self.last_saved != step:
            self.save(step)
        val_loss = evaluate(self.runtime, self.val_data, t.eval_batches)
        losses = self.losses
        if t.eval_batches and losses:
            out.log(
                f"final validation loss {val_loss:.4f} over {t.eval_batches} batches "
                f"(train loss first {losses[0]:.4f}, last {losses[-1]:.4f})"
            )
        elif not losses:
            out.log(
                f"nothing to train: the checkpoint is at step {step} of {t.steps}. To go on: "
                f"more steps (--config.train.steps=N, N > {step}) resume it; "
                "--resume=never --overwrite starts over here; another --workdir starts "
                "afresh beside it"
            )
        if is_main_process():
            self.report(val_loss)
        params = self.runtime.params() if return_params else None
        if self.ckpt is not None:
            self.ckpt.wait()  # the last checkpoint is complete before the run says it is done
            _log_completed(self.ckpt, out)
        return TrainResult(losses, val_loss, params, self.records, self.workdir)

    def report(self, val_loss: float) -> None:
        """``summary.json`` (a run that trained nothing keeps the last one's), the loss
        curves and the run summary (``summary.py``)."""
        losses, workdir, out = self.losses, self.workdir, self.out
        if not losses and (workdir / "summary.json").exists():
            return
        times = [r["step_time_s"] for r in self.records]
        summary = {
            "val_loss": val_loss,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps": self.config.train.steps,
            "mean_step_time_s": float(np.mean(times[1:] or times)) if times else None,
            "loss_spikes": self.guard.spikes,
        }
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not (losses and out.enabled):  # from metrics.jsonl, which a quiet run does not write
            return
        plot = plot_losses(workdir / "metrics.jsonl", workdir / "loss.png", val_loss)
        out.log(f"loss curves: {plot}")
        ckpt, saved = self.ckpt, self.last_saved
        report_run(
            self.config, self.runtime, self.records, workdir, self.train_data,
            ckpt.directory / str(saved) if ckpt is not None and saved else None,
            val_loss, log=out.log, details=out.details, plan=self.plan,
        )  # fmt: skip


def _log_nvme(config: Config, runtime: Runtime, out: MetricsWriter) -> None:
    """Where the run's NVMe tier is, and what "NVMe" means, when it holds state."""
    nvme = getattr(runtime, "nvme_dir", None)
    o = config.offload
    if nvme is not None and "nvme" in (o.params, o.optimizer, o.activations):
        out.log(
            f"NVMe tier: {nvme} (memory.nvme_path: any directory, best on an NVMe SSD; "
            "docs/guide/offload.md#nvme-tier-and-the-host-optimizer-loop)"
        )


def _log_completed(ckpt: Checkpointer, out: MetricsWriter) -> None:
    for line in ckpt.completed:
        out.log(line)
    ckpt.completed.clear()


def _preempt(signals: StopSignals, step: int, unsaved: bool, save, ckpt, out) -> None:
    """Stops the run at a safe point: a checkpoint of ``step`` (unless the newest one is
    of it already), complete on disk, then :class:`Preempted`."""
    reason = signals.received or "a signal to another process"
    out.log(f"{reason}: stopping at step {step}, between steps; writing a checkpoint")
    if unsaved:
        save(step)
    ckpt.wait()  # complete on disk before the process says so
    saved = "its checkpoint is complete" if unsaved else "nothing new to save"
    since = f", {signals.since():.1f} s after the signal" if signals.received else ""
    out.log(f"{reason}: stopped at step {step}; {saved}{since}")
    raise Preempted(reason, step, ckpt.directory / str(step) if unsaved else None)


# what a run writes into its workdir besides checkpoints, config.json and its NVMe state:
# a run started over (--resume=never --overwrite) removes the last run's
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "trace", "tensorboard")


def _begin_writing(config, workdir, ckpt, signals, resume, out, main) -> None:
    """Once start-up has checked everything: stops if a signal came during it (nothing
    written yet); with ``resume=never`` and ``overwrite`` deletes the last run's
    checkpoints and outputs (:data:`RUN_OUTPUTS`); writes ``config.json``."""
    (stop,) = any_process(signals.received is not None)  # every process stops alike
    if stop:
        step, reason = resume or 0, signals.received or "a signal to another process"
        out.log(f"{reason}: stopping before step {step + 1}; nothing in the workdir changed")
        raise Preempted(reason, step, None)
    ck = config.checkpoint
    if ck.resume == "never" and ck.overwrite:
        steps = ckpt.steps() if ckpt is not None else []
        if steps:
            out.log(f"checkpoint.overwrite: deleting checkpoints {steps} in {ckpt.directory}")
            ckpt.delete_all()
        if main:
            for name in RUN_OUTPUTS:
                old = workdir / name
                if old.is_dir():
                    shutil.rmtree(old)
                else:
                    old.unlink(missing_ok=True)
    if main:
        (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _open_checkpoints(config: Config, workdir: Path, out: MetricsWriter) -> Checkpointer:
    """Opens ``checkpoint.dir``; with ``resume=never`` refuses existing checkpoints
    unless ``overwrite`` (:func:`_begin_writing` deletes them once the run is checked)."""
    ck = config.checkpoint
    ckpt = Checkpointer(
        checkpoint_dir(config, workdir),
        ck.keep,
        ck.async_save,
        link_nvme=ck.link_nvme,
        copy_every=ck.copy_every,
    )
    steps = ckpt.steps()
    if steps and ck.resume == "never" and not ck.overwrite:
        ckpt.manager.close()
        raise TrainingError(
            f"{ckpt.directory} holds checkpoints (steps {steps}) and "
            "checkpoint.resume=never: refusing to overwrite them. Resume with "
            "checkpoint.resume=auto, pass --overwrite (checkpoint.overwrite=true) to "
            "delete them, or use another --workdir"
        )
    return ckpt


def _on_nonfinite(config, what, step, data_offset, bad_streak, runtime, ckpt, out):
    """A step's loss or gradient was not finite, or its loss a spike (``what`` says
    which), and its update was skipped. Returns the (step, data offset) to go on from,
    per ``train.on_nonfinite``."""
    t = config.train
    if t.on_nonfinite == "stop" or bad_streak > t.max_nonfinite:
        why = (
            "train.on_nonfinite=stop"
            if t.on_nonfinite == "stop"
            else f"{bad_streak} non-finite steps in a row, loss spikes counted "
            f"(train.max_nonfinite={t.max_nonfinite})"
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
        first = (
            f"the first is written at step {config.checkpoint.every_steps}"
            if config.checkpoint.every_steps
            else "checkpoint.every_steps=0 writes none while training"
        )
        raise TrainingError(
            f"step {step}: {what}; the update was skipped and nothing was saved. "
            f"train.on_nonfinite=rollback, but there is no checkpoint to roll back to yet "
            f"in {ckpt.directory} ({first}). Stopping: set checkpoint.every_steps to fewer "
            "steps than the first non-finite one, or use train.on_nonfinite=skip"
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


def _on_damaged_page(config, workdir, damaged, error, step, streak, runtime, ckpt, out):
    """Step ``step`` read a live NVMe page that is not what was written (``damaged``):
    stops the run naming the file, the page and the newest checkpoint with a good copy
    (one not holding the damaged file itself), or, with ``train.on_nonfinite=rollback``,
    restores that checkpoint into a new runtime (the old one's threads stopped at the
    error) and sets the newer ones aside. Returns (runtime, step, data offset)."""
    t = config.train
    where = f"step {step}: {damaged}"
    if ckpt is None:
        raise TrainingError(
            f"{where}. No checkpoint holds a good copy (checkpoints are off): start over, "
            "and enable checkpoint.every_steps to be able to roll back"
        ) from error
    try:
        ckpt.wait()  # a save in flight may have read the damaged file: it is not counted
    except CheckpointError as e:
        out.log(f"the checkpoint in flight failed: {e}")
    bad = checkpoints_sharing(ckpt, Path(damaged.path))
    good = [s for s in ckpt.steps() if s not in bad]
    shared = (
        f"; checkpoints {bad} hold the damaged file itself (hard links share the live "
        "files' blocks: checkpoint.copy_every makes real copies)"
        if bad
        else ""
    )
    if t.on_nonfinite != "rollback" or streak > t.max_nonfinite or not good:
        newest = (
            f"the newest checkpoint with a good copy is step {good[-1]} "
            f"({ckpt.directory / str(good[-1])})"
            if good
            else f"no checkpoint in {ckpt.directory} holds a good copy"
        )
        todo = (
            f"; delete {', '.join(str(ckpt.directory / str(s)) for s in bad)} and restart "
            "to resume from it"
            if bad and good
            else ""
        )
        why = (
            f"{streak} damaged pages in a row (train.max_nonfinite={t.max_nonfinite})"
            if streak > t.max_nonfinite
            else "train.on_nonfinite=rollback rolls back to it"
        )
        raise TrainingError(f"{where}. Stopping: {newest}{shared}{todo} ({why})") from error
    with contextlib.suppress(Exception):  # its threads may have stopped at the error
        runtime.close()
    for s in bad:
        set_aside(ckpt, s)
    state, meta, back = restore_good(ckpt, good[-1], out.log)
    runtime = build_runtime(config, workdir)
    while True:
        try:
            runtime.load_state(state)
            break
        except CheckpointDamaged as e:
            state, meta, back = fall_back(ckpt, back, e, out.log)
    out.log(
        f"{where}; rolled back to checkpoint step {back}, the newest with a good copy"
        f"{shared} (train.on_nonfinite=rollback)"
    )
    return runtime, back, int(meta.get("data_offset", 0))


def evaluate(runtime: Runtime, data, num_batches: int) -> float:
    if num_batches == 0:
        return float("nan")
    return float(np.mean([runtime.eval_loss(data.batch(i)) for i in range(num_batches)]))
