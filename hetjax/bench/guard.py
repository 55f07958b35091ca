"""``python -m hetjax.bench guard``: the speed lead's guard (issue #58). A mid shape, big
enough that its params and optimizer state on NVMe make the step disk- and host-bound,
small enough that both rows take about a minute on 2 cores, trained in memory and with
params and optimizer state on NVMe, each in a child process of the same run: the
offloaded step over the in-memory step, against :data:`GUARD_BOUND`. CI runs it as an
``alone`` test (``tests/test_speed_guard.py``), after every other test, with the machine to
itself."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hetjax.bench.common import _scratch_dir, settle_disk
from hetjax.bench.peer import _row, against_previous

# 6 x 512, vocab 8192: 23.1M params, 370 MB of fp32 params, master, m and v on NVMe, read
# and written each step (about 0.5 s of this machine's disk each way), against an
# in-memory step of about the same time: both the disk and the host optimizer show.
GUARD_SHAPE = dict(num_layers=6, d_model=512, num_heads=8, vocab_size=8192, max_seq_len=128)
GUARD_ROWS = ("in memory", "params + optimizer on NVMe")
GUARD_STEPS, GUARD_SKIP = 8, 3  # the median of steps 4-8: past compiles and first reads
# Offloaded / in-memory s/step may not exceed this: five quiet runs on 2026-11-29 gave
# 1.11, 1.45, 1.21, 1.19, 1.35 (median 1.21; the in-memory step is the noisy one, 0.66-0.84
# s against 0.92-1.00 offloaded), and the margin is a third of the median, 10% above the
# worst run (docs/results/2026-11-29.md, "The speed guard"): it catches a 30% regression.
GUARD_BOUND = 1.6


def bench_guard(quick: bool, previous: dict | None = None) -> dict:
    """The two rows (s/step, peak RSS, NVMe bytes a step) and their ratio against
    :data:`GUARD_BOUND`. ``quick``: the same rows, 4 steps (a smoke test's)."""
    steps, skip = (4, 2) if quick else (GUARD_STEPS, GUARD_SKIP)
    rows = {}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:
        for name in GUARD_ROWS:
            settle_disk(Path(tmp), limit_s=30.0)
            with tempfile.TemporaryDirectory(dir=tmp) as row_dir:
                rows[name] = _row(name, quick, Path(row_dir), steps, skip, shape=GUARD_SHAPE)
    memory, offloaded = (rows[name]["step_s"] for name in GUARD_ROWS)
    ratio = offloaded / memory
    for row in rows.values():
        row["vs_limit"] = row["step_s"] / memory  # the in-memory step: the guard's limit
    print(f"speed guard, {GUARD_SHAPE}, batch 4 x 128, fp32")
    for name, row in rows.items():
        print(
            f"  {name:<28}{row['step_s']:>7.2f} s/step{row['peak_rss'] / 2**30:>7.2f} GiB"
            f"{row['read_bytes'] / 1e9:>7.2f} GB read{row['write_bytes'] / 1e9:>7.2f} GB written"
        )
    verdict = "within" if ratio <= GUARD_BOUND else "OVER"
    print(f"offloaded / in memory: {ratio:.3f} ({verdict} the bound {GUARD_BOUND})")
    against_previous(rows, previous)
    return {"rows": rows, "ratio": ratio, "bound": GUARD_BOUND, "shape": GUARD_SHAPE}
