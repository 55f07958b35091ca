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


# Runs its argv as a child and reports the child's peak RSS: a small process in between,
# because Linux counts into a child's ru_maxrss the RSS of the process it was forked
# from at its exec (a test worker's gigabytes would be the child's peak). Given a line
# (argv[1], "" for none), the child's high-water mark is reset at the first line of its
# output starting with it (/proc/PID/clear_refs, "5"): the peak from there on; given a
# second (argv[2], "" for none), reset again at every later line starting with that.
_MEASURE = """
import os, subprocess, sys
mark, every, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
reset = lambda: open(f"/proc/{proc.pid}/clear_refs", "w").write("5")
for line in proc.stdout:
    sys.stdout.write(line)
    if mark and line.startswith(mark):
        reset()
        sys.stdout.write(f"hetjax-peak-rss counted from: {line.strip()}\\n")
        mark = ""
    elif every and not mark and line.startswith(every):
        reset()
    sys.stdout.flush()
_, status, usage = os.wait4(proc.pid, 0)
proc.returncode = os.waitstatus_to_exitcode(status)
print(f"\\nhetjax-peak-rss {usage.ru_maxrss * 1024} {proc.returncode}", flush=True)
"""


def run_peak_rss(
    cmd: list[str], env: dict | None = None, *, reset_at: str = "", reset_every: str = ""
) -> tuple[int, str, int]:
    """Runs ``cmd`` to its end as a child process: its peak RSS in bytes (``wait4``'s
    ``ru_maxrss``, taken by a small process in between: see ``_MEASURE``), its output
    (stdout and stderr) and its exit status (negative: the signal that killed it).
    ``reset_at``: the peak from the first output line starting with it on (past the
    child's compiles, whose transient memory varies by a hundred MiB run to run); the
    whole run's where no line does. ``reset_every``: past that line, the peak is reset
    again at each line starting with this, so that the child's own readings of its peak
    (``census.rss``: metrics.jsonl's ``rss_peak_bytes`` with ``train.log_every=1``) are
    each step's; the peak returned is then the last step's."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, reset_at, reset_every, *cmd],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    output, _, line = done.stdout.rstrip().rpartition("\nhetjax-peak-rss ")
    rss, code = line.split()
    return int(rss), output, int(code)  # the child's own status (-N: killed by signal N)


def settle_disk(path: Path, quiet_s: float = 2.0, limit_s: float = 120.0) -> float:
    """Flushes dirty pages and waits until the block device under ``path`` has done no
    I/O (reads, writes, discards) for ``quiet_s`` seconds, at most ``limit_s``: the
    seconds waited. Removing a run's gigabytes of state on a filesystem mounted with
    ``discard`` (this machine's) trims them on the device for seconds after; a run
    started then measured 6.65-7.70 s/step at 310.8M params against 6.28-6.70 on a
    quiet disk (docs/results/2026-11-26.md). Where the device's counters cannot be read
    (no /sys), only flushes."""
    import os
    import time

    os.sync()
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    if not stat.exists():
        return 0.0
    # completed reads, writes, discards (fields 1, 5, 12 of the block layer's stat) and
    # those in flight (field 9)
    counters = lambda: tuple(stat.read_text().split()[i] for i in (0, 4, 8, 11))
    start = quiet_since = time.monotonic()
    last = counters()
    while time.monotonic() - start < limit_s:
        time.sleep(0.25)
        now = counters()
        if now != last or now[2] != "0":
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
    return time.monotonic() - start
