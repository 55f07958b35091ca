"""``python -m hetjax.bench lockfree``: optimizer.mode=lockfree vs sync on a tiny model:
final losses, step time."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from hetjax.bench.common import _steady_step_time
from hetjax.config import Config


def bench_lockfree(quick: bool) -> dict:
    """Lock-free vs sync on the tiny model of ``tests/test_offload.py``: the mean of the
    last 10 losses and the median step time, optimizer state on NVMe."""
    from hetjax.train import train

    steps = 20 if quick else 40
    base = Config().replace(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32),
        train=dict(steps=steps, batch_size=4, seq_len=16, eval_batches=0, log_every=1000),
        optimizer=dict(warmup_steps=4, lr=3e-3),
        offload=dict(mode="stream", optimizer="nvme"),
        memory=dict(page_size="16KiB"),
        data=dict(corpus_bytes=200_000),
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "lockfree"):
            config = base.replace(optimizer=dict(mode=mode, max_staleness=1))
            run = train(config, Path(tmp) / mode, verbose=False)
            results[f"{mode}_last10_loss"] = float(np.mean(run.losses[-10:]))
            results[f"{mode}_step_s"] = _steady_step_time(run.records, 5)
    print(f"{'mode':<10}{'last-10 loss':>14}{'s/step':>10}")
    for mode in ("sync", "lockfree"):
        print(
            f"{mode:<10}{results[mode + '_last10_loss']:>14.4f}{results[mode + '_step_s']:>10.4f}"
        )
    gap = results["lockfree_last10_loss"] - results["sync_last10_loss"]
    speed = results["sync_step_s"] / results["lockfree_step_s"]
    print(f"lockfree - sync loss: {gap:+.4f} nats; lockfree steps {speed:.2f}x as fast")
    return {"steps": steps, **results, "loss_gap": gap, "speedup": speed}
