"""``python -m hetjax.bench zero``: ZeRO-3 on 1, 2 and 4 devices: collective bytes per step
and device vs PatrickStar's 6(p-1)/p M, and s/step; then data x tensor parallelism (DP,
TP and DP x TP at 1, 2 and 4 devices): ZeRO-3's bytes and the blocks' tensor-parallel
all-reduces (from the compiled HLO) against Megatron's per-layer volume."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from hetjax.bench.common import _steady_step_time
from hetjax.config import Config
from hetjax.parallel.grouped import GroupedSlabLayout


def _collectives(runtime) -> dict[str, int]:
    """Collective ops XLA compiled into a block's backward and a stage's all-gather."""
    B, sds = runtime.layouts["block"], jax.ShapeDtypeStruct
    t, D = runtime.config.train, runtime.config.model.d_model
    zero = runtime.parallel
    pages = zero.device_pages(B, runtime.compute_dtype)
    x = sds((t.micro_batch_size, t.seq_len, D), runtime.compute_dtype, sharding=zero.sharded.batch)
    slab = sds(
        (B.num_pages, B.page_elems), runtime.compute_dtype, sharding=zero.sharded.slab_device
    )
    texts = [
        runtime.fns.block_bwd.lower(pages, x, x).compile().as_text(),
        zero.gather(B.num_pages, B if isinstance(B, GroupedSlabLayout) else None)
        .lower(slab)
        .compile()
        .as_text(),
    ]
    ops = ("all-gather", "reduce-scatter", "all-reduce")
    return {
        op: sum(text.count(f" {op}(") + text.count(f" {op}-start(") for text in texts) for op in ops
    }


_COLLECTIVE = re.compile(
    r"= (?P<shapes>\(?[^=]*?\)?) (?P<op>all-reduce|all-gather|reduce-scatter|all-to-all"
    r"|collective-permute)(?:-start)?\((?P<rest>.*)$"
)
_SHAPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "pred": 1}


def _group_size(rest: str) -> int | None:
    """The devices of a collective's groups, from its ``replica_groups``: listed
    (``{{0,1},{2,3}}``), iota (``[2,2]<=[4]``) or over mesh axes
    (``mesh['axis_0'=2,'axis_1'=2] {'axis_1'}``); None without (a permute)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m[1]))
        g = 1
        for axis in re.findall(r"'([^']+)'", m[2]):
            g *= int(sizes[axis])
        return g
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len(m[1].split(","))
    m = re.search(r"replica_groups=\[\d+,(\d+)\]", rest)
    return int(m[1]) if m else None


def wire_bytes(hlo: str) -> dict[str, int]:
    """Bytes one device sends, by collective, for each run of a compiled HLO module:
    ring algorithms over a group of g devices, an all-reduce of S bytes 2(g-1)/g S, an
    all-gather of an S-byte result, a reduce-scatter of an S-byte operand and an
    all-to-all of S bytes each (g-1)/g S; a collective-permute sends its S bytes."""
    sent: dict[str, int] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        size = 0
        for shape in _SHAPE.finditer(m["shapes"]):
            n = 1
            for d in filter(None, shape["dims"].split(",")):
                n *= int(d)
            size += n * _BYTES.get(shape["dtype"], 4)
        op = m["op"]
        if op == "collective-permute":
            sent[op] = sent.get(op, 0) + size
            continue
        g = _group_size(m["rest"])
        if g is None:
            continue
        if op == "reduce-scatter":  # the result is 1/g of the operand
            size *= g
        factor = 2 if op == "all-reduce" else 1
        sent[op] = sent.get(op, 0) + factor * size * (g - 1) // g
    return sent


def _block_tensor_bytes(runtime) -> dict[str, int]:
    """Bytes one device sends over the ``model`` axis in one block's forward and its
    backward (which recomputes the forward), from their compiled HLO: the
    collectives other than the ZeRO-3 reduce-scatter of the gradient."""
    B, sds = runtime.layouts["block"], jax.ShapeDtypeStruct
    t, D = runtime.config.train, runtime.config.model.d_model
    zero = runtime.parallel
    pages = zero.device_pages(B, runtime.compute_dtype)
    x = sds((t.micro_batch_size, t.seq_len, D), runtime.compute_dtype, sharding=zero.sharded.batch)
    fwd = wire_bytes(runtime.fns.block_fwd.lower(pages, x).compile().as_text())
    bwd = wire_bytes(runtime.fns.block_bwd.lower(pages, x, x).compile().as_text())
    bwd.pop("reduce-scatter", None)  # the gradient's (ZeRO-3), counted by the runtime
    ops = {op: fwd.get(op, 0) + bwd.get(op, 0) for op in {**fwd, **bwd}}
    return {"forward": sum(fwd.values()), "backward": sum(bwd.values()), "ops": ops}


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
            rows.append(_row(config, run.records, M, skip))
    _print_rows(base, M, rows)
    return {"params": M, "rows": rows, "tensor_rows": _tensor_rows(base, rows, steps, skip)}


def _row(config: Config, records: list, M: int, skip: int) -> dict:
    """One run's row: the collectives' bytes counted by the run and by the formulas,
    its step time, the collectives its compiled steps hold."""
    from hetjax.parallel.zero import Zero3
    from hetjax.runtime.streaming import StreamingRuntime

    dtype, reduce = config.model.compute_dtype, config.distributed.reduce_dtype
    p = config.distributed.data_parallel
    last = records[-1]
    # p = 1 is the single-device streaming runtime: no collectives
    gathered = last.get("all_gather_bytes", 0)
    scattered = last.get("reduce_scatter_bytes", 0)
    compute = np.dtype(dtype).itemsize
    ops = {}
    if p > 1:
        runtime = StreamingRuntime(config, parallel=Zero3(config))
        ops = _collectives(runtime)
        runtime.close()
    grad = compute if reduce == "compute" else 4
    return dict(
        compute_dtype=dtype,
        reduce_dtype=reduce,
        devices=p,
        all_gather_bytes=gathered,
        reduce_scatter_bytes=scattered,
        measured_bytes=gathered + scattered,
        paper_bytes=6 * (p - 1) / p * M,  # fp16 params and grads
        dtype_bytes=(p - 1) / p * M * (2 * compute + grad),
        step_s=_steady_step_time(records, skip),
        hlo_collectives=ops,
    )


def _print_rows(base: Config, M: int, rows: list[dict]) -> None:
    """The table; each row gets its measured / formula ratio."""
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


# (data, tensor) of each row of the data x tensor table (fp32); (1, 1), (2, 1) and (4, 1)
# are the first table's rows
MESHES = ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2))


def _split_params(runtime) -> int:
    """Params of the weights tensor parallelism splits over the ``model`` axis (the
    grouped leaves of each stage's layout, ``parallel/groupings.py``), every block's."""
    count = {"embed": 1, "head": 1, **{g.name: g.num_layers for g in runtime.fns.model.groups}}
    return sum(
        part.layout.size * part.groups * count[name]
        for name, lay in runtime.layouts.items()
        if isinstance(lay, GroupedSlabLayout)
        for part in lay.parts
    )


def zero_formula_bytes(params: int, split: int, data: int, tensor: int) -> float:
    """fp32 bytes ZeRO-3 moves a device per step at data x tensor, from the params
    (``split`` of them the weights tensor parallelism splits): a device's params gathered
    twice (forward, backward), the dense ones over all p devices, its 1/t slice of the
    split ones over the S data devices, and their gradient reduce-scattered once over
    the S data devices (the model axis's devices hold the same gradient of the dense
    ones); 3(p-1)/p M x 4 without tensor parallelism."""
    p, S = data * tensor, data
    dense, mine = params - split, split / tensor
    return 4 * (2 * (dense * (p - 1) / p + mine * (S - 1) / S) + (dense + mine) * (S - 1) / S)


def _tensor_rows(base: Config, dp_rows: list[dict], steps: int, skip: int) -> list[dict]:
    """DP, TP and DP x TP rows, fp32: ZeRO-3's bytes a device moves per step (the
    runtime's counters: its pages split over all data x tensor devices, the gradients
    scattered over the data devices) against :func:`zero_formula_bytes` (3(p-1)/p M x 4
    without tensor parallelism), and the blocks' tensor-parallel collectives (the compiled
    forward's and backward's, times the blocks) against Megatron's volume: a block's
    forward all-reduces its attention's and its MLP's output, its backward their input
    gradients, each 2(t-1)/t x the device's (b, T, D) activation bytes (b its data
    group's rows); a streamed block's backward recomputes its forward, two more."""
    from hetjax.parallel.zero import Zero3
    from hetjax.runtime.streaming import StreamingRuntime
    from hetjax.train import train
    from models import build_model

    M = build_model(base.model).param_count()
    L, D, T = base.model.num_layers, base.model.d_model, base.train.seq_len
    fp32 = {r["devices"]: r for r in dp_rows if r["compute_dtype"] == "float32"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for data, tensor in MESHES:
            p = data * tensor
            config = base.replace(distributed=dict(data_parallel=data, tensor_parallel=tensor))
            split = 0
            if tensor == 1:
                r = fp32[p]
                zero, step_s = r["measured_bytes"], r["step_s"]
                tp = {"forward": 0, "backward": 0, "ops": {}}
            else:
                run = train(config, Path(tmp) / f"{data}x{tensor}", verbose=False)
                last = run.records[-1]
                zero = last.get("all_gather_bytes", 0) + last.get("reduce_scatter_bytes", 0)
                step_s = _steady_step_time(run.records, skip)
                runtime = StreamingRuntime(config, parallel=Zero3(config))
                tp = _block_tensor_bytes(runtime)
                split = _split_params(runtime)
                runtime.close()
            b = base.train.micro_batch_size // data
            act = 2 * (tensor - 1) / tensor * b * T * D * 4
            rows.append(
                dict(
                    data=data,
                    tensor=tensor,
                    devices=p,
                    zero_bytes=zero,
                    zero_formula_bytes=zero_formula_bytes(M, split, data, tensor),
                    tensor_bytes=L * (tp["forward"] + tp["backward"]),
                    tensor_forward_bytes=L * tp["forward"],
                    megatron_bytes=L * 4 * act,  # 2 forward, 2 backward a block
                    megatron_recompute_bytes=L * 6 * act,  # and the recomputed forward's 2
                    tensor_ops={op: L * n for op, n in tp["ops"].items()},
                    step_s=step_s,
                )
            )
    print(
        f"\ndata x tensor, fp32; ZeRO-3 counted by the runtime, tensor-parallel bytes from "
        f"the compiled blocks (x {L} blocks; the vocabulary-parallel head's not counted); "
        "formula: M_d dense and M_s split params, S data devices of p: "
        "4 [2 (M_d (p-1)/p + M_s/t (S-1)/S) + (M_d + M_s/t)(S-1)/S], 3(p-1)/p M x4 at t = 1"
    )
    print(
        f"{'data':>5}{'tensor':>7}{'ZeRO MB':>9}{'formula':>15}{'ratio':>7}"
        f"{'TP MB':>8}{'fwd':>7}{'Megatron 4/layer':>18}{'6/layer':>9}{'ratio':>7}{'s/step':>9}"
    )
    for r in rows:
        ratio = lambda a, b: a / b if b else float("nan")
        r["zero_ratio"] = ratio(r["zero_bytes"], r["zero_formula_bytes"])
        r["tensor_ratio"] = ratio(r["tensor_bytes"], r["megatron_recompute_bytes"])
        print(
            f"{r['data']:>5}{r['tensor']:>7}{r['zero_bytes'] / 1e6:>9.2f}"
            f"{r['zero_formula_bytes'] / 1e6:>15.2f}{r['zero_ratio']:>7.3f}"
            f"{r['tensor_bytes'] / 1e6:>8.2f}{r['tensor_forward_bytes'] / 1e6:>7.2f}"
            f"{r['megatron_bytes'] / 1e6:>18.2f}{r['megatron_recompute_bytes'] / 1e6:>9.2f}"
            f"{r['tensor_ratio']:>7.3f}{r['step_s']:>9.3f}  "
            + (", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(r["tensor_ops"].items())) or "")
        )
    return rows
