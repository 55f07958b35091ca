"""``python -m hetjax.bench peer``: the DeepSpeed comparison's shape (configs/
gpt310m_peer.py, 310.8M params) in one run, each row a training run in a child process:
in memory, optimizer state on NVMe, params and optimizer state on NVMe, and the same
with a 3 GiB host budget. For each: s/step (median after the first steps), peak RSS of
the process, disk bytes per step (also against one copy of the NVMe state: the
least a step can move), and the limit max(compute, disk time) where compute
is the in-memory row's step and disk time is the step's reads and writes at the raw
disk bandwidth measured in the same run (O_DIRECT, ``bench io``). DeepSpeed's rows are
the issue's measurements on this machine (MEASUREMENTS.md), not run here."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from hetjax.bench.common import PEER_SHAPE, _scratch_dir, run_peak_rss, settle_disk
from hetjax.bench.io import _raw_disk_bandwidth

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt310m_peer.py"
STREAM = ["--config.offload.mode=stream", "--config.offload.optimizer=nvme"]
ROWS = {
    "in memory": ["--config.offload.mode=none"],
    "optimizer on NVMe": [*STREAM, "--config.offload.params=host"],
    "params + optimizer on NVMe": [*STREAM, "--config.offload.params=nvme"],
    "the same, host budget": [*STREAM, "--config.offload.params=nvme"],
}
# full, quick: each below what caching every stage's state would take, so the budgeted
# row still streams state from the disk (the quick shape's minimum host working set is
# 223 MiB and a copy of its state 72 MiB: 512 MiB cached it all, and read nothing)
BUDGET = {False: "3GiB", True: "256MiB"}
# DeepSpeed ZeRO-3 0.19 on this machine at this shape (the table): s/step, GiB
DEEPSPEED = {
    "in memory": (7.5, 6.4),
    "optimizer on NVMe": (11.9, 12.2),
    "params + optimizer on NVMe": (12.1, 14.0),
}


def peer_run(
    what: str, quick: bool, tmp: Path, steps: int, *args: str, shape: dict | None = None
) -> tuple:
    """Trains the peer shape (the quick one with ``quick``; ``shape``: these model keys
    instead) for ``steps`` in a child process in ``tmp``, with ``args``: its peak RSS,
    output and metrics records."""
    args = (*args, f"--config.train.steps={steps}", "--config.train.log_every=1")
    args += (f"--config.memory.nvme_path={tmp / 'nvme'}",)
    shape = shape or (PEER_SHAPE if quick else {})
    args += tuple(f"--config.model.{k}={v}" for k, v in shape.items())
    cmd = [sys.executable, "-m", "hetjax.launch", "--config", str(CONFIG)]
    rss, output, code = run_peak_rss([*cmd, "--workdir", str(tmp / "run"), *args])
    if code != 0:
        raise RuntimeError(f"bench {what}: the run failed ({code}):\n{output[-3000:]}")
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").open()]
    return rss, output, records


def _row(
    name: str, quick: bool, tmp: Path, steps: int, skip: int, shape: dict | None = None
) -> dict:
    args = list(ROWS[name])
    if name == "the same, host budget":
        args.append(f"--config.memory.host_budget={BUDGET[quick]}")
    rss, _, records = peer_run(f"peer, {name}", quick, tmp, steps, *args, shape=shape)
    steady = records[skip:]
    return {
        "step_s": float(np.median([r["step_time_s"] for r in steady])),
        "peak_rss": rss,
        "read_bytes": float(np.median([r.get("nvme_read_bytes", 0) for r in steady])),
        "write_bytes": float(np.median([r.get("nvme_write_bytes", 0) for r in steady])),
        # one copy of what lives on NVMe: the least a step reads and writes there
        # (every byte of it once each way; a host state cache reads and writes less)
        "nvme_copy_bytes": records[-1].get("nvme_bytes", 0) / 2,
    }


def run_rows(names, quick: bool, row) -> tuple[dict, float, float]:
    """``row(name, directory)`` for each name, each in a scratch directory of its own
    and, unless ``quick``, on a quiet disk (the last row's files removed and trimmed:
    ``settle_disk``), and the raw disk's write and read bandwidth (GB/s) measured there
    first."""
    rows = {}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:
        tmp = Path(tmp)
        disk_write, disk_read = _raw_disk_bandwidth(tmp, (64 if quick else 1024) << 20)
        for name in names:
            if not quick:  # (the quick shape's files are small)
                settle_disk(tmp)
            with tempfile.TemporaryDirectory(dir=tmp) as row_dir:
                rows[name] = row(name, Path(row_dir))
    return rows, disk_write, disk_read


def against_previous(rows: dict, previous: dict | None, key: str = "vs_limit") -> None:
    """Prints each row's ``key`` (a ratio measured in its own run) beside the previous
    results file's (``previous``: that run's JSON, None when there is none) and their
    quotient: a regression shows as a ratio of ratios, whatever the machine's speed."""
    if not previous or "rows" not in previous:
        print("  (no previous results file: nothing to compare against)")
        return
    print(f"  against the previous results ({previous.get('date', '?')}): {key} now / then")
    for name, row in rows.items():
        then = previous["rows"].get(name, {}).get(key)
        if then:
            print(f"    {name:<28}{row[key]:>7.2f} / {then:.2f} = {row[key] / then:.2f}")


def bench_peer(quick: bool, previous: dict | None = None) -> dict:
    steps, skip = (3, 1) if quick else (6, 2)
    row = lambda name, directory: _row(name, quick, directory, steps, skip)
    rows, disk_write, disk_read = run_rows(ROWS, quick, row)
    compute = rows["in memory"]["step_s"]
    print(
        f"peer shape ({'quick: ' + str(PEER_SHAPE) if quick else '310.8M params'}), "
        f"raw disk {disk_read:.2f} GB/s read, {disk_write:.2f} GB/s write; compute (the "
        f"in-memory step) {compute:.2f} s"
    )
    print(
        f"  {'run':<28}{'s/step':>8}{'peak RSS':>10}{'GB read':>9}{'GB written':>11}"
        f"{'limit s':>9}{'/ limit':>9}   DeepSpeed s/step, RSS"
    )
    for name, row in rows.items():
        disk_s = row["read_bytes"] / (disk_read * 1e9) + row["write_bytes"] / (disk_write * 1e9)
        row["limit_s"] = max(compute, disk_s)
        row["vs_limit"] = row["step_s"] / row["limit_s"]
        peer = DEEPSPEED.get(name)
        peer_text = f"{peer[0]:.1f}, {peer[1]:.1f} GiB" if peer and not quick else "-"
        print(
            f"  {name:<28}{row['step_s']:>8.2f}{row['peak_rss'] / 2**30:>8.2f}Gi"
            f"{row['read_bytes'] / 1e9:>9.2f}{row['write_bytes'] / 1e9:>11.2f}"
            f"{row['limit_s']:>9.2f}{row['vs_limit']:>9.2f}   {peer_text}"
        )
    for name, row in list(rows.items())[1:]:
        gen = row["nvme_copy_bytes"]
        row["read_vs_copy"] = row["read_bytes"] / gen
        row["write_vs_copy"] = row["write_bytes"] / gen
        print(
            f"  {name}: one copy on NVMe {gen / 1e9:.2f} GB; a step reads "
            f"{row['read_vs_copy']:.2f}x and writes {row['write_vs_copy']:.2f}x it"
        )
    against_previous(rows, previous)
    budgeted, unbudgeted = rows["the same, host budget"], rows["params + optimizer on NVMe"]
    slower = budgeted["step_s"] / unbudgeted["step_s"]
    print(
        f"host budget {BUDGET[quick]}: peak RSS {budgeted['peak_rss'] / 2**30:.2f} GiB, "
        f"step {slower:.2f}x the unbudgeted one; offloaded peak RSS / in-memory "
        f"{unbudgeted['peak_rss'] / rows['in memory']['peak_rss']:.2f}"
    )
    return {
        "disk_read_gbs": disk_read,
        "disk_write_gbs": disk_write,
        "compute_s": compute,
        "budget": BUDGET[quick],
        "budgeted_vs_unbudgeted": slower,
        "rows": rows,
    }
