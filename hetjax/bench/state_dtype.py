"""``python -m hetjax.bench state_dtype``: convergence with the moments in float32,
bfloat16 and int8 (``optimizer.state_dtype``), side by side in one run.

Two shapes, each trained in memory (``offload.mode=none``: the moments in the chosen
dtype on the device, ``optimizer/moments.py``) from the same initialisation on the same
batches, the three state dtypes in lockstep (a step of each in turn, so however far a
run gets, the three curves cover the same steps): ``gpt_tiny``'s model (4 x 256, byte
vocabulary) for 400 steps and GPT-2 small's depth and width (12 x 768, 12 heads; the
byte vocabulary and a short context, so a CPU runs it) for 200. Every ``EVAL_EVERY``
steps and at the end: the validation loss of each (the same 8 batches), and the JSON
and the PNG of the training loss curves are written, so a run cut short leaves its
results so far. Prints each final validation loss and its difference from fp32.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

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
EVAL_EVERY = 50  # steps between validation losses (and partial results on disk)
EVAL_BATCHES = 8


def _smooth(losses: list[float], window: int = 10) -> np.ndarray:
    """The running mean over the last ``window`` steps (fewer at the start)."""
    x = np.asarray(losses, np.float64)
    total = np.concatenate([[0.0], np.cumsum(x)])
    end = np.arange(1, len(x) + 1)
    start = np.maximum(end - window, 0)
    return (total[end] - total[start]) / (end - start)


def plot(shapes: dict, out: Path) -> None:
    """The training loss curves of every shape (a column each) and state dtype, and
    below them each dtype's difference from float32 (both means of 10 steps)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # plotting only: start-up
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(shapes), 7.5))
    FigureCanvasAgg(fig)
    for i, (shape, entry) in enumerate(shapes.items()):
        top = fig.add_subplot(2, len(shapes), i + 1)
        diff = fig.add_subplot(2, len(shapes), len(shapes) + i + 1, sharex=top)
        base = _smooth(entry["runs"]["float32"]["losses"])
        for dtype, run in entry["runs"].items():
            curve = _smooth(run["losses"])
            steps = np.arange(1, len(curve) + 1)
            top.plot(steps, curve, label=dtype, linewidth=1.2)
            diff.plot(steps, curve - base[: len(curve)], label=dtype, linewidth=1.2)
        done = len(base)
        of = f" of {entry['steps']}" if done < entry["steps"] else ""
        top.set_title(f"{shape}: training loss ({done}{of} steps)")
        top.set_ylabel("loss, mean of 10 steps (nats/token)")
        top.legend(title="moments")
        diff.set_title(f"{shape}: minus the float32 run's")
        diff.set_xlabel("step")
        diff.set_ylabel("loss difference (nats/token)")
        diff.axhline(0, color="0.5", linewidth=0.8)
        for ax in (top, diff):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def run_shape(name: str, model: dict, train: dict, steps: int, save) -> dict:
    """The three state dtypes of one shape in lockstep; ``save(entry)`` is called with
    the results so far every EVAL_EVERY steps and at the end."""
    from hetjax.data import make_datasets  # the runtime's start-up: only when run
    from hetjax.runtime.in_memory import InMemoryRuntime
    from hetjax.train import evaluate

    configs = {
        dtype: Config().replace(
            model=model,
            train={**train, "steps": steps, "eval_batches": EVAL_BATCHES},
            optimizer=dict(state_dtype=dtype, warmup_steps=min(20, steps)),
            offload=dict(mode="none"),
        )
        for dtype in STATE_DTYPES
    }
    runtimes = {d: InMemoryRuntime(c) for d, c in configs.items()}
    first = configs["float32"]
    train_data, val_data, _ = make_datasets(first)
    A = first.train.grad_accum
    runs = {d: dict(losses=[], val_losses={}, seconds=0.0) for d in STATE_DTYPES}
    entry = dict(steps=steps, model=model, train=train, runs=runs)
    for step in range(steps):
        batch = train_data.batch(step)
        batch = batch.reshape(A, -1, batch.shape[-1])
        for dtype, runtime in runtimes.items():
            t0 = time.perf_counter()
            runs[dtype]["losses"].append(runtime.train_step(batch).loss)
            runs[dtype]["seconds"] += time.perf_counter() - t0
        done = step + 1
        if done % EVAL_EVERY == 0 or done == steps:
            for dtype, runtime in runtimes.items():
                val = evaluate(runtime, val_data, EVAL_BATCHES)
                runs[dtype]["val_losses"][done] = val
                runs[dtype]["val_loss"] = val
            base = runs["float32"]["val_loss"]
            line = ", ".join(f"{d} {r['val_loss']:.4f}" for d, r in runs.items())
            print(f"  {name} step {done}: validation {line}", flush=True)
            for r in runs.values():
                r["val_minus_fp32"] = r["val_loss"] - base
                r["last10_loss"] = float(np.mean(r["losses"][-10:]))
                r["s_per_step"] = r["seconds"] / done  # the first step compiles
            save(entry)
    return entry


def bench_state_dtype(quick: bool, out_dir: str = "runs/bench", shapes=None) -> dict:
    """Each shape (``shapes``: their names, default all; --quick: gpt_tiny for 6 steps)
    with each state dtype: validation losses, their difference from fp32, s/step; the
    curves in ``<out_dir>/state_dtype.png`` and the results so far in
    ``<out_dir>/state_dtype.partial.json`` as the runs go."""
    names = shapes or ([SHAPES[0][0]] if quick else [s[0] for s in SHAPES])
    chosen = [s for s in SHAPES if s[0] in names]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "state_dtype.png"
    results: dict = {"shapes": {}, "png": str(png)}

    def save(entry):
        plot(results["shapes"], png)
        (out / "state_dtype.partial.json").write_text(json.dumps(results, indent=1) + "\n")

    for name, model, train in chosen:
        steps = QUICK_STEPS if quick else train["steps"]

        def keep(entry, name=name):
            results["shapes"][name] = entry
            save(entry)

        results["shapes"][name] = run_shape(name, model, train, steps, keep)
    print(f"{'shape':<18}{'moments':<10}{'val loss':>10}{'- fp32':>10}{'last-10':>10}{'s/step':>9}")
    for name, entry in results["shapes"].items():
        for dtype, r in entry["runs"].items():
            print(
                f"{name:<18}{dtype:<10}{r['val_loss']:>10.4f}{r['val_minus_fp32']:>+10.4f}"
                f"{r['last10_loss']:>10.4f}{r['s_per_step']:>9.3f}"
            )
    print(f"wrote {png}")
    return results
