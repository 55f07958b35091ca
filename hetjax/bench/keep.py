"""``python -m hetjax.bench keep``: per offload.keep_level, the bytes a kept GPT block
holds from forward to backward and its backward's time, vs keeping all and vs
recomputing."""

from __future__ import annotations

import time

import jax

from hetjax.config import Config


def bench_keep(quick: bool) -> dict:
    """offload.keep_level on one GPT block (GPT-2 small's: d 768, 12 heads, 1 x 1024
    tokens; --quick: d 64, 4 heads, 2 x 64): per level, the bytes the kept block's vjp
    holds beyond its inputs (param pages and x), and the jitted backward from it; the
    recomputing block's backward (``block_bwd``: forward from the checkpoint, then vjp)
    for comparison. Functions are timed in interleaved rounds, the minimum of each."""
    import jax.numpy as jnp

    from hetjax.parallel.layouts import stage_layouts
    from hetjax.parallel.single import SingleDevice
    from hetjax.runtime.stages.functions import StageFunctions
    from models import build_model

    B, T, D, H = (2, 64, 64, 4) if quick else (1, 1024, 768, 12)
    config = Config().replace(
        model=dict(num_layers=2, d_model=D, num_heads=H, max_seq_len=T),
        train=dict(seq_len=T),
        # small pages: level all holds the weights unpadded, the others the param pages
        memory=dict(page_size="4KiB" if quick else "256KiB"),
    )
    model = build_model(config.model)
    dtype = jnp.dtype(config.model.compute_dtype)
    layouts = stage_layouts(model, config.memory.page_size)
    fns = StageFunctions(model, layouts, SingleDevice())
    block = layouts["block"]
    pages = block.to_pages(block.flatten(model.init_stage("block", jax.random.key(0)), dtype))
    x = jax.random.normal(jax.random.key(1), (B, T, D), dtype)
    inputs = sum(a.nbytes for a in jax.tree.leaves((pages, x)))
    kept = fns.kept_bytes(B, T, dtype)
    levels = tuple(kept)  # matmuls, all (probs: with model.attention=reference)
    vjps = {level: fns.kept_forward(level)(pages, x)[1] for level in levels}
    runs = {level: (lambda v=vjp: fns.block_bwd_kept(v, x)) for level, vjp in vjps.items()}
    runs["recompute"] = lambda: fns.block_bwd(pages, x, x)
    runs["forward"] = lambda: fns.block_fwd(pages, x)
    times = {name: [] for name in runs}
    for fn in runs.values():
        jax.block_until_ready(fn())
    for _ in range(3 if quick else 15):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    best = {name: min(ts) for name, ts in times.items()}
    held = {level: kept[level] - inputs for level in levels}
    held["recompute"] = 0
    print(f"GPT block d {D}, {H} heads, {B} x {T} tokens, {dtype.name}", end="")
    print(f"; forward {best['forward'] * 1e3:.1f} ms; held: beyond the inputs (params, x)")
    print(f"{'keep level':<12}{'held MiB':>10}{'/ all':>8}{'backward ms':>13}{'saved / all':>13}")
    saved_all = best["recompute"] - best["all"]
    for name in ("all", *reversed(levels[:-1]), "recompute"):
        saved = best["recompute"] - best[name]
        print(
            f"{name:<12}{held[name] / 2**20:>10.2f}{held[name] / held['all']:>8.3f}"
            f"{best[name] * 1e3:>13.1f}{saved / saved_all if saved_all > 0 else 0:>13.2f}"
        )
    print("saved / all: the recompute time a level saves, as a fraction of what all saves")
    return {
        "shape": [B, T, D, H],
        "held_bytes": held,
        "backward_s": {name: best[name] for name in (*levels, "recompute")},
        "forward_s": best["forward"],
    }
