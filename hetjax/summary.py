"""The run summary: where each kind of training state lived, the bytes moved per step
between the tiers, what a step cost against the in-memory step, and where the run's
outputs are. Logged at the end of a run and added to ``<workdir>/summary.json``
(:func:`report`, called by ``train.py``).

Where state lived is the runtime's start-up plans (``hetjax/memory.py``) and what the
ledger recorded; the bytes moved are measured: host <-> device from the traced step's
timeline (``train.trace_every``), NVMe from every step's metrics. The reference step is
measured in the same run when ``train.in_memory_steps`` asks for it (the whole state on
the device, no budgets: possible only where it fits the real device), else not given.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetjax.config import Config, OffloadConfig, format_bytes
from hetjax.planning.plan import Plan
from hetjax.planning.wear import Wear
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import state_format
from hetjax.types import Runtime

TIER_NAMES = {"device": "on the device", "host": "in host RAM", "nvme": "on NVMe"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    tiers: dict[str, str]  # kind of state -> device | host | nvme (where most of it lived)
    where: dict[str, str]  # kind of state -> how it lived there, in words
    held_bytes: dict[str, int]  # tier -> peak bytes the runtime held (its ledger)
    moved_bytes: dict[str, int]  # host_to_device, device_to_host, nvme_read, nvme_write
    moved_from: dict[str, str]  # the same keys -> what the figure was measured on
    step_s: float  # median s/step of the run (its first step compiles: left out)
    in_memory_step_s: float | None  # median s/step in memory, measured here (None: not)
    in_memory_steps: int
    losses: dict[str, float]  # first, last_tenth_mean, val
    paths: dict[str, str]  # metrics, loss_curves, checkpoint, timeline, summary
    # SSD wear at the measured NVMe writes and step time (planning/wear.py): bytes a
    # step and a day, the fraction of drive life a run of train.steps consumes
    wear: dict[str, Any] = dataclasses.field(default_factory=dict)
    wear_line: str = ""
    wear_warning: str = ""  # Wear.warning: only where the run uses much of the drives
    # what the batch costs at the planned placement (planning/batch.py), where the run
    # was planned (offload.mode=auto): the plan's lines
    batch_cost: list[str] = dataclasses.field(default_factory=list)

    def brief(self) -> list[str]:
        """The summary in a few log lines (the rest: :meth:`lines`, ``--verbose``, and
        ``summary.json``): the step time, the losses, a wear warning where it matters
        (``Wear.warning``) and the outputs."""
        out = [f"summary: step time {self.step_s:.3f} s (median of the run's steps)"]
        if self.in_memory_step_s is not None:
            out[0] += (
                f", {self.step_s / self.in_memory_step_s:.2f}x the in-memory step "
                f"({self.in_memory_step_s:.3f} s, timed after the run)"
            )
        loss = self.losses
        out.append(
            f"summary: loss {loss['first']:.4f} at the first step, {loss['last_tenth_mean']:.4f} "
            f"over the last tenth of the steps, validation {loss['val']:.4f}"
        )
        if self.wear_warning:
            out.append(f"summary: {self.wear_warning}")
        out += [f"summary: {line}" for line in self.batch_cost[:1]]  # the plan's (auto)
        out += self.batch_cost[1:]
        out.append(
            "summary: the tier each kind of state used and the bytes moved a step are in "
            "summary.json (--verbose prints them; docs/guide/running.md#the-run-summary); "
            "outputs:"
        )
        out += [f"  {name:<12} {path}" for name, path in self.paths.items()]
        return out

    def lines(self) -> list[str]:
        """The summary as log lines, in full."""
        out = ["summary: where the state lived"]
        out += [f"  {kind:<32} {how}" for kind, how in self.where.items()]
        if self.held_bytes:
            held = ", ".join(f"{t} {format_bytes(b)}" for t, b in self.held_bytes.items())
            out.append(f"  {'held at peak (the ledger)':<32} {held}")
        if self.moved_bytes:
            out.append("summary: bytes moved per step")
            for key, title in (
                ("host_to_device", "host -> device"),
                ("device_to_host", "device -> host"),
                ("nvme_read", "NVMe read"),
                ("nvme_write", "NVMe written"),
            ):
                if key in self.moved_bytes:
                    out.append(
                        f"  {title:<16} {format_bytes(self.moved_bytes[key]):>12}  "
                        f"({self.moved_from[key]})"
                    )
        if self.wear_line:
            out.append(f"  {self.wear_line}")
        out.append(f"summary: step time {self.step_s:.3f} s (median of the run's steps)")
        if self.in_memory_step_s is not None:
            out.append(
                f"  against {self.in_memory_step_s:.3f} s in memory, measured after the run "
                f"(median of {self.in_memory_steps} steps with the whole state on the "
                f"device, no budgets): {self.step_s / self.in_memory_step_s:.2f}x"
            )
        out += [f"summary: {line}" for line in self.batch_cost[:1]]  # predicted by the plan
        out += self.batch_cost[1:]
        loss = self.losses
        out.append(
            f"summary: loss {loss['first']:.4f} at the first step, {loss['last_tenth_mean']:.4f} "
            f"over the last tenth of the steps, validation {loss['val']:.4f}"
        )
        out.append("summary: outputs")
        out += [f"  {name:<12} {path}" for name, path in self.paths.items()]
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def report(
    config: Config,
    runtime: Runtime,
    records: list[dict[str, Any]],
    workdir: Path,
    train_data,
    checkpoint: Path | None,
    val_loss: float,
    log=print,
    details: bool = True,
    plan: Plan | None = None,
) -> RunSummary | None:
    """Builds the run's summary, measures the in-memory reference step when
    ``train.in_memory_steps`` asks (and the run streamed), logs it (in full with
    ``details``, else :meth:`RunSummary.brief`) and adds it to ``summary.json`` under
    ``"run"``. ``records``: the run's metrics.jsonl records;
    ``checkpoint``: the newest checkpoint's directory (None: none). None when the run
    trained no step. ``plan``: the planner's (``offload.mode=auto``), whose batch
    cost the summary repeats."""
    if not records:
        return None
    streamed = isinstance(runtime, StreamingRuntime)
    in_memory_s = None
    n = config.train.in_memory_steps
    if streamed and n and config.distributed.sharded:
        log(
            "summary: no in-memory reference step (train.in_memory_steps times it on one "
            "device; this run is data-parallel)"
        )
    elif streamed and n:
        log(f"summary: timing {n} in-memory steps (train.in_memory_steps) ...")
        in_memory_s = time_in_memory_steps(config, train_data, n)
    traced = [r["step"] for r in records if "trace_busiest_lane" in r]
    timeline = workdir / "trace" / f"step_{traced[-1]}.png" if traced else None
    moved, moved_from = _moved_bytes(records, timeline)
    losses = [r["loss"] for r in records]
    tenth = max(1, len(losses) // 10)
    paths = {
        "metrics": workdir / "metrics.jsonl",
        "loss curves": workdir / "loss.png",
        "checkpoint": checkpoint,
        "timeline": timeline,
        "summary": workdir / "summary.json",
    }
    step_s = statistics.median(r["step_time_s"] for r in records[1:] or records)
    wear = Wear.of(config, moved.get("nvme_write", 0), step_s)
    summary = RunSummary(
        tiers=_tiers(config, runtime),
        where=_where(config, runtime) if streamed else _where_in_memory(config),
        held_bytes=_held_bytes(records),
        moved_bytes=moved,
        moved_from=moved_from,
        step_s=step_s,
        in_memory_step_s=in_memory_s,
        in_memory_steps=n if in_memory_s is not None else 0,
        losses={
            "first": losses[0],
            "last_tenth_mean": float(np.mean(losses[-tenth:])),
            "val": val_loss,
        },
        paths={k: str(p) for k, p in paths.items() if p is not None},
        wear=_wear_json(wear) if wear.written_per_step else {},
        wear_line=_wear_line(wear, config.memory.nvme_wear_budget),
        wear_warning=_wear_warning(wear, config.memory.nvme_wear_budget),
        batch_cost=plan.batch_cost.lines() if plan is not None and plan.batch_cost else [],
    )
    for line in summary.lines() if details else summary.brief():
        log(line)
    path = workdir / "summary.json"
    written = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**written, "run": summary.to_json()}, indent=2) + "\n")
    return summary


def time_in_memory_steps(config: Config, train_data, steps: int) -> float:
    """Median s/step of ``steps`` steps of the in-memory runtime on the run's first
    batches, after one untimed step that compiles. The whole state on the device and no
    budgets: ``config``'s model, batch and optimizer, offload.mode=none."""
    reference = dataclasses.replace(
        config.replace(model=dict(remat=False)), offload=OffloadConfig(mode="none")
    )
    runtime = InMemoryRuntime(reference)
    t = config.train
    times = []
    try:
        for i in range(steps + 1):
            batch = train_data.batch(i)
            batch = batch.reshape(t.grad_accum, -1, batch.shape[-1])
            t0 = time.perf_counter()
            runtime.train_step(batch)  # its float(loss) waits for the step
            times.append(time.perf_counter() - t0)
    finally:
        runtime.close()
    return statistics.median(times[1:])


def _tiers(config: Config, runtime: Runtime) -> dict[str, str]:
    if not isinstance(runtime, StreamingRuntime):
        return dict.fromkeys(("params", "gradients", "optimizer", "activations"), "device")
    o = config.offload
    return {
        "params": o.params,
        "gradients": "device" if o.optimizer == "device" else "host",
        "optimizer": o.optimizer,
        "activations": o.activations,
    }


def _state_words(config: Config) -> str:
    """The optimizer state's format in words: its kinds' dtypes and bytes a parameter
    (``optimizer.state_dtype``, ``state_format.py``)."""
    fmt = state_format(config.optimizer)
    return f"{fmt.describe()}: {fmt.bytes_per_param:g} bytes a parameter"


def _where_in_memory(config: Config) -> dict[str, str]:
    remat = " (model.remat: blocks recompute in backward)" if config.model.remat else ""
    return {
        "params, gradients, optimizer state": "the device (offload.mode=none)",
        "optimizer state format": _state_words(config),
        "activations": f"the device{remat}",
    }


def _blocks(first: int, last: int) -> str:
    return f"block {first}" if first == last else f"blocks {first}-{last}"


def _where(config: Config, runtime: StreamingRuntime) -> dict[str, str]:
    """How each kind of state lived under the streaming runtime's plans."""
    o, L = config.offload, config.model.num_blocks
    device_plan, host_plan = runtime.plan, runtime.host_plan
    nvme = f"NVMe ({runtime.nvme_dir})"
    dtype = config.model.compute_dtype
    resident = max(device_plan.resident_blocks, len(runtime.device_stages) - 1)
    on_device = "embed, head" + (f", {_blocks(0, resident - 1)}" if resident else "")
    params = f"{nvme}, read through host RAM" if o.params == "nvme" else "host RAM"
    params += f"; {on_device} resident on the device"
    if resident < L:
        params += (
            f", {_blocks(resident, L - 1)} streamed through it "
            f"(prefetch depth {device_plan.prefetch_depth})"
        )
    optimizer = {"nvme": nvme, "host": "host RAM", "device": "the device"}[o.optimizer]
    if host_plan.cached_stages:
        n = len(host_plan.cached_stages)
        optimizer += (
            f"; {n} stage{'s' * (n > 1)} cached in host RAM ({format_bytes(host_plan.cache)})"
        )
    if runtime.device_stages:
        optimizer += f"; {', '.join(runtime.device_stages)} on the device"
    first_kept = L - o.keep_blocks
    activations = f"block boundaries {TIER_NAMES[o.activations]}, recomputed in backward"
    if not first_kept:
        activations = "every block keeps its activations on the device"
    elif o.keep_blocks:
        activations += f"; {_blocks(first_kept, L - 1)} kept on the device ({o.keep_level})"
    return {
        f"params ({dtype} compute copy)": params,
        "gradients": "copied to host RAM per stage during backward, where the host "
        "optimizer updates it"
        if o.optimizer != "device"
        else "the device",
        f"fp32 master + {config.optimizer.name} state": optimizer,
        "optimizer state format": _state_words(config),
        "activations": activations,
    }


def _wear_line(wear: Wear, budget: float) -> str:
    """The summary's wear line ("" without NVMe writes), with the budget's verdict on
    the measured rate (the planner refused what it projected over it)."""
    if not wear.written_per_step:
        return ""
    over = wear.over_budget(budget)
    return wear.describe() + (f"; measured over the budget: {over}" if over else "")


def _wear_warning(wear: Wear, budget: float) -> str:
    """The wear line the short summary shows: the budget's excess, measured, else
    ``Wear.warning`` ("" for most runs)."""
    if not wear.written_per_step:
        return ""
    over = wear.over_budget(budget)
    return f"warning: SSD wear measured over the budget: {over}" if over else wear.warning()


def _wear_json(wear: Wear) -> dict[str, Any]:
    return {
        "written_per_step": wear.written_per_step,
        "bytes_per_day": wear.bytes_per_day,
        "run_bytes": wear.run_bytes,
        "drives": wear.drives,
        "tbw": wear.tbw,
        "life_fraction": wear.life_fraction,
    }


def _held_bytes(records: list[dict[str, Any]]) -> dict[str, int]:
    fields = (("device", "device_bytes_peak"), ("host", "host_bytes"), ("nvme", "nvme_bytes"))
    # (device_bytes_peak: on the accounted steps only, runtime/loop/ledger.py)
    return {
        tier: max(r[key] for r in records if key in r)
        for tier, key in fields
        if any(key in r for r in records)
    }


def _moved_bytes(
    records: list[dict[str, Any]], timeline_png: Path | None
) -> tuple[dict[str, int], dict[str, str]]:
    """Bytes per step: host <-> device from the traced step's timeline, NVMe the
    median over the run's steps (its first, which compiles, left out)."""
    moved, source = {}, {}
    if timeline_png is not None:
        trace = json.loads(timeline_png.with_suffix(".json").read_text())
        for lane, nbytes in trace["otherData"].get("moved_bytes", {}).items():
            moved[lane] = int(nbytes)
            source[lane] = f"step {trace['otherData']['step']}'s timeline"
    steady = records[1:] or records
    for io in ("read", "write"):
        key = f"nvme_{io}_bytes"
        if key in records[-1]:
            moved[f"nvme_{io}"] = int(statistics.median(r[key] for r in steady))
            source[f"nvme_{io}"] = f"median of {len(steady)} steps"
    return moved, source
