"""What the benchmarks share: scratch space, steady step times, the peer shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _scratch_dir() -> Path:
    """Where benchmarks put their files: ``runs/bench`` under the working directory (the
    local disk hetjax would use; ``runs/`` is ignored by git)."""
    path = Path("runs/bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _steady_step_time(records, skip: int) -> float:
    times = [r["step_time_s"] for r in records[skip:]]
    return float(np.median(times))


PEER_SHAPE = dict(num_layers=4, d_model=256, num_heads=4, vocab_size=8192, max_seq_len=128)


PEER_BATCH = dict(batch_size=4, seq_len=128)


# DeepSpeed ZeRO-3 with the optimizer offloaded to NVMe on this machine, same shape, fp32
# (../shared/MEASUREMENTS.md; torch and DeepSpeed are not dependencies of hetjax).
PEER_S_PER_STEP = 0.5


def run_peak_rss(cmd: list[str], env: dict | None = None) -> tuple[int, str, int]:
    """Runs ``cmd`` to its end as a child process: its peak RSS in bytes (``wait4``'s
    ``ru_maxrss``: this child alone, not the largest child so far), its output (stdout
    and stderr) and its exit status."""
    import os
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, output, proc.returncode  # ru_maxrss: KiB on Linux
