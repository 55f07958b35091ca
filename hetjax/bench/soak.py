"""``python -m hetjax.bench soak``: a long run that must not leak. A small GPT trains
1,000 steps (``--quick``: 300) with params and optimizer state on NVMe under a host
budget and a checkpoint every 50 steps, in a child process (``python -m
hetjax.launch``); every 25 steps this process samples the child's RSS, open file
descriptors (the least of 5 looks 5 ms apart: a page read or write in flight holds one
for its duration, a leak raises the floor) and threads (``/proc/<pid>``), the NVMe
directory's page files and bytes and the checkpoint directory's files and bytes (hard
links counted once). DeepSpeed's NVMe
offload users report memory growth, descriptor and swapper leaks and stalls over long
runs; this bench is the check that would see them here.

Verdicts, after a warm-up of 100 steps, from the samples half-way between checkpoints
(none in flight): RSS and descriptors flat within 5% (max over min of the samples; the
threads are shown: TensorStore's pools start and retire threads as work comes), the
NVMe page-file count constant, and no upward trend
in step time: the floor of each 25 steps' times (their 20th percentile), the lowest floor
of the last 250 steps against the lowest of the first 250 after warm-up, scaled to the
run's length, rises less than 10% of the median floor. Prints the series, writes
``runs/bench/soak.png`` (``--out``'s directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hetjax.bench.common import _scratch_dir

EVERY = 25  # steps between samples
CHECKPOINT_EVERY = 50
WARMUP = 100  # steps before the flatness checks start
FLAT = 0.05  # RSS, descriptors, threads: max / min - 1 after warm-up
TREND = 0.10  # step time: the floors' rise over the run / their median (_rise)
WINDOW = 250  # steps at each end of the run whose lowest floor _rise compares

MODEL = dict(num_layers=2, d_model=64, num_heads=4, max_seq_len=64)
OVERRIDES = {
    **{f"model.{k}": v for k, v in MODEL.items()},
    "train.batch_size": 8,
    "train.seq_len": 64,
    "train.log_every": 100,
    "train.eval_batches": 0,
    "train.trace_every": 0,
    "train.in_memory_steps": 0,
    "offload.mode": "stream",
    "offload.params": "nvme",
    "offload.optimizer": "nvme",
    "memory.host_budget": "6MiB",  # no stage cached in RAM: every step reads all state
    "memory.device_budget": 0,
    "checkpoint.every_steps": CHECKPOINT_EVERY,
    "checkpoint.keep": 2,
    "checkpoint.at_end": "true",
}


def _proc_sample(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = []
    for _ in range(5):  # the floor: each NVMe read or write in flight holds one briefly
        fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(0.005)
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "threads": int(fields["Threads"]),
        "fds": min(fds),
    }


def _tree(path: Path, pages_only: bool = False) -> tuple[int, int]:
    """Files and bytes under ``path``, each inode once (hard links share blocks);
    ``pages_only``: leaving out the temporary names of writes in flight."""
    seen, files, nbytes = set(), 0, 0
    for root, _, names in os.walk(path):
        for name in names:
            if pages_only and name.endswith((".tmp", ".link")):
                continue
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # renamed or removed meanwhile
                continue
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            files += 1
            nbytes += st.st_size
    return files, nbytes


def run_soak(
    workdir: Path, steps: int, every: int = EVERY, log: Path | None = None
) -> tuple[list[dict], list[dict]]:
    """Trains ``steps`` steps in a child process in ``workdir`` and samples it every
    ``every`` steps (as soon as ``metrics.jsonl`` shows the step). Returns (samples,
    the run's per-step records)."""
    workdir.mkdir(parents=True, exist_ok=True)
    # a fresh run each time: an earlier soak's checkpoints and metrics in this (scratch)
    # workdir go (the sampler reads metrics.jsonl as the child appends to it)
    args = [sys.executable, "-m", "hetjax.launch", "--workdir", str(workdir), "--resume=never"]
    args += ["--overwrite"]
    args += [f"--config.{k}={v}" for k, v in {**OVERRIDES, "train.steps": steps}.items()]
    args += [f"--config.memory.nvme_path={workdir / 'nvme'}"]
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log = log or workdir / "soak.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        samples, records = _sample(proc, metrics, workdir, every)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"the soak run failed (exit {proc.returncode}):\n{tail}")
    return samples, records


def _sample(proc, metrics: Path, workdir: Path, every: int) -> tuple[list[dict], list[dict]]:
    samples, records, due, offset, buffer = [], [], every, 0, ""
    try:
        while True:
            running = proc.poll() is None
            if metrics.exists():
                with open(metrics) as f:
                    f.seek(offset)
                    buffer += f.read()
                    offset = f.tell()
                *lines, buffer = buffer.split("\n")
                records += [json.loads(line) for line in lines if line]
            step = records[-1]["step"] if records else 0
            if running and step >= due:
                sample = {"step": step, **_proc_sample(proc.pid)}
                sample["nvme_files"], sample["nvme_bytes"] = _tree(workdir / "nvme", True)
                sample["ckpt_files"], sample["ckpt_bytes"] = _tree(workdir / "checkpoints")
                samples.append(sample)
                due = (step // every + 1) * every
            if not running:
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return samples, records


def verdicts(samples: list[dict], records: list[dict], warmup: int = WARMUP) -> dict:
    """The checks of the module docstring, from the samples from ``warmup`` steps on
    taken between checkpoints (none in flight: a background write holds descriptors and
    buffers while it runs) and every step's time after ``warmup``."""
    half = CHECKPOINT_EVERY // 2
    after = [s for s in samples if s["step"] >= warmup and s["step"] % CHECKPOINT_EVERY >= half]
    out: dict = {}
    for key in ("rss_bytes", "fds", "threads"):  # (threads: shown, not judged)
        values = [s[key] for s in after]
        out[f"{key}_growth"] = max(values) / min(values) - 1
        out[f"{key}_flat"] = out[f"{key}_growth"] <= FLAT
    files = {s["nvme_files"] for s in after}
    out["nvme_files_constant"] = len(files) == 1
    # The floor of each span of ``EVERY`` steps (its 20th percentile): the machine's
    # other work (a shared machine's) only adds time to some steps, and a checkpoint's
    # step is one of many; a leak that slows every step raises the floor.
    times = {r["step"]: r["step_time_s"] for r in records if r["step"] > warmup}
    spans = sorted({(s - 1) // EVERY for s in times})
    floors = [
        np.percentile([t for s, t in times.items() if (s - 1) // EVERY == k], 20) for k in spans
    ]
    out["step_time_median_s"] = float(np.median(list(times.values())))
    out["step_time_floor_s"] = float(np.median(floors))
    out["step_time_rise"] = _rise(floors, EVERY, max(times) - min(times))
    out["step_time_no_upward_trend"] = out["step_time_rise"] < TREND
    out["threads_flat"] = None  # not judged
    return out


def _rise(floors: list[float], every: int, run_steps: int) -> float:
    """The floors' rise over the run (a fraction of their median): the lowest floor of
    the last ``WINDOW`` steps less the lowest of the first ``WINDOW`` after warm-up,
    scaled from the windows' distance to the run's length. A leak slows every step, so
    it raises every floor of the last window; this machine's speed also drifts by up to
    40% for stretches of 5-10 s (docs/results/2026-11-29.md), which a least-squares line
    through the floors of a few hundred steps read as a trend in a third of the runs,
    and which leaves at least one floor of a window of 250 steps at the machine's speed."""
    if len(floors) < 2:
        return 0.0
    w = max(1, min(WINDOW // every, len(floors) // 2))
    first, last = min(floors[:w]), min(floors[-w:])
    distance = (len(floors) - w) * every  # from the first window's centre to the last's
    return float((last - first) / np.median(floors) * run_steps / distance)


def plot(samples: list[dict], records: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=80)
    FigureCanvasAgg(fig)
    steps = [s["step"] for s in samples]
    panels = [
        ("RSS (MiB)", [s["rss_bytes"] / 2**20 for s in samples]),
        ("open descriptors", [s["fds"] for s in samples]),
        ("threads", [s["threads"] for s in samples]),
        ("NVMe page files", [s["nvme_files"] for s in samples]),
        ("checkpoint dir (MiB)", [s["ckpt_bytes"] / 2**20 for s in samples]),
    ]
    for i, (label, values) in enumerate(panels):
        ax = fig.add_subplot(3, 2, i + 1)
        ax.plot(steps, values, "o-", markersize=3)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax = fig.add_subplot(3, 2, 6)
    ax.plot([r["step"] for r in records], [r["step_time_s"] * 1e3 for r in records], lw=0.5)
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    for ax in fig.axes[-2:]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    return path


def bench_soak(quick: bool) -> dict:
    steps = 300 if quick else 1000
    workdir = _scratch_dir() / "soak"
    t0 = time.perf_counter()
    samples, records = run_soak(workdir, steps)
    wall = time.perf_counter() - t0
    result = verdicts(samples, records)
    print(
        f"soak: {steps} steps of a {MODEL['num_layers']}x{MODEL['d_model']} GPT, params and "
        f"optimizer state on NVMe, host budget {OVERRIDES['memory.host_budget']}, a "
        f"checkpoint every {CHECKPOINT_EVERY} steps (keep 2); {wall:.0f} s"
    )
    print(
        f"  {'step':>6}{'RSS MiB':>9}{'fds':>6}{'threads':>9}{'NVMe files':>12}"
        f"{'NVMe MiB':>10}{'ckpt files':>12}{'ckpt MiB':>10}{'step ms':>9}"
    )
    by_step = {r["step"]: r for r in records}
    for s in samples:
        ms = by_step[s["step"]]["step_time_s"] * 1e3 if s["step"] in by_step else float("nan")
        print(
            f"  {s['step']:>6}{s['rss_bytes'] / 2**20:>9.1f}{s['fds']:>6}{s['threads']:>9}"
            f"{s['nvme_files']:>12}{s['nvme_bytes'] / 2**20:>10.2f}{s['ckpt_files']:>12}"
            f"{s['ckpt_bytes'] / 2**20:>10.2f}{ms:>9.1f}"
        )
    print(
        f"  after step {WARMUP}: RSS +{result['rss_bytes_growth']:.1%}, descriptors "
        f"+{result['fds_growth']:.1%} (flat: <= {FLAT:.0%}), threads "
        f"+{result['threads_growth']:.1%}; NVMe page files constant: "
        f"{result['nvme_files_constant']}"
    )
    print(
        f"  step time median {result['step_time_median_s'] * 1e3:.1f} ms, floor "
        f"{result['step_time_floor_s'] * 1e3:.1f} ms, the floor's rise over the run "
        f"{result['step_time_rise']:+.1%} (no upward trend: < {TREND:.0%})"
    )
    png = plot(samples, records, workdir.parent / "soak.png")
    print(f"  series: {png}")
    return {"steps": steps, "wall_s": wall, "samples": samples, **result, "png": str(png)}
