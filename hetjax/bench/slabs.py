"""``python -m hetjax.bench slabs``: moving one block's params host -> device as one page
slab vs leaf by leaf."""

from __future__ import annotations

import time

import jax
import numpy as np

from hetjax.config import Config


def bench_slabs(quick: bool) -> dict:
    """Host -> device time of one block's params as one slab vs as separate leaves."""
    from hetjax.runtime.placement import Shardings
    from hetjax.storage.pages import SlabLayout
    from models import build_model

    d = 256 if quick else 1024
    config = Config().replace(model=dict(num_layers=1, d_model=d, num_heads=8))
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
    return {
        "bytes": nbytes,
        "pages": layout.num_pages,
        "slab_s": t_slab,
        "per_leaf_s": t_leaves,
        "pages_s": t_pages,
    }
