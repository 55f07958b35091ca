"""``python -m hetjax.bench gpu``: (GPU only) MFU offloaded vs in HBM, and the TFLOP/s of a
model larger than HBM."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np

from hetjax.bench.common import _scratch_dir, _steady_step_time
from hetjax.config import Config


def bench_gpu(quick: bool) -> dict:
    """On a GPU: MFU of an offloaded run (params on the host, optimizer state in host
    RAM) vs an in-HBM run (``none``) of the same per-layer shape, and the TFLOP/s of a
    model deeper than HBM holds (16 B/param of state over the device's memory).
    Elsewhere: skipped, saying so."""
    from hetjax.train import train

    device = jax.devices()[0]
    if device.platform != "gpu":
        msg = f"bench gpu: skipped, no GPU (the default device is {device.platform})"
        print(msg)
        return {"skipped": msg}
    stats = device.memory_stats() or {}
    hbm = int(stats.get("bytes_limit", 0))
    d, heads = (1024, 8) if quick else (4096, 32)
    seq, batch = (256, 4) if quick else (2048, 8)
    layers_in_hbm = 2 if quick else 8
    per_layer = 12 * d * d
    layers_big = max(layers_in_hbm, int(1.1 * hbm / (16 * per_layer)) + 1) if hbm else 2
    if quick:
        layers_big = layers_in_hbm * 2
    steps, skip = (3, 1) if quick else (8, 3)
    base = Config().replace(
        model=dict(d_model=d, num_heads=heads, max_seq_len=seq, compute_dtype="bfloat16"),
        train=dict(steps=steps, batch_size=batch, seq_len=seq, eval_batches=0, log_every=1000),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=2_000_000),
    )
    rows = {
        "none": (layers_in_hbm, dict(mode="none")),
        "stream": (layers_in_hbm, dict(mode="stream", optimizer="host")),
        # 16 B/param of state over HBM: optimizer state on NVMe, params in host RAM
        "stream_big": (layers_big, dict(mode="stream", optimizer="nvme")),
    }
    results: dict = {"device": device.device_kind, "hbm_bytes": hbm}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:
        for name, (layers, offload) in rows.items():
            config = base.replace(model=dict(num_layers=layers), offload=offload)
            try:
                run = train(config, Path(tmp) / name, verbose=False)
            except Exception as e:  # noqa: BLE001 — e.g. the NVMe path lacks the room
                results[name] = {"layers": layers, "failed": repr(e)[:300]}
                print(f"{name}: {layers} layers failed: {e!r}"[:300])
                continue
            timed = run.records[skip:]
            results[name] = {
                "layers": layers,
                "s_per_step": _steady_step_time(run.records, skip),
                "tflops": float(np.median([r["tflops"] for r in timed])),
                "mfu": float(np.median([r["mfu"] for r in timed])),
            }
    print(f"{'run':<12}{'layers':>8}{'s/step':>10}{'TFLOP/s':>10}{'MFU':>8}")
    for name, r in results.items():
        if isinstance(r, dict) and "failed" not in r:
            print(
                f"{name:<12}{r['layers']:>8}{r['s_per_step']:>10.3f}{r['tflops']:>10.1f}"
                f"{r['mfu']:>8.3f}"
            )
    if "mfu" in results["stream"] and "mfu" in results["none"]:
        results["mfu_ratio"] = results["stream"]["mfu"] / results["none"]["mfu"]
        print(f"offloaded / in-HBM MFU: {results['mfu_ratio']:.3f}")
    return results
