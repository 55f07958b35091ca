"""``python -m hetjax.bench gpu``: gpucheck's ``mfu`` section (``hetjax/gpucheck/training.py``):
offloaded vs in-HBM MFU at a shape that fits the pool, and a model beyond the pool. The
benchmark once sized its big row for NVMe files larger than an H100 machine's disk;
gpucheck sizes it for the machine it runs on."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def bench_gpu(quick: bool) -> dict:
    """On a GPU: gpucheck's mfu section, its rows returned. Elsewhere: skipped, saying so.
    The platform is asked of a child (``gpucheck.probe_platform``): this process never
    starts JAX's backend, so each row's child gets the device's whole pool."""
    from hetjax import gpucheck

    platform, why = gpucheck.probe_platform()
    if platform not in ("cuda", "rocm"):
        msg = f"bench gpu: skipped, no GPU ({why or f'the default device is {platform}'})"
        print(msg)
        return {"skipped": msg}

    with tempfile.TemporaryDirectory() as tmp:
        rc = gpucheck.main(["--only", "mfu", "--out", tmp] + ["--quick"] * quick)
        path = Path(tmp) / "gpucheck.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {"rc": rc, "checks": rows}
