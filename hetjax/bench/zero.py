"""``python -m hetjax.bench zero``: ZeRO-3 on 1, 2 and 4 devices: collective bytes per step
and device vs PatrickStar's 6(p-1)/p M, and s/step."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np

from hetjax.bench.common import _steady_step_time
from hetjax.config import Config


def _collectives(runtime) -> dict[str, int]:
    """Collective ops XLA compiled into a block's backward and a stage's all-gather."""
    B, sds = runtime.layouts["block"], jax.ShapeDtypeStruct
    t, D = runtime.config.train, runtime.config.model.d_model
    zero = runtime.placement
    pages = [sds((B.page_elems,), runtime.compute_dtype, sharding=zero.sharded.gathered)]
    x = sds((t.micro_batch_size, t.seq_len, D), runtime.compute_dtype, sharding=zero.sharded.batch)
    slab = sds(
        (B.num_pages, B.page_elems), runtime.compute_dtype, sharding=zero.sharded.slab_device
    )
    texts = [
        runtime.fns.block_bwd.lower(pages * B.num_pages, x, x).compile().as_text(),
        zero.gather(B.num_pages).lower(slab).compile().as_text(),
    ]
    ops = ("all-gather", "reduce-scatter", "all-reduce")
    return {
        op: sum(text.count(f" {op}(") + text.count(f" {op}-start(") for text in texts) for op in ops
    }


# (compute dtype, distributed.reduce_dtype, devices) of each row: fp32 on 1, 2, 4 devices,
# then bf16 compute with the gradients reduce-scattered in fp32 and in bf16
VARIANTS = (
    *(("float32", "float32", p) for p in (1, 2, 4)),
    *(("bfloat16", reduce, p) for p in (2, 4) for reduce in ("float32", "compute")),
)


def bench_zero(quick: bool) -> dict:
    """ZeRO-3 with the same global batch on 1, 2 and 4 devices: all-gather and
    reduce-scatter bytes per step and device (counted from the slabs gathered and the
    gradient slabs scattered, each moving (p-1)/p of its size per device) against
    PatrickStar's 6(p-1)/p M (fp16 params and gradients, M parameters) and the same
    formula for this run's dtypes (two gathers in the compute dtype, a reduce-scatter
    in ``distributed.reduce_dtype``); and the median s/step. fp32 compute, then bf16
    with the reduce-scatter in fp32 and in bf16 (``reduce_dtype=compute``)."""
    from hetjax.runtime.streaming import StreamingRuntime
    from hetjax.runtime.zero import Zero3
    from hetjax.train import train
    from models import build_model

    if jax.device_count() < 4:
        raise SystemExit(
            "hetjax bench zero needs 4 devices; on CPU run it with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=4"
        )
    steps, skip = (4, 2) if quick else (10, 3)
    model = (
        dict(num_layers=2, d_model=64, num_heads=4, max_seq_len=64)
        if quick
        else dict(num_layers=4, d_model=256, num_heads=4, max_seq_len=128)
    )
    base = Config().replace(
        model=model,
        train=dict(steps=steps, batch_size=16, seq_len=64 if quick else 128, eval_batches=0),
        offload=dict(mode="stream"),
        memory=dict(page_size="64KiB" if quick else "256KiB"),
        data=dict(corpus_bytes=500_000),
        checkpoint=dict(every_steps=0, at_end=False),
    )
    M = build_model(base.model).param_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, reduce, p in VARIANTS:
            config = base.replace(
                model=dict(compute_dtype=dtype),
                distributed=dict(data_parallel=p, reduce_dtype=reduce),
            )
            run = train(config, Path(tmp) / f"{dtype}-{reduce}-{p}", verbose=False)
            last = run.records[-1]
            # p = 1 is the single-device streaming runtime: no collectives
            gathered = last.get("all_gather_bytes", 0)
            scattered = last.get("reduce_scatter_bytes", 0)
            compute = np.dtype(config.model.compute_dtype).itemsize
            ops = {}
            if p > 1:
                runtime = StreamingRuntime(config, placement=Zero3(config))
                ops = _collectives(runtime)
                runtime.close()
            grad = compute if reduce == "compute" else 4
            rows.append(
                dict(
                    compute_dtype=dtype,
                    reduce_dtype=reduce,
                    devices=p,
                    all_gather_bytes=gathered,
                    reduce_scatter_bytes=scattered,
                    measured_bytes=gathered + scattered,
                    paper_bytes=6 * (p - 1) / p * M,  # fp16 params and grads
                    dtype_bytes=(p - 1) / p * M * (2 * compute + grad),
                    step_s=_steady_step_time(run.records, skip),
                    hlo_collectives=ops,
                )
            )
    print(
        f"model {M / 1e6:.2f}M params, global batch {base.train.batch_size} x "
        f"{base.train.seq_len}; embed and head gradients reduce-scatter in fp32 always"
    )
    print(
        f"{'compute':>9}{'reduce':>9}{'devices':>8}{'gathered MB':>13}{'scattered MB':>14}"
        f"{'measured MB':>13}"
        f"{'6(p-1)/p M':>12}{'same, dtypes':>14}{'ratio':>7}{'s/step':>9}  HLO collectives"
    )
    for r in rows:
        ratio = r["measured_bytes"] / r["dtype_bytes"] if r["dtype_bytes"] else float("nan")
        r["ratio"] = ratio
        ops = ", ".join(f"{k} {v}" for k, v in r["hlo_collectives"].items() if v) or "none"
        print(
            f"{r['compute_dtype']:>9}{r['reduce_dtype']:>9}"
            f"{r['devices']:>8}{r['all_gather_bytes'] / 1e6:>13.2f}"
            f"{r['reduce_scatter_bytes'] / 1e6:>14.2f}{r['measured_bytes'] / 1e6:>13.2f}"
            f"{r['paper_bytes'] / 1e6:>12.2f}{r['dtype_bytes'] / 1e6:>14.2f}{ratio:>7.3f}"
            f"{r['step_s']:>9.3f}  {ops}"
        )
    return {"params": M, "rows": rows}
