"""Benchmarks: ``python -m hetjax.bench <name> [--quick] [--out FILE]``.

Each benchmark measures everything it compares in the same run, prints a table and a
ratio, and writes its results as JSON (default ``runs/bench/<name>.json``).

  overhead  streamed (``offload.mode=stream``) vs in-memory (``none``) step time on a
            compute-bound config
  slabs     moving one block's params host -> device as one page slab vs leaf by leaf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from hetjax.config import Config


def _steady_step_time(records, skip: int) -> float:
    times = [r["step_time_s"] for r in records[skip:]]
    return float(np.median(times))


def bench_overhead(quick: bool) -> dict:
    """Step time of ``stream`` (params on host, prefetch depth 2) vs ``none`` on a
    compute-bound shape: a batch large enough that matmuls dominate transfers."""
    from hetjax.train import train

    steps, skip = (4, 2) if quick else (12, 3)
    model = (
        dict(num_layers=4, d_model=128, num_heads=4, max_seq_len=128)
        if quick
        else dict(num_layers=6, d_model=384, num_heads=6, max_seq_len=256)
    )
    batch = dict(batch_size=4, seq_len=64) if quick else dict(batch_size=16, seq_len=256)
    base = Config().replace(
        model=model,
        train=dict(steps=steps, eval_batches=0, log_every=1000, **batch),
        data=dict(corpus_bytes=500_000),
    )
    runs = {  # name -> (offload.mode, model.remat, offload.prefetch_depth)
        "none": ("none", False, 2),
        "none_remat": ("none", True, 2),  # the same block recompute as streaming, in memory
        "stream": ("stream", False, 2),
        "stream_depth0": ("stream", False, 0),  # no prefetch: what overlap buys
    }
    labels = {
        "none": "none (in memory)",
        "none_remat": "none, remat per block",
        "stream": "stream (params on host)",
        "stream_depth0": "stream, prefetch depth 0",
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (mode, remat, depth) in runs.items():
            config = base.replace(
                offload=dict(mode=mode, prefetch_depth=depth), model=dict(model, remat=remat)
            )
            run = train(config, Path(tmp) / name, verbose=False)
            timed = run.records[skip:]
            results[name] = _steady_step_time(run.records, skip)
            results[f"{name}_tflops"] = float(np.median([r["tflops"] for r in timed]))
            if mode == "stream":
                results[f"{name}_optimizer"] = float(np.median([r["optimizer_s"] for r in timed]))
    ratio = results["stream"] / results["none"]
    ratio_remat = results["stream"] / results["none_remat"]
    print(f"{'mode':<26}{'s/step':>10}{'TFLOP/s':>10}{'optimizer s':>13}")
    for name, label in labels.items():
        opt = results.get(f"{name}_optimizer")
        opt_text = f"{opt:>13.4f}" if opt is not None else f"{'-':>13}"
        print(f"{label:<26}{results[name]:>10.4f}{results[name + '_tflops']:>10.4f}{opt_text}")
    print(f"stream / none step time: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    print(
        f"stream / none-with-remat: {ratio_remat:.3f} ({(ratio_remat - 1) * 100:+.1f}%)"
        "  (streaming's own cost: the block recompute is in both)"
    )
    print(
        f"stream: host optimizer {results['stream_optimizer'] / results['stream'] * 100:.1f}% "
        f"of the step; prefetch depth 0 / depth 2: "
        f"{results['stream_depth0'] / results['stream']:.3f}"
    )
    return {
        "model": model,
        "batch": batch,
        "steps_timed": steps - skip,
        **{f"{name}_s": results[name] for name in runs},
        "stream_optimizer_s": results["stream_optimizer"],
        "ratio": ratio,
        "ratio_vs_remat": ratio_remat,
    }


def bench_slabs(quick: bool) -> dict:
    """Host -> device time of one block's params as one slab vs as separate leaves."""
    from hetjax.pages import SlabLayout
    from hetjax.placement import Placement
    from models import build_model

    d = 256 if quick else 1024
    config = Config().replace(model=dict(num_layers=1, d_model=d, num_heads=8))
    model = build_model(config.model)
    params = jax.device_get(model.init_stage("block", jax.random.key(0)))
    layout = SlabLayout.from_params(params, config.memory.page_size)
    place = Placement.single_device()
    slab_np = layout.flatten_np(params)
    slab = jax.device_put(slab_np, place.host)
    pages = jax.device_put([np.array(p) for p in layout.to_pages(slab_np)], place.host)
    leaves = jax.device_put(params, place.host)
    repeats = 5 if quick else 30

    def timed(fn):
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn())
        return (time.perf_counter() - t0) / repeats

    t_slab = timed(lambda: jax.device_put(slab, place.device))
    t_leaves = timed(lambda: jax.device_put(leaves, place.device))
    t_pages = timed(lambda: jax.device_put(pages, place.device))
    nbytes = layout.size * 4
    print(f"block params: {nbytes / 2**20:.1f} MiB in {len(jax.tree.leaves(params))} leaves")
    print(f"{'transfer':<12}{'ms':>10}{'GB/s':>10}")
    rows = (("one slab", t_slab), ("per leaf", t_leaves), (f"{layout.num_pages} pages", t_pages))
    for name, t in rows:
        print(f"{name:<12}{t * 1e3:>10.3f}{nbytes / t / 1e9:>10.2f}")
    print(
        f"time relative to one slab: per leaf {t_leaves / t_slab:.2f}, pages {t_pages / t_slab:.2f}"
    )
    return {
        "bytes": nbytes,
        "pages": layout.num_pages,
        "slab_s": t_slab,
        "per_leaf_s": t_leaves,
        "pages_s": t_pages,
    }


BENCHMARKS = {"overhead": bench_overhead, "slabs": bench_slabs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="a reduced run (for tests)")
    parser.add_argument("--out", default=None, help="JSON output (default runs/bench/NAME.json)")
    args = parser.parse_args(argv)
    print(
        f"hetjax bench {args.name}: {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}), jax {jax.__version__}"
    )
    result = BENCHMARKS[args.name](args.quick)
    result.update(
        name=args.name,
        quick=args.quick,
        platform=jax.devices()[0].platform,
        date=time.strftime("%Y-%m-%d"),
    )
    out = Path(args.out or f"runs/bench/{args.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
