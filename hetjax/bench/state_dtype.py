"""``python -m hetjax.bench state_dtype``: convergence with the moments in float32,
bfloat16 and int8 (``optimizer.state_dtype``), side by side in one run.

Two shapes, each trained from the same initialisation on the same batches once per
state dtype, in memory (``offload.mode=none``: the same optimizer update as the host
optimizer's jitted path, ``optimizer/moments.py``): ``gpt_tiny``'s model (4 x 256,
byte vocabulary) for 400 steps and GPT-2 small's depth and width (12 x 768, 12 heads;
the byte vocabulary and a short context, so a CPU runs it) for 200. Prints each final
validation loss and its difference from fp32, and draws the training loss curves of
every run into one PNG beside the JSON.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from hetjax.bench.common import _steady_step_time
from hetjax.config import STATE_DTYPES, Config

# (name, model, train): gpt_tiny's model as configs/gpt_tiny.py builds it (the defaults)
# and GPT-2 small's 12 x 768 with a byte vocabulary and a short context (CPU-sized)
SHAPES = (
    ("gpt_tiny", {}, dict(steps=400, batch_size=8, seq_len=64)),
    (
        "gpt_small_shape",
        dict(num_layers=12, d_model=768, num_heads=12, max_seq_len=64),
        dict(steps=200, batch_size=4, seq_len=32),
    ),
)
QUICK_STEPS = 6  # --quick: gpt_tiny's shape only, 6 steps


def _smooth(losses: list[float], window: int = 10) -> np.ndarray:
    """The running mean over the last ``window`` steps (fewer at the start)."""
    x = np.asarray(losses, np.float64)
    total = np.concatenate([[0.0], np.cumsum(x)])
    end = np.arange(1, len(x) + 1)
    start = np.maximum(end - window, 0)
    return (total[end] - total[start]) / (end - start)


def _plot(curves: dict[str, dict[str, list[float]]], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # plotting only: start-up
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(curves), 4.2))
    FigureCanvasAgg(fig)
    for i, (shape, by_dtype) in enumerate(curves.items()):
        ax = fig.add_subplot(1, len(curves), i + 1)
        for dtype, losses in by_dtype.items():
            steps = np.arange(1, len(losses) + 1)
            ax.plot(steps, _smooth(losses), label=f"{dtype} moments", linewidth=1.2)
        ax.set_title(f"{shape}: training loss (mean of 10 steps)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def bench_state_dtype(quick: bool, out_dir: str = "runs/bench") -> dict:
    """Each shape once per state dtype: final validation loss, its difference from
    fp32 and the median seconds a step after the first five; the curves in
    ``<out_dir>/state_dtype.png``."""
    from hetjax.train import train  # the runtime's start-up: only when run

    results: dict = {"shapes": {}}
    curves: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, model, train_cfg in SHAPES[:1] if quick else SHAPES:
            steps = QUICK_STEPS if quick else train_cfg["steps"]
            rows = {}
            for dtype in STATE_DTYPES:
                config = Config().replace(
                    model=model,
                    train={**train_cfg, "steps": steps, "eval_batches": 8, "log_every": 10**6},
                    optimizer=dict(state_dtype=dtype, warmup_steps=min(20, steps)),
                    offload=dict(mode="none"),
                    checkpoint=dict(every_steps=0, at_end=False),
                )
                start = time.perf_counter()
                run = train(config, Path(tmp) / f"{shape}-{dtype}", verbose=False)
                seconds = time.perf_counter() - start
                rows[dtype] = dict(
                    val_loss=run.val_loss,
                    last10_loss=float(np.mean(run.losses[-10:])),
                    s_per_step=_steady_step_time(run.records, min(5, steps - 1)),
                    run_s=seconds,
                    losses=run.losses,
                )
                print(f"  {shape} {dtype}: val {run.val_loss:.4f} ({seconds:.0f} s)", flush=True)
            results["shapes"][shape] = dict(steps=steps, model=model, train=train_cfg, runs=rows)
            curves[shape] = {d: r["losses"] for d, r in rows.items()}
    print(f"{'shape':<18}{'moments':<10}{'val loss':>10}{'- fp32':>10}{'last-10':>10}{'s/step':>9}")
    for shape, entry in results["shapes"].items():
        base = entry["runs"]["float32"]["val_loss"]
        for dtype, r in entry["runs"].items():
            r["val_minus_fp32"] = r["val_loss"] - base
            print(
                f"{shape:<18}{dtype:<10}{r['val_loss']:>10.4f}{r['val_minus_fp32']:>+10.4f}"
                f"{r['last10_loss']:>10.4f}{r['s_per_step']:>9.3f}"
            )
    png = Path(out_dir) / "state_dtype.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    _plot(curves, png)
    print(f"wrote {png}")
    results["png"] = str(png)
    return results
