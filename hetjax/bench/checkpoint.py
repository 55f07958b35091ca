"""``python -m hetjax.bench checkpoint``: checkpoints of the NVMe tier at the peer
shape (configs/gpt310m_peer.py, 310.8M params; params and optimizer state on NVMe),
each row a training run in a child process with a checkpoint every 2 steps: none, the
NVMe state hard-linked (the default), and copied (``checkpoint.link_nvme=false``, what
a checkpoint directory on another filesystem gets). For each: the time the step waits,
the background time, bytes hard-linked and written per checkpoint, s/step and the
process's peak RSS; the copy's background time against the disk's raw write bandwidth
measured in the same run (O_DIRECT, ``bench io``)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hetjax.bench.common import PEER_SHAPE
from hetjax.bench.peer import peer_run, run_rows
from hetjax.config_values import parse_bytes

NVME = ["--config.offload.mode=stream", "--config.offload.optimizer=nvme"]
NVME += ["--config.offload.params=nvme", "--config.checkpoint.at_end=false"]
ROWS = {
    "no checkpoints": ["--config.checkpoint.every_steps=0"],
    "hard-linked": ["--config.checkpoint.every_steps=2"],
    "copied": ["--config.checkpoint.every_steps=2", "--config.checkpoint.link_nvme=false"],
}
SIZE = r"([\d.]+ [KMGT]?i?B)"
DONE = re.compile(
    rf"checkpoint: step (\d+) complete: {SIZE} hard-linked, {SIZE} written.*?, "
    r"([\d.]+) s in the step, ([\d.]+) s in the background"
)


def _row(name: str, quick: bool, tmp: Path, steps: int) -> dict:
    rss, output, records = peer_run(f"checkpoint, {name}", quick, tmp, steps, *NVME, *ROWS[name])
    saves = [
        dict(
            step=int(m[1]),
            linked=parse_bytes(m[2]),
            written=parse_bytes(m[3]),
            in_step_s=float(m[4]),
            background_s=float(m[5]),
        )
        for m in DONE.finditer(output)
    ]
    return {
        "step_s": float(np.median([r["step_time_s"] for r in records[1:]])),
        "peak_rss": rss,
        "saves": saves,
    }


def bench_checkpoint(quick: bool) -> dict:
    steps = 4
    row = lambda name, directory: _row(name, quick, directory, steps)
    rows, disk_write, _ = run_rows(ROWS, quick, row)
    shape = "quick: " + str(PEER_SHAPE) if quick else "310.8M params"
    print(
        f"checkpoints of the NVMe tier, peer shape ({shape}), every 2 steps of {steps}; raw "
        f"disk write {disk_write:.2f} GB/s"
    )
    print(
        f"  {'run':<16}{'s/step':>8}{'peak RSS':>10}{'in step':>9}{'background':>12}"
        f"{'GB linked':>11}{'GB written':>12}{'vs disk':>9}"
    )
    for name, row in rows.items():
        rss = f"{row['peak_rss'] / 2**30:.2f}G"
        line = f"  {name:<16}{row['step_s']:>8.2f}{rss:>10}"
        if row["saves"]:
            last = row["saves"][-1]  # the second: the writer's steady state
            floor = last["written"] / 1e9 / disk_write  # the write at the raw bandwidth
            ratio = f"{last['background_s'] / floor:.2f}x" if last["written"] else "-"
            line += (
                f"{last['in_step_s']:>8.2f}s{last['background_s']:>11.2f}s"
                f"{last['linked'] / 1e9:>11.2f}{last['written'] / 1e9:>12.2f}{ratio:>9}"
            )
        print(line)
    print("  vs disk: background time / (bytes written at the raw write bandwidth)")
    return {"disk_write_GBps": disk_write, "rows": rows}
