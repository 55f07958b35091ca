"""``python -m hetjax.bench attention``: a GPT block's backward with the reference
attention vs the blockwise one: XLA's temporary bytes and the time."""

from __future__ import annotations

import time

import jax

from hetjax.config import Config


def bench_attention(quick: bool) -> dict:
    """GPT-2 small's block (d 768, 12 heads, batch 1; --quick: d 64, 4 heads, batch 2)
    at T 1024 and 2048 (--quick: 128 and 256, tiles of 32): the streamed block's backward
    (``block_bwd``: forward from the checkpoint, then the vjp) compiled with
    ``model.attention`` reference and blockwise (default tile, 256): its temporaries
    (``memory_analysis().temp_size_in_bytes``) and its time (jitted, the minimum of
    interleaved rounds)."""
    import jax.numpy as jnp

    from hetjax.parallel.layouts import stage_layouts
    from hetjax.parallel.single import SingleDevice
    from hetjax.runtime.stages.functions import StageFunctions
    from models import build_model

    B, D, H, lengths, block = (2, 64, 4, (128, 256), 32) if quick else (1, 768, 12, (1024, 2048), 0)
    rows = []
    for T in lengths:
        runs, row = {}, {"seq_len": T}
        for impl in ("reference", "blockwise"):
            config = Config().replace(
                model=dict(
                    num_layers=2,
                    d_model=D,
                    num_heads=H,
                    max_seq_len=T,
                    attention=impl,
                    attention_block=block,
                ),
                train=dict(seq_len=T, batch_size=B),
            )
            model = build_model(config.model)
            dtype = jnp.dtype(config.model.compute_dtype)
            layouts = stage_layouts(model, config.memory.page_size)
            fns = StageFunctions(model, layouts, SingleDevice())
            block_layout = layouts["block"]
            params = model.init_stage("block", jax.random.key(0))
            pages = block_layout.to_pages(block_layout.flatten(params, dtype))
            x = jax.random.normal(jax.random.key(1), (B, T, D), dtype)
            compiled = fns.block_bwd.lower(pages, x, x).compile()
            row[f"{impl}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
            runs[impl] = lambda c=compiled, p=pages, x=x: c(p, x, x)
        times = {name: [] for name in runs}
        for fn in runs.values():
            jax.block_until_ready(fn())
        for _ in range(3 if quick else 5):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times[name].append(time.perf_counter() - t0)
        row.update({f"{name}_backward_s": min(ts) for name, ts in times.items()})
        rows.append(row)
    print(
        f"GPT block d {D}, {H} heads, batch {B}, {jnp.dtype(dtype).name}, {jax.default_backend()}"
    )
    print("block backward (recompute + vjp): XLA temporaries MiB, time ms; blockwise / reference")
    header = ("T", "ref MiB", "blk MiB", "ratio", "ref ms", "blk ms", "ratio")
    print(f"{header[0]:>6}" + "".join(f"{h:>10}" for h in header[1:]))
    mib = 2**20
    for r in rows:
        temp_ratio = r["blockwise_temp_bytes"] / r["reference_temp_bytes"]
        time_ratio = r["blockwise_backward_s"] / r["reference_backward_s"]
        print(
            f"{r['seq_len']:>6}{r['reference_temp_bytes'] / mib:>10.1f}"
            f"{r['blockwise_temp_bytes'] / mib:>10.1f}{temp_ratio:>10.3f}"
            f"{r['reference_backward_s'] * 1e3:>10.1f}{r['blockwise_backward_s'] * 1e3:>10.1f}"
            f"{time_ratio:>10.3f}"
        )
    return {"shape": [B, D, H], "rows": rows}
