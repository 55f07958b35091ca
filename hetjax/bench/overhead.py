"""``python -m hetjax.bench overhead``: streamed (offload.mode=stream) vs in-memory (none)
step time on a compute-bound config."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from hetjax.bench.common import _scratch_dir, _steady_step_time
from hetjax.config import Config

LABELS = {
    "none": "none (in memory)",
    "none_remat": "none, remat per block",
    "stream": "stream (params host, opt NVMe)",
    "stream_swap": "stream, all blocks swapped",
    "stream_keep": "stream, all blocks kept",
    "stream_depth0": "stream, prefetch depth 0",
    "stream_traced": "stream, every 2nd step traced",
}


def _runs(layers: int) -> dict[str, tuple]:
    """name -> (offload.mode, model.remat, offload.prefetch_depth, train.trace_every,
    offload.keep_blocks, offload.swap_blocks)."""
    return {
        "none": ("none", False, 2, 0, 0, 0),
        "none_remat": ("none", True, 2, 0, 0, 0),  # the same block recompute as streaming
        "stream": ("stream", False, 2, 0, 0, 0),
        # every block swaps its in-block activations (offload.swap_level's default,
        # matmuls) to host memory in forward and back for backward: host traffic and the
        # elementwise recompute instead of recomputing the matmuls, params fetched again
        "stream_swap": ("stream", False, 2, 0, 0, layers),
        # every block keeps its in-block activations: the same FLOPs as `none`, so the
        # difference is streaming's own cost (params in, gradients out, host optimizer)
        "stream_keep": ("stream", False, 2, 0, layers, 0),
        "stream_depth0": ("stream", False, 0, 0, 0, 0),  # no prefetch: what overlap buys
        # every other step traced: traced vs untraced steps of one run, the timeline's cost
        "stream_traced": ("stream", False, 2, 2, 0, 0),
    }


def bench_overhead(quick: bool) -> dict:
    """Step time of the offloaded runtime (``stream``: params on the host, optimizer
    state on NVMe, prefetch depth 2) vs ``none`` on a compute-bound shape: a batch large
    enough that matmuls dominate transfers. Also: the same with prefetch off, and with
    every step traced (``train.trace_every=1``: what the timeline costs); and the three
    ways a streamed block can get its in-block activations back for backward, in one run
    so that load changes hit them alike: recompute them (``stream``), swap them to host
    memory and back (``stream_swap``), keep them on the device (``stream_keep``)."""
    from hetjax.train import train

    steps, skip = (3, 1) if quick else (12, 3)
    model = (
        dict(num_layers=4, d_model=128, num_heads=4, max_seq_len=128)
        if quick
        else dict(num_layers=6, d_model=384, num_heads=6, max_seq_len=256)
    )
    batch = dict(batch_size=4, seq_len=64) if quick else dict(batch_size=16, seq_len=256)
    base = Config().replace(
        model=model,
        train=dict(steps=steps, eval_batches=0, log_every=1000, **batch),
        memory=dict(page_size="64KiB" if quick else "4MiB"),
        data=dict(corpus_bytes=500_000),
    )
    runs = _runs(model["num_layers"])
    results = {}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # NVMe state: the local disk
        for name, (mode, remat, depth, trace_every, keep, swap) in runs.items():
            config = base.replace(
                offload=dict(
                    mode=mode,
                    prefetch_depth=depth,
                    optimizer="nvme",
                    keep_blocks=keep,
                    swap_blocks=swap,
                ),
                model=dict(model, remat=remat),
                train=dict(trace_every=trace_every),
            )
            run = train(config, Path(tmp) / name, verbose=False)
            results |= _measured(name, run.records, skip, mode == "stream", trace_every)
    summary = _print_overhead(results)
    return {
        "model": model,
        "batch": batch,
        "steps_timed": steps - skip,
        **{f"{name}_s": results[name] for name in runs},
        "stream_optimizer_s": results["stream_optimizer"],
        "stream_dispatch_outside_s": results["stream_outside"],
        **summary,
        "traced_step_s": results["traced_step_s"],
        "untraced_step_s": results["untraced_step_s"],
        "trace_step_over_busiest": results["trace_overlap"],
    }


def _measured(name: str, records: list, skip: int, streamed: bool, traced: int) -> dict:
    """One run's figures: its steady step time and TFLOP/s; streamed, the host
    optimizer's time, the dispatch thread's time outside dispatch and the gradient
    thread's waits; traced, its traced and untraced steps apart."""
    timed = records[skip:]
    median = lambda key: float(np.median([r[key] for r in timed]))
    out = {name: _steady_step_time(records, skip), f"{name}_tflops": median("tflops")}
    if streamed:
        out[f"{name}_optimizer"] = median("optimizer_s")
        out[f"{name}_outside"] = median("dispatch_outside_s")
        work = [r["dispatch_outside_s"] - r["dispatch_handoff_wait_s"] for r in timed]
        out[f"{name}_outside_work"] = float(np.median(work))
        for wait in ("grad_copy_wait_s", "grad_loop_wait_s"):
            out[f"{name}_{wait}"] = median(wait)
    if traced:  # interleaved, so load changes hit both sides alike
        with_trace = [r for r in timed if "trace_busiest_lane" in r]
        out["traced_step_s"] = float(np.median([r["step_time_s"] for r in with_trace]))
        plain = [r["step_time_s"] for r in timed if "trace_busiest_lane" not in r]
        out["untraced_step_s"] = float(np.median(plain))
        busiest = [r["trace_step_over_busiest"] for r in with_trace]
        out["trace_overlap"] = float(np.median(busiest))
    return out


def _print_overhead(results: dict) -> dict:
    """Prints the table and the ratios; returns the ratios."""
    ratio = results["stream"] / results["none"]
    ratio_remat = results["stream"] / results["none_remat"]
    ratio_keep = results["stream_keep"] / results["none"]
    ratio_swap = results["stream_swap"] / results["none"]
    print(f"{'mode':<32}{'s/step':>10}{'TFLOP/s':>10}{'optimizer s':>13}{'outside dispatch s':>20}")
    for name, label in LABELS.items():
        opt, outside = results.get(f"{name}_optimizer"), results.get(f"{name}_outside")
        opt_text = f"{opt:>13.4f}" if opt is not None else f"{'-':>13}"
        outside_text = f"{outside:>20.4f}" if outside is not None else f"{'-':>20}"
        print(
            f"{label:<32}{results[name]:>10.4f}{results[name + '_tflops']:>10.4f}"
            f"{opt_text}{outside_text}"
        )
    print(f"stream / none step time: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    print(
        f"stream / none-with-remat: {ratio_remat:.3f} ({(ratio_remat - 1) * 100:+.1f}%)"
        "  (streaming's own cost: the block recompute is in both)"
    )
    print(
        f"stream, all blocks kept / none: {ratio_keep:.3f} ({(ratio_keep - 1) * 100:+.1f}%)"
        "  (the same FLOPs: params streamed in, gradients out, optimizer on the host)"
    )
    print(
        f"stream, recompute / swap / keep: {results['stream']:.4f} / "
        f"{results['stream_swap']:.4f} / {results['stream_keep']:.4f} s/step; / none: "
        f"{ratio:.3f} / {ratio_swap:.3f} / {ratio_keep:.3f}  (one run)"
    )
    print(
        f"stream: host optimizer {results['stream_optimizer'] / results['stream'] * 100:.1f}% "
        f"of the step; prefetch depth 0 / depth 2: "
        f"{results['stream_depth0'] / results['stream']:.3f}"
    )
    outside = results["stream_outside"] / results["stream"]
    work = results["stream_outside_work"] / results["stream"]
    copy_wait, loop_wait = results["stream_grad_copy_wait_s"], results["stream_grad_loop_wait_s"]
    print(
        f"stream: the dispatch thread outside dispatch {outside * 100:.1f}% of the step, "
        f"{work * 100:.1f}% of it not waiting for room in the gradient hand-off (target "
        f"<= 5%); the gradient thread waited {copy_wait:.3f} s for copies (the device "
        f"behind), {loop_wait:.3f} s for the optimizer"
    )
    trace_cost = results["traced_step_s"] / results["untraced_step_s"]
    print(
        f"traced / untraced steps of one run: {trace_cost:.3f} ({(trace_cost - 1) * 100:+.1f}%);"
        f" traced steps: step / busiest lane {results['trace_overlap']:.2f}"
    )
    return {
        "stream_dispatch_outside_frac": outside,
        "stream_dispatch_work_frac": work,
        "stream_grad_copy_wait_s": copy_wait,
        "stream_grad_loop_wait_s": loop_wait,
        "ratio": ratio,
        "ratio_vs_remat": ratio_remat,
        "ratio_keep": ratio_keep,
        "ratio_swap": ratio_swap,
        "trace_cost": trace_cost,
    }
