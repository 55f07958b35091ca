"""``python -m hetjax.bench slabs``: moving one block's params host -> device as one page
slab vs leaf by leaf, and what the compiled block functions hold and copy when they take
the block's params as pages vs as leaf buffers (``pages.LeafBuffers``)."""

from __future__ import annotations

import time

import jax
import numpy as np

from hetjax.config import Config


def bench_slabs(quick: bool) -> dict:
    """Host -> device time of one block's params as one slab vs as separate leaves."""
    from hetjax.parallel.single import Shardings
    from hetjax.storage.pages import SlabLayout
    from models import build_model

    d = 256 if quick else 1024
    config = Config().replace(
        model=dict(num_layers=1, d_model=d, num_heads=8),
        memory=dict(page_size="64KiB" if quick else "4MiB"),  # weights spanning pages
    )
    model = build_model(config.model)
    params = jax.device_get(model.init_stage("block", jax.random.key(0)))
    layout = SlabLayout.from_params(params, config.memory.page_size)
    place = Shardings.single_device()
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
    compiled = _compiled_block(config, quick)
    return {
        "bytes": nbytes,
        "pages": layout.num_pages,
        "slab_s": t_slab,
        "per_leaf_s": t_leaves,
        "pages_s": t_pages,
        **compiled,
    }


def _compiled_block(config: Config, quick: bool) -> dict:
    """A GPT block's forward and backward (recompute + vjp), compiled taking its params
    as pages (``layouts.stage_layouts``, ZeRO-3's) and as leaf buffers (the one-device
    placement's): XLA's temporary bytes and the concatenates in the optimized HLO (a
    weight cut out of the pages it spans, a copy at every use; the backward's also build
    the gradient's pages), in fp32 and bf16."""
    import jax.numpy as jnp

    from hetjax.parallel.layouts import stage_layouts
    from hetjax.parallel.single import SingleDevice
    from hetjax.runtime.stages.functions import StageFunctions
    from models import build_model

    B, T = (1, 64) if quick else (1, 128)
    out = {}
    print(
        f"a block's compiled functions, batch {B} x {T} tokens (XLA temporaries MiB, concatenates):"
    )
    print(f"{'dtype':<10}{'function':<10}{'pages':>16}{'leaf buffers':>16}")
    for dtype in ("float32", "bfloat16"):
        cfg = config.replace(model=dict(compute_dtype=dtype, max_seq_len=T), train=dict(seq_len=T))
        model = build_model(cfg.model)
        page = cfg.memory.page_size
        for name, layouts in (
            ("pages", stage_layouts(model, page)),
            ("leaves", SingleDevice().stage_layouts(model, page)),
        ):
            fns = StageFunctions(model, layouts, SingleDevice(), block_grad_dtype=jnp.dtype(dtype))
            args = fns.abstract_args(B, T, jnp.dtype(dtype))
            for fn in ("block_fwd", "block_bwd"):
                compiled = getattr(fns, fn).lower(*args[fn]).compile()
                temps = compiled.memory_analysis().temp_size_in_bytes
                out[f"{dtype}_{fn}_{name}_temp_bytes"] = temps
                out[f"{dtype}_{fn}_{name}_concatenates"] = compiled.as_text().count(" concatenate(")
        for fn in ("block_fwd", "block_bwd"):
            cells = "".join(
                f"{out[f'{dtype}_{fn}_{n}_temp_bytes'] / 2**20:>9.1f}"
                f"{out[f'{dtype}_{fn}_{n}_concatenates']:>7d}"
                for n in ("pages", "leaves")
            )
            print(f"{dtype:<10}{fn:<10}{cells}")
    return out
