"""Run output: ``metrics.jsonl`` (one JSON object per step), log lines and progress."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsWriter:
    """Appends one JSON object per line to ``<workdir>/metrics.jsonl``; logs every N steps.
    The file (and TensorBoard's) is opened at the first step: a run that fails to start
    leaves the last run's as it was."""

    def __init__(
        self,
        workdir: Path,
        total_steps: int,
        log_every: int,
        enabled: bool = True,
        details: bool = False,
    ):
        self.path = Path(workdir) / "metrics.jsonl"
        self.log_every = log_every
        self.enabled = enabled
        self.details = details  # --verbose: detail() lines are logged too
        self._since_log: list[float] = []  # losses since the last log line
        self._file = self._board = None  # opened by the first step
        # disable=None: a bar on a terminal, none in CI logs (log lines still print).
        self._bar = tqdm(
            total=total_steps,
            desc="train",
            unit="step",
            disable=None if enabled else True,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 (closed by close)
            self._board = _tensorboard(self.path.parent / "tensorboard")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._board.add_scalar(key, value, record["step"])
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{record['loss']:.4f}")
        step = record["step"]
        self._since_log.append(record["loss"])
        if step % self.log_every == 0 or step == 1 or step == self._bar.total:
            # One step's loss jumps with its batch; the mean since the last line reads.
            mean, n = sum(self._since_log) / len(self._since_log), len(self._since_log)
            self._since_log = []
            self.log(
                f"step {step:>6}  loss {record['loss']:.4f}  mean of {n:>4} {mean:.4f}  "
                f"{record['tokens_per_s']:>9.0f} tok/s  {record['step_time_s'] * 1e3:7.1f} ms/step"
                f"  {record['tflops']:.3f} TFLOP/s"
            )
        if "val_loss" in record:
            self.log(f"step {step:>6}  validation loss {record['val_loss']:.4f}")

    def advance(self, steps: int) -> None:
        """Moves the progress bar on (a resumed run starts at its checkpoint's step)."""
        self._bar.update(steps)

    def detail(self, msg: str) -> None:
        """A line for ``--verbose`` only (the plans' parts, the summary's breakdown:
        ``summary.json`` holds them either way)."""
        if self.details:
            self.log(msg)

    def log(self, msg: str) -> None:
        if self.enabled:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        self._bar.close()
        if self._file:
            self._file.close()
        if self._board is not None:
            self._board.close()


def _tensorboard(logdir: Path):
    """A TensorBoard writer of every step's numeric metrics (``metrics.jsonl``'s keys as
    scalar tags) when tensorboardX is installed (``pip install 'hetjax[tensorboard]'``);
    None otherwise."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(logdir=str(logdir), flush_secs=10)


class StepTimer:
    """Wall-clock time of one step (the caller blocks on the step's result first)."""

    def __init__(self):
        self._t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        return dt


def step_record(
    step: int,
    loss: float,
    step_time: float,
    tokens: int,
    flops: float,
    peak_flops: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The per-step metrics every runtime writes, plus rates derived from the runtime's
    ``extra`` fields: ``mfu`` (model FLOP/s over ``peak_flops``), ``nvme_read_gbs`` /
    ``nvme_write_gbs`` (the step's NVMe bytes over its wall time) and
    ``optimizer_params_per_s`` (parameters updated over the optimizer loop's busy time)."""
    rec = {
        "step": step,
        "loss": float(loss),
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "tflops": flops / step_time / 1e12,
    }
    if peak_flops:
        rec["mfu"] = flops / step_time / peak_flops
    for k, v in extra.items():
        rec[k] = float(v) if isinstance(v, float) or hasattr(v, "dtype") else v
    for io in ("read", "write"):
        if f"nvme_{io}_bytes" in rec:
            rec[f"nvme_{io}_gbs"] = rec[f"nvme_{io}_bytes"] / step_time / 1e9
    if rec.get("optimizer_busy_s"):
        rec["optimizer_params_per_s"] = rec["optimizer_params"] / rec["optimizer_busy_s"]
    return rec


@functools.cache
def peak_flops(dtype: str = "float32") -> float:
    """The accelerator's peak FLOP/s for matmuls in ``dtype``, the denominator of MFU.

    Measured here, once per process: the best of a few square matmuls on the default
    device (2048 on CPU, 8192 on accelerators), which is what XLA can reach in practice.
    The one place to look the peak up: a named hardware profile can replace the
    measurement later."""
    import jax
    import jax.numpy as jnp

    n = 2048 if jax.devices()[0].platform == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    matmul = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(matmul(a, a))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def plot_losses(metrics: Path, out: Path, final_val: float = float("nan")) -> Path:
    """``loss.png`` from a run's ``metrics.jsonl`` (every segment of a resumed run; a
    step repeated after a rollback counts once, its last record): the training loss of
    each step, its running mean over about a twentieth of the run, and the validation
    loss at ``train.eval_every`` steps and at the end (``final_val``)."""
    import math

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_step: dict[int, dict] = {}
    for line in Path(metrics).read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    steps = sorted(by_step)
    loss = np.array([by_step[s]["loss"] for s in steps], np.float64)
    window = max(1, len(steps) // 20)
    mean = []
    for i in range(len(steps)):
        recent = loss[max(0, i - window + 1) : i + 1]
        recent = recent[np.isfinite(recent)]  # a skipped non-finite step has no place in it
        mean.append(recent.mean() if recent.size else np.nan)
    val = [(s, by_step[s]["val_loss"]) for s in steps if "val_loss" in by_step[s]]
    if steps and not math.isnan(final_val):
        val.append((steps[-1], final_val))
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, loss, color="#4c72b0", alpha=0.3, linewidth=0.8, label="train loss (step)")
    ax.plot(steps, mean, color="#4c72b0", linewidth=2, label=f"train loss (mean of {window})")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="#c44e52", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return Path(out)
