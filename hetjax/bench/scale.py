"""``python -m hetjax.bench scale``: the largest GPT that trains offloaded within a 1 GiB
device and 6 GiB host budget vs the largest that fits 1 GiB in memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetjax.allocator import MALLOC_ENV
from hetjax.bench.common import _scratch_dir
from hetjax.config import Config

# GPT shapes (layers, d_model, heads), smallest first; vocab 256, so ~12 L d^2 params.
# Offloaded without clipping and stopping at a non-finite step, no written update can be
# dropped, so the NVMe files are one copy written in place
# (hetjax/nvme_copies.py): 12 B/param of fp32 master, m and v (the fp32 params
# are the master; no gradients kept): 48.2 GB at 142 x 1536 (4.02B), checked against
# the disk's free space at start-up. (Before 2026-11-26 the bench clipped: two
# copies and spilled gradients, ~36 B/param, 72.4 GB at 72 x 1536.) Each size's
# files are deleted before the next.
SCALE_SHAPES = [
    (4, 512, 8),
    (8, 768, 12),
    (12, 1024, 16),
    (16, 1536, 16),
    (24, 1536, 16),
    (32, 1536, 16),
    (40, 1536, 16),
    (56, 1536, 16),
    (72, 1536, 16),
    (78, 1536, 16),
    (142, 1536, 16),
]


SCALE_SHAPES_QUICK = [(2, 32, 4), (4, 128, 4)]


def _scale_config(shape, mode: str, quick: bool, state_dtype: str = "") -> Config:
    """3 steps of a tiny batch; ``stream``: params and optimizer state on NVMe within
    the device and host budgets, no clipping and a non-finite step stops the run (so
    the state is one copy written in place); ``none``: everything on the device.
    ``state_dtype``: the optimizer moments' dtype (``optimizer.state_dtype``, where
    that key exists; "": fp32)."""
    layers, d, heads = shape
    config = Config().replace(
        model=dict(num_layers=layers, d_model=d, num_heads=heads, max_seq_len=64),
        train=dict(steps=3, batch_size=1, seq_len=32, eval_batches=0, log_every=1),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=100_000),
    )
    if mode == "stream":
        budgets = ("4MiB", "24MiB") if quick else ("1GiB", "6GiB")
        config = config.replace(
            offload=dict(mode="stream", params="nvme", optimizer="nvme", prefetch_depth=1),
            memory=dict(
                device_budget=budgets[0],
                host_budget=budgets[1],
                page_size="64KiB" if quick else "4MiB",
            ),
            optimizer=dict(grad_clip=0.0),
            train=dict(on_nonfinite="stop"),
        )
    if state_dtype:  # HOOK (issue #43 items 1-2): bf16 moments, once the key exists
        config = config.replace(optimizer=dict(state_dtype=state_dtype))
    return config


def _scale_attempt(spec: str) -> None:
    from hetjax.runtime.in_memory import step_device_bytes

    """One attempt, run in a child process (``python -c``): prints one JSON line."""
    import resource

    from hetjax.config import ConfigError
    from hetjax.train import train
    from models import build_model

    args = json.loads(spec)
    out: dict = {}
    try:
        config = _scale_config(
            tuple(args["shape"]), args["mode"], args["quick"], args.get("state_dtype", "")
        )
        out["params"] = params = build_model(config.model).param_count()
        if args["mode"] == "none":
            out["device_bytes"] = need = step_device_bytes(config)
            if need > args["device_budget"]:
                raise ConfigError(f"needs {need} device bytes, budget {args['device_budget']}")
        # (the trained params are not gathered: 16 GB at 4B params, which the machine's
        # RAM does not hold on top of the run; the 4B attempt was killed by it, after its
        # 3 steps. ``verbose``: the run's log and summary, for a size run by hand)
        run = train(
            config, args["workdir"], verbose=args.get("verbose", False), return_params=False
        )
        last = run.records[-1]
        out.update(
            fits=len(run.records) == 3,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            step_s=last["step_time_s"],
            loss=last["loss"],
            **{k: last[k] for k in ("host_bytes", "nvme_bytes") if k in last},
        )
        if "nvme_bytes" in last:  # what the table asks, per parameter
            moved = last.get("nvme_read_bytes", 0) + last.get("nvme_write_bytes", 0)
            out.update(
                nvme_read_bytes=last.get("nvme_read_bytes", 0),
                nvme_write_bytes=last.get("nvme_write_bytes", 0),
                disk_bytes_per_param=last["nvme_bytes"] / params,
                moved_bytes_per_step_per_param=moved / params,
            )
        # the accounted step's (the first: runtime/loop/ledger.py)
        accounted = [r["device_bytes_peak"] for r in run.records if "device_bytes_peak" in r]
        if accounted:
            out["device_bytes_peak"] = max(accounted)
    except ConfigError as e:
        out.update(fits=False, why=str(e))
    print("SCALE " + json.dumps(out), flush=True)


def _attempt(spec: dict, timeout: float) -> dict:
    """One size, in a child process (:func:`_scale_attempt`) with a timeout: its result
    (an out-of-memory kill, a crash or the timeout: one that does not fit), printed."""
    code = f"from hetjax.bench.scale import _scale_attempt; _scale_attempt({json.dumps(spec)!r})"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **MALLOC_ENV},
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SCALE ")]
        if lines:
            attempt = json.loads(lines[-1][len("SCALE ") :])
        else:  # killed (out of memory) or crashed
            tail = proc.stderr.strip().splitlines()[-1:] or [""]
            attempt = dict(fits=False, why=f"exit {proc.returncode}: {tail[0]}")
    except subprocess.TimeoutExpired:
        attempt = dict(fits=False, why=f"timeout after {timeout} s")
    mode, shape = spec["mode"], spec["shape"]
    attempt.update(mode=mode, shape=list(shape), wall_s=time.perf_counter() - t0)
    params = attempt.get("params", 0)
    status = "trains" if attempt["fits"] else f"fails: {attempt.get('why', '')[:90]}"
    rss = f"RSS {attempt['peak_rss'] / 2**30:5.2f} GiB" if "peak_rss" in attempt else ""
    if "disk_bytes_per_param" in attempt:
        rss += (
            f"  {attempt['disk_bytes_per_param']:.1f} B/param on disk, "
            f"{attempt['moved_bytes_per_step_per_param']:.1f} B/param moved a step"
        )
    print(
        f"{mode:<7} {shape[0]:>3} x {shape[1]:<5} {params / 1e6:>9.1f}M params  "
        f"{attempt['wall_s']:>7.1f} s  {rss:>14}  {status}",
        flush=True,
    )
    return attempt


def bench_scale(quick: bool, start: str | None = None, state_dtype: str = "") -> dict:
    """The largest GPT that trains 3 steps offloaded (params and optimizer state on
    NVMe) within ``memory.device_budget=1GiB`` and ``memory.host_budget=6GiB`` vs the
    largest whose ``offload.mode=none`` step fits the same 1 GiB of device memory (XLA's
    own memory analysis; on this CPU nothing would stop it using more). Sizes go up
    until one fails; each attempt runs in a child process with a timeout, so an
    out-of-memory kill or a hang ends only that attempt. ``start`` (``"LAYERSxD"``, e.g.
    ``72x1536``) begins the offloaded sizes there (the full sweep takes over an hour).
    ``state_dtype``: the optimizer moments' dtype (``optimizer.state_dtype``; "": fp32)."""
    shapes = SCALE_SHAPES_QUICK if quick else SCALE_SHAPES
    stream_shapes = shapes
    if start:
        starts = [i for i, s in enumerate(shapes) if f"{s[0]}x{s[1]}" == start]
        if not starts:
            names = ", ".join(f"{s[0]}x{s[1]}" for s in shapes)
            raise SystemExit(f"bench scale: --from {start!r} is not one of the sizes: {names}")
        stream_shapes = shapes[starts[0] :]
    device_budget = (4 << 20) if quick else (1 << 30)
    # per size: the 4B attempt initialises 48 GB on disk and moves ~100 GB a step, which
    # on this shared 2-core machine takes over an hour
    timeout = 300 if quick else 4 * 3600
    results: dict = {"device_budget": device_budget, "attempts": []}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # NVMe state: the local disk
        for mode in ("none", "stream"):
            best = None
            for shape in shapes if mode == "none" else stream_shapes:
                workdir = Path(tmp) / f"{mode}_{'x'.join(map(str, shape))}"
                spec = dict(
                    shape=shape,
                    mode=mode,
                    quick=quick,
                    workdir=str(workdir),
                    device_budget=device_budget,
                    state_dtype=state_dtype,
                )
                attempt = _attempt(spec, timeout)
                results["attempts"].append(attempt)
                if not attempt["fits"]:
                    break
                best = attempt
                shutil.rmtree(workdir, ignore_errors=True)  # free the disk for the next size
            results[f"{mode}_largest_params"] = best["params"] if best else 0
            results[f"{mode}_largest_shape"] = best["shape"] if best else None
    none, stream = results["none_largest_params"], results["stream_largest_params"]
    results["ratio"] = stream / none if none else float("inf")
    print(
        f"largest that trains 3 steps: offloaded {stream / 1e6:.1f}M params, "
        f"in memory (none) {none / 1e6:.1f}M params; ratio {results['ratio']:.1f}x"
    )
    return results
