"""Benchmarks: ``python -m hetjax.bench <name> [--quick] [--out FILE]``.

Each benchmark measures everything it compares in the same run, prints a table and a
ratio, and writes its results as JSON (default ``runs/bench/<name>.json``).

  overhead  streamed (``offload.mode=stream``) vs in-memory (``none``) step time on a
            compute-bound config
  slabs     moving one block's params host -> device as one page slab vs leaf by leaf
  keep      per offload.keep_level: the bytes a kept GPT block holds from forward to
            backward and its backward's time, vs keeping all and vs recomputing
  nvme      the NVMe tier and host optimizer against their limits, in one run:
            TensorStore read/write GB/s vs the raw disk (O_DIRECT), optimizer params/s
            vs the memory-bandwidth bound (28 B/param), step time vs max(compute,
            optimizer, I/O), and the DeepSpeed ZeRO-3 NVMe peer shape's s/step
  io        the TensorStore tier's read/write GB/s vs the raw sequential disk (O_DIRECT)
  optimizer the host optimizer's params/s vs the memory-bandwidth bound (28 B/param)
  lockfree  optimizer.mode=lockfree vs sync on a tiny model: final losses, step time
  scale     the largest GPT that trains 3 steps offloaded within a 1 GiB device and 6 GiB
            host budget vs the largest that fits 1 GiB in memory (offload.mode=none)
  gpu       (GPU only) MFU offloaded vs in HBM, TFLOP/s of a model larger than HBM
  plan      the planner's predicted step time vs the measured one, tiny and small GPTs
            under a device budget that makes offload.mode=auto stream, and the tiny
            GPT data-parallel (ZeRO-3) on 2 virtual CPU devices
  zero      ZeRO-3 on 1, 2, 4 devices: collective bytes per step and device vs the
            6(p-1)/p M of PatrickStar / Angel-PTM, and s/step (needs 4 devices: on CPU
            XLA_FLAGS=--xla_force_host_platform_device_count=4)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.allocator import MALLOC_ENV, tune_host_allocator
from hetjax.config import Config, load_config
from hetjax.planning.hardware import drop_page_cache, measure_optimizer


def _scratch_dir() -> Path:
    """Where benchmarks put their files: ``runs/bench`` under the working directory (the
    local disk hetjax would use; ``runs/`` is ignored by git)."""
    path = Path("runs/bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _steady_step_time(records, skip: int) -> float:
    times = [r["step_time_s"] for r in records[skip:]]
    return float(np.median(times))


def bench_overhead(quick: bool) -> dict:
    """Step time of the offloaded runtime (``stream``: params on the host, optimizer
    state on NVMe, prefetch depth 2) vs ``none`` on a compute-bound shape: a batch large
    enough that matmuls dominate transfers. Also: the same with prefetch off, and with
    every step traced (``train.trace_every=1``: what the timeline costs)."""
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
    layers = model["num_layers"]
    # name -> (offload.mode, model.remat, offload.prefetch_depth, train.trace_every,
    #          offload.keep_blocks)
    runs = {
        "none": ("none", False, 2, 0, 0),
        "none_remat": ("none", True, 2, 0, 0),  # the same block recompute as streaming
        "stream": ("stream", False, 2, 0, 0),
        # every block keeps its in-block activations: the same FLOPs as `none`, so the
        # difference is streaming's own cost (params in, gradients out, host optimizer)
        "stream_keep": ("stream", False, 2, 0, layers),
        "stream_depth0": ("stream", False, 0, 0, 0),  # no prefetch: what overlap buys
        # every other step traced: traced vs untraced steps of one run, the timeline's cost
        "stream_traced": ("stream", False, 2, 2, 0),
    }
    labels = {
        "none": "none (in memory)",
        "none_remat": "none, remat per block",
        "stream": "stream (params host, opt NVMe)",
        "stream_keep": "stream, all blocks kept",
        "stream_depth0": "stream, prefetch depth 0",
        "stream_traced": "stream, every 2nd step traced",
    }
    results = {}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # NVMe state: the local disk
        for name, (mode, remat, depth, trace_every, keep) in runs.items():
            config = base.replace(
                offload=dict(mode=mode, prefetch_depth=depth, optimizer="nvme", keep_blocks=keep),
                model=dict(model, remat=remat),
                train=dict(trace_every=trace_every),
            )
            run = train(config, Path(tmp) / name, verbose=False)
            timed = run.records[skip:]
            results[name] = _steady_step_time(run.records, skip)
            results[f"{name}_tflops"] = float(np.median([r["tflops"] for r in timed]))
            if mode == "stream":
                results[f"{name}_optimizer"] = float(np.median([r["optimizer_s"] for r in timed]))
            if trace_every:  # interleaved, so load changes hit both sides alike
                traced = [r["step_time_s"] for r in timed if "trace_busiest_lane" in r]
                plain = [r["step_time_s"] for r in timed if "trace_busiest_lane" not in r]
                results["traced_step_s"] = float(np.median(traced))
                results["untraced_step_s"] = float(np.median(plain))
                results["trace_overlap"] = float(
                    np.median(
                        [r["trace_step_over_busiest"] for r in timed if "trace_busiest_lane" in r]
                    )
                )
    ratio = results["stream"] / results["none"]
    ratio_remat = results["stream"] / results["none_remat"]
    ratio_keep = results["stream_keep"] / results["none"]
    print(f"{'mode':<32}{'s/step':>10}{'TFLOP/s':>10}{'optimizer s':>13}")
    for name, label in labels.items():
        opt = results.get(f"{name}_optimizer")
        opt_text = f"{opt:>13.4f}" if opt is not None else f"{'-':>13}"
        print(f"{label:<32}{results[name]:>10.4f}{results[name + '_tflops']:>10.4f}{opt_text}")
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
        f"stream: host optimizer {results['stream_optimizer'] / results['stream'] * 100:.1f}% "
        f"of the step; prefetch depth 0 / depth 2: "
        f"{results['stream_depth0'] / results['stream']:.3f}"
    )
    trace_cost = results["traced_step_s"] / results["untraced_step_s"]
    print(
        f"traced / untraced steps of one run: {trace_cost:.3f} ({(trace_cost - 1) * 100:+.1f}%);"
        f" traced steps: step / busiest lane {results['trace_overlap']:.2f}"
    )
    return {
        "model": model,
        "batch": batch,
        "steps_timed": steps - skip,
        **{f"{name}_s": results[name] for name in runs},
        "stream_optimizer_s": results["stream_optimizer"],
        "ratio": ratio,
        "ratio_vs_remat": ratio_remat,
        "ratio_keep": ratio_keep,
        "traced_step_s": results["traced_step_s"],
        "untraced_step_s": results["untraced_step_s"],
        "trace_cost": trace_cost,
        "trace_step_over_busiest": results["trace_overlap"],
    }


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


def bench_keep(quick: bool) -> dict:
    """offload.keep_level on one GPT block (GPT-2 small's: d 768, 12 heads, 1 x 1024
    tokens; --quick: d 64, 4 heads, 2 x 64): per level, the bytes the kept block's vjp
    holds beyond its inputs (param pages and x), and the jitted backward from it; the
    recomputing block's backward (``block_bwd``: forward from the checkpoint, then vjp)
    for comparison. Functions are timed in interleaved rounds, the minimum of each."""
    import jax.numpy as jnp

    from hetjax.config import KEEP_LEVELS
    from hetjax.runtime.stages import StageFunctions, stage_layouts
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
    fns = StageFunctions(model, layouts, jax.jit, lambda pages, dtype: pages)
    block = layouts["block"]
    pages = block.to_pages(block.flatten(model.init_stage("block", jax.random.key(0)), dtype))
    x = jax.random.normal(jax.random.key(1), (B, T, D), dtype)
    inputs = sum(a.nbytes for a in jax.tree.leaves((pages, x)))
    kept = fns.kept_bytes(B, T, dtype)
    vjps = {level: fns.kept_forward(level)(pages, x)[1] for level in KEEP_LEVELS}
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
    held = {level: kept[level] - inputs for level in KEEP_LEVELS}
    held["recompute"] = 0
    print(f"GPT block d {D}, {H} heads, {B} x {T} tokens, {dtype.name}", end="")
    print(f"; forward {best['forward'] * 1e3:.1f} ms; held: beyond the inputs (params, x)")
    print(f"{'keep level':<12}{'held MiB':>10}{'/ all':>8}{'backward ms':>13}{'saved / all':>13}")
    saved_all = best["recompute"] - best["all"]
    for name in ("all", *reversed(KEEP_LEVELS[:-1]), "recompute"):
        saved = best["recompute"] - best[name]
        print(
            f"{name:<12}{held[name] / 2**20:>10.2f}{held[name] / held['all']:>8.3f}"
            f"{best[name] * 1e3:>13.1f}{saved / saved_all if saved_all > 0 else 0:>13.2f}"
        )
    print("saved / all: the recompute time a level saves, as a fraction of what all saves")
    return {
        "shape": [B, T, D, H],
        "held_bytes": held,
        "backward_s": {name: best[name] for name in (*KEEP_LEVELS, "recompute")},
        "forward_s": best["forward"],
    }


# -- nvme -----------------------------------------------------------------------------------

PEER_SHAPE = dict(num_layers=4, d_model=256, num_heads=4, vocab_size=8192, max_seq_len=128)
PEER_BATCH = dict(batch_size=4, seq_len=128)
# DeepSpeed ZeRO-3 with the optimizer offloaded to NVMe on this machine, same shape, fp32
# (../shared/MEASUREMENTS.md; torch and DeepSpeed are not dependencies of hetjax).
PEER_S_PER_STEP = 0.5


def _raw_disk_bandwidth(directory: Path, nbytes: int, block: int = 4 << 20) -> tuple[float, float]:
    """Sequential write and read GB/s of one file with O_DIRECT (no page cache), in
    ``block``-sized requests: the disk's raw bandwidth as this process sees it."""
    import mmap
    import os

    path = directory / "raw.bin"
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(0).bytes(block))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    t0 = time.perf_counter()
    for _ in range(nbytes // block):
        os.write(fd, buf)
    os.fsync(fd)
    write = nbytes / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    t0 = time.perf_counter()
    while os.readv(fd, [buf]) > 0:
        pass
    read = nbytes / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    path.unlink()
    return write, read


def _tensorstore_bandwidth(directory: Path, nbytes: int, page: int) -> tuple[float, float, float]:
    """Write (until on disk: ``os.sync`` included) and cold-read GB/s of whole pages
    through :class:`PageStore`, all requests in flight at once as the loop issues them;
    and the write GB/s of the process's first pass.

    The write is timed in the steady state of training, which rewrites pages that exist:
    one untimed pass first writes every page, as start-up does. The first pass of a
    process is slower (0.43-0.65 GB/s against 0.97-1.31 for the passes after it, same
    files, measured here): glibc serves its first large buffers from fresh mmaps, a
    page fault per 4 KiB, and reuses them afterwards."""
    import os

    from hetjax.storage.nvme import PageStore

    elems = page // 4
    pages = nbytes // page
    store = PageStore(directory / "ts", ["master"], pages, elems)
    data = np.random.default_rng(0).random(pages * elems, dtype=np.float32)
    stage = 4  # pages per request, as a stage of a few pages

    def write_all() -> None:
        futures = [
            store.write("master", p, data[p * elems : (p + stage) * elems])
            for p in range(0, pages, stage)
        ]
        for f in futures:
            f.result()
        os.sync()

    t0 = time.perf_counter()
    write_all()  # start-up's pass: the files exist from here on
    first = nbytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    write_all()
    write = nbytes / (time.perf_counter() - t0) / 1e9
    drop_page_cache(directory / "ts")
    t0 = time.perf_counter()
    reads = [store.read("master", p, min(stage, pages - p)) for p in range(0, pages, stage)]
    for r in reads:
        r.result()
    read = nbytes / (time.perf_counter() - t0) / 1e9
    return write, read, first


class _Copy:
    """A streaming copy of ``n`` fp32 by ``threads`` threads, each its own slice: the
    host's memory bandwidth as GB/s of bytes read + written."""

    def __init__(self, n: int, threads: int = 1):
        import concurrent.futures

        self.a = np.ones(n, np.float32)
        self.b = np.empty_like(self.a)
        edges = np.linspace(0, n, threads + 1).astype(int)
        self.slices = [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)

    def gbs(self) -> float:
        t0 = time.perf_counter()
        list(self.pool.map(lambda s: np.copyto(self.b[s], self.a[s]), self.slices))
        return 2 * self.a.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.pool.shutdown()


def _memory_bandwidth(n: int, threads: int = 1) -> float:
    """Host memory GB/s of a streaming copy by ``threads`` threads, best of a few."""
    copy = _Copy(n, threads)
    best = max(copy.gbs() for _ in range(5))
    copy.close()
    return best


def _disk_rows(directory: Path, quick: bool, label: str = "") -> dict:
    """The TensorStore tier's page write / cold read GB/s against the raw disk's
    sequential O_DIRECT bandwidth, measured one after the other on ``directory``."""
    disk_bytes = (64 if quick else 1024) << 20
    page = 4 << 20
    raw_w, raw_r = _raw_disk_bandwidth(directory, disk_bytes)
    ts_w, ts_r, first_w = _tensorstore_bandwidth(directory, disk_bytes, page)
    pad = " " * len(label)
    print(f"{label}disk, {disk_bytes >> 20} MiB in 4 MiB pages   GB/s write   GB/s read")
    print(f"{pad}raw O_DIRECT, sequential        {raw_w:>10.2f} {raw_r:>10.2f}")
    print(f"{pad}TensorStore PageStore            {ts_w:>10.2f} {ts_r:>10.2f}")
    print(f"{pad}achieved / raw                   {ts_w / raw_w:>10.2f} {ts_r / raw_r:>10.2f}")
    print(f"{pad}(the process's first write pass, new files: {first_w:.2f} GB/s)")
    return {
        "disk_bytes": disk_bytes,
        "raw_write": raw_w,
        "raw_read": raw_r,
        "ts_write": ts_w,
        "ts_read": ts_r,
        "ts_first_write": first_w,
        "write_vs_raw": ts_w / raw_w,
        "read_vs_raw": ts_r / raw_r,
    }


@dataclasses.dataclass
class _Run:
    """One optimizer of :func:`_optimizer_rows` updating one slab again and again, the
    new state written as ``mode`` says (``fresh``, ``spare`` or ``in place``)."""

    opt: Any
    mode: str
    state: tuple
    spare: dict | None
    times: list = dataclasses.field(default_factory=list)

    def step(self, grad) -> None:
        kwargs = {"spare": self.spare} if self.spare is not None else {}
        t0 = time.perf_counter()
        slabs, scalars, pages = self.opt.update(
            "s", *self.state, grad, (0.0, 0.0), in_place=self.mode == "in place", **kwargs
        )
        jax.block_until_ready((slabs, pages))
        self.times.append(time.perf_counter() - t0)
        if self.spare is not None:  # the generation before last, as the loop recycles
            self.spare = self.state[0]
        self.state = (slabs, scalars)


def _optimizer_rows(quick: bool, label: str = "") -> dict:
    """The host optimizer's params/s against the memory-bandwidth bound: AdamW moves
    28 B/param (read param, grad, m, v: 16; write param, m, v: 12), so the bound is the
    machine's copy bandwidth (all cores, as the update runs) / 28. Measured refreshing
    bf16 params (the GPU compute dtype: 2 B/param more), for both kernels
    (``optimizer.host_kernel``) and both ways the loop writes the new state: into the
    generation before last (``spare``: state in RAM) and over a stage just read
    (``in place``: state streamed from NVMe); for the run's kernel also into fresh
    buffers (what the loop avoids: each costs page faults on the first touch).

    This VM's memory bandwidth drifts by tens of percent within a minute, so each round
    times the copy and then every update, and a ratio is the median over rounds of the
    round's rate / the round's bound. The headline is the run's kernel on the NVMe
    tier's path (in place)."""
    from hetjax.planning.hardware import slab_optimizer
    from hetjax.storage.pages import aligned_concatenate

    n = (4 if quick else 32) << 20
    cores = os.cpu_count() or 1
    grad = aligned_concatenate([np.full(n, 1e-3, np.float32)])
    runs = {}
    for kernel in ("auto", "optax"):
        opt = slab_optimizer(n, "bfloat16", page_elems=1 << 18, kernel=kernel)
        name = "native" if opt.native else "optax"
        if name in {k for k, _ in runs}:
            continue  # auto fell back to optax
        modes = ("fresh", "spare", "in place") if kernel == "auto" else ("spare", "in place")
        for mode in modes:
            state = opt.init("s", np.ones(n, np.float32))
            spare = opt.init("s", np.ones(n, np.float32))[0] if mode == "spare" else None
            runs[name, mode] = _Run(opt, mode, state, spare)
    copy, copy1 = _Copy(n, cores), _Copy(n)
    bws, bws1 = [], []
    for _ in range(4 if quick else 10):
        bws.append(max(copy.gbs(), copy.gbs()))
        bws1.append(copy1.gbs())
        for run in runs.values():
            run.step(grad)
    copy.close()
    copy1.close()
    bws, bws1 = bws[1:], bws1[1:]  # the first round compiles
    rows = {}
    for key, run in runs.items():
        rates = [n / t for t in run.times[1:]]
        ratios = [r / (bw * 1e9 / 28) for r, bw in zip(rates, bws, strict=True)]
        rows[key] = (float(np.median(rates)), max(rates), float(np.median(ratios)))
    del runs
    bw, bw1 = float(np.median(bws)), float(np.median(bws1))
    bound = bw * 1e9 / 28
    rate32 = measure_optimizer(n, "float32")
    pad = " " * len(label)
    print(
        f"{label}host optimizer (AdamW, {n >> 20}M-param slab, bf16 params): memory "
        f"{bw:.1f} GB/s on {cores} cores (median of rounds; {bw1:.1f} on one) -> bound "
        f"{bound / 1e6:.0f} M params/s at 28 B/param"
    )
    print(f"{pad}  kernel  writes to   M params/s median / best   rate / bound")
    for (kernel, mode), (median, best, ratio) in rows.items():
        print(
            f"{pad}  {kernel:<7} {mode:<10} {median / 1e6:>10.0f} / {best / 1e6:<10.0f}"
            f"{ratio:>10.2f}"
        )
    kernel = "native" if ("native", "in place") in rows else "optax"
    rate, _, ratio = rows[kernel, "in place"]
    print(
        f"{pad}achieved / bound {ratio:.2f} ({kernel}, in place: the NVMe tier's update); "
        f"state in RAM {rows[kernel, 'spare'][2]:.2f}; fp32 params {rate32 / 1e6:.0f} M "
        f"params/s"
    )
    return {
        "slab_params": n,
        "memory_gbs": bw,
        "memory_gbs_one_thread": bw1,
        "bound_params_s": bound,
        "kernel": kernel,
        "optimizer_params_s": rate,
        "optimizer_ram_params_s": rows[kernel, "spare"][0],
        "optimizer_fp32_params_s": rate32,
        "optimizer_vs_bound": ratio,
        "optimizer_ram_vs_bound": rows[kernel, "spare"][2],
        "rows": {
            f"{k} {m}": {"median": a, "best": b, "vs_bound": c}
            for (k, m), (a, b, c) in rows.items()
        },
    }


def bench_io(quick: bool) -> dict:
    """TensorStore tier read/write GB/s vs the raw sequential disk bandwidth, one run."""
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # the disk hetjax would use
        return _disk_rows(Path(tmp), quick)


def bench_optimizer(quick: bool) -> dict:
    """Host optimizer params/s vs the memory-bandwidth bound measured in the same run
    (:func:`_optimizer_rows`)."""
    return _optimizer_rows(quick)


def _step_parts(runtime, batch) -> dict:
    """Forward+backward alone, the optimizer alone (state in RAM) and the step's NVMe
    I/O alone (read every stage's state and params, write them back), each timed
    separately. The I/O is timed twice: as the step meets it (``io_s``: the files as
    the last step left them, so recent writes may still be in the page cache) and cold
    (``io_cold_s``: synced and dropped from the page cache first, every read from the
    disk); writes complete into the page cache in both, as in the step (no fsync)."""
    import os

    t0 = time.perf_counter()
    grads = runtime.compute_gradients(batch)
    compute = time.perf_counter() - t0

    states, opt, params = runtime.states, runtime.optimizer, runtime.param_store
    names = runtime.update_order
    nvme_params = runtime.config.offload.params == "nvme"

    def io() -> tuple[float, dict]:
        if nvme_params:
            params.wait()  # the last writes landed: every stage is read from the files
        t0 = time.perf_counter()
        handles = {n: states.prefetch(n) for n in names}
        if nvme_params:
            for n in names:
                params.prefetch(n)
        held = {n: states.get(n, handles[n]) for n in names}
        pages = {n: params.get(n) for n in names} if nvme_params else {}
        for n in names:
            states.put(n, *held[n])
            if nvme_params:
                params.publish(n, pages[n])
        states.abort()  # waits for the writes (into the uncommitted generation)
        if nvme_params:
            params.abort()
        return time.perf_counter() - t0, held

    warm, _ = io()
    os.sync()
    drop_page_cache(runtime.nvme_dir)
    cold, held = io()

    held = {
        n: ({k: opt.as_chunks(runtime.layout_name(n), v) for k, v in s.items()}, c)
        for n, (s, c) in held.items()
    }
    held = {n: (jax.device_put(s, opt.sharding), c) for n, (s, c) in held.items()}
    jax.block_until_ready(held)
    t0 = time.perf_counter()  # as the loop updates a stage read from NVMe: in place
    out = [
        opt.update(runtime.layout_name(n), *held[n], grads[n], (0.0, 0.0), in_place=True)
        for n in names
    ]
    jax.block_until_ready(out)
    optimizer = time.perf_counter() - t0
    return {"compute_s": compute, "optimizer_s": optimizer, "io_s": warm, "io_cold_s": cold}


def bench_nvme(quick: bool) -> dict:
    from hetjax.data import make_datasets
    from hetjax.runtime.streaming import StreamingRuntime

    steps, skip = (4, 2) if quick else (12, 4)
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # the disk hetjax would use
        tmp = Path(tmp)
        results.update(_disk_rows(tmp, quick, "(1) "))
        results.update(_optimizer_rows(quick, "(2) "))

        config = Config().replace(
            model=PEER_SHAPE,
            train=dict(steps=steps, eval_batches=0, log_every=1000, **PEER_BATCH),
            optimizer=dict(grad_clip=0.0),
            offload=dict(mode="stream", optimizer="nvme", params="nvme"),
            data=dict(corpus_bytes=500_000),
        )
        runtime = StreamingRuntime(config, workdir=tmp / "run")
        data, _, _ = make_datasets(config)
        t = config.train
        shape = (t.grad_accum, t.micro_batch_size, t.seq_len + 1)
        times, busy = [], []
        for s in range(steps):
            batch = data.batch(s).reshape(shape)
            t0 = time.perf_counter()
            report = runtime.train_step(batch)
            times.append(time.perf_counter() - t0)
            busy.append(report.metrics["optimizer_busy_s"])
        step = float(np.median(times[skip:]))
        parts = [_step_parts(runtime, data.batch(0).reshape(shape)) for _ in range(3)]
        parts = {k: float(np.median([p[k] for p in parts])) for k in parts[0]}
        runtime.close()
        bound_step = max(parts["compute_s"], parts["optimizer_s"], parts["io_s"])
        serial = parts["compute_s"] + parts["io_s"]
        results.update(step_s=step, **parts, step_vs_max=step / bound_step)
        results.update(step_vs_compute_plus_io=step / serial)
        print(
            f"(3) GPT-2 4L d256 vocab 8192 seq 128 batch 4 fp32, optimizer+params on NVMe, "
            f"sync: {step:.3f} s/step"
        )
        print(
            f"    alone: compute {parts['compute_s']:.3f} s, optimizer {parts['optimizer_s']:.3f}"
            f" s, NVMe I/O {parts['io_s']:.3f} s (cold, every read from the disk: "
            f"{parts['io_cold_s']:.3f} s); step / max = {step / bound_step:.2f}, "
            f"step / (compute + I/O) = {step / serial:.2f}"
        )
        results.update(peer_s=PEER_S_PER_STEP, speedup_vs_peer=PEER_S_PER_STEP / step)
        print(
            f"(4) DeepSpeed ZeRO-3 optimizer->NVMe, same shape (MEASUREMENTS.md): "
            f"{PEER_S_PER_STEP:.2f} s/step; peer / hetjax step time {PEER_S_PER_STEP / step:.2f}"
        )
    return results


def bench_lockfree(quick: bool) -> dict:
    """Lock-free vs sync on the tiny model of ``tests/test_offload.py``: the mean of the
    last 10 losses and the median step time, optimizer state on NVMe."""
    from hetjax.train import train

    steps = 20 if quick else 40
    base = Config().replace(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32),
        train=dict(steps=steps, batch_size=4, seq_len=16, eval_batches=0, log_every=1000),
        optimizer=dict(warmup_steps=4, lr=3e-3),
        offload=dict(mode="stream", optimizer="nvme"),
        memory=dict(page_size="16KiB"),
        data=dict(corpus_bytes=200_000),
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "lockfree"):
            config = base.replace(optimizer=dict(mode=mode, max_staleness=1))
            run = train(config, Path(tmp) / mode, verbose=False)
            results[f"{mode}_last10_loss"] = float(np.mean(run.losses[-10:]))
            results[f"{mode}_step_s"] = _steady_step_time(run.records, 5)
    print(f"{'mode':<10}{'last-10 loss':>14}{'s/step':>10}")
    for mode in ("sync", "lockfree"):
        print(
            f"{mode:<10}{results[mode + '_last10_loss']:>14.4f}{results[mode + '_step_s']:>10.4f}"
        )
    gap = results["lockfree_last10_loss"] - results["sync_last10_loss"]
    speed = results["sync_step_s"] / results["lockfree_step_s"]
    print(f"lockfree - sync loss: {gap:+.4f} nats; lockfree steps {speed:.2f}x as fast")
    return {"steps": steps, **results, "loss_gap": gap, "speedup": speed}


# -- scale ----------------------------------------------------------------------------------

# GPT shapes (layers, d_model, heads), smallest first; vocab 256, so ~12 L d^2 params.
# Offloaded, the NVMe files take ~32 B/param (fp32 master, m, v and params, two
# generations each) plus the gradients spilled for a clipping redo: 67.4 GiB at 72 x 1536
# (2.04B), 73.4 GiB at 78 x 1536 (2.21B), checked against the disk's free space at
# start-up. Each size's files are deleted before the next.
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
]
SCALE_SHAPES_QUICK = [(2, 32, 4), (4, 128, 4)]
# glibc's allocator keeps freed buffers (per-thread arenas, no trimming): measured at 57M
# params, a streaming run's RSS reached 4.2 GB with 1.0 GB of live arrays; with these
# settings (hetjax.planning.hardware.MALLOC_ENV, which ``python -m hetjax.launch`` applies too)
# 1.6 GB steady, 2.6 GB peak. The children run with them, and report peak RSS.


def _scale_config(shape, mode: str, quick: bool) -> Config:
    """3 steps of a tiny batch; ``stream``: params and optimizer state on NVMe within
    the device and host budgets; ``none``: everything on the device."""
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
        )
    return config


def _scale_attempt(spec: str) -> None:
    from hetjax.runtime.in_memory import step_device_bytes

    """One attempt, run in a child process (``python -c``): prints one JSON line."""
    import resource

    from hetjax.config import ConfigError
    from hetjax.train import train
    from models import build_model

    args = json.loads(spec)
    config = _scale_config(tuple(args["shape"]), args["mode"], args["quick"])
    out: dict = {"params": build_model(config.model).param_count()}
    try:
        if args["mode"] == "none":
            out["device_bytes"] = need = step_device_bytes(config)
            if need > args["device_budget"]:
                raise ConfigError(f"needs {need} device bytes, budget {args['device_budget']}")
        run = train(config, args["workdir"], verbose=False)
        last = run.records[-1]
        out.update(
            fits=len(run.records) == 3,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            step_s=last["step_time_s"],
            loss=last["loss"],
            **{k: last[k] for k in ("device_bytes_peak", "host_bytes", "nvme_bytes") if k in last},
        )
    except ConfigError as e:
        out.update(fits=False, why=str(e))
    print("SCALE " + json.dumps(out), flush=True)


def bench_scale(quick: bool, start: str | None = None) -> dict:
    """The largest GPT that trains 3 steps offloaded (params and optimizer state on
    NVMe) within ``memory.device_budget=1GiB`` and ``memory.host_budget=6GiB`` vs the
    largest whose ``offload.mode=none`` step fits the same 1 GiB of device memory (XLA's
    own memory analysis; on this CPU nothing would stop it using more). Sizes go up
    until one fails; each attempt runs in a child process with a timeout, so an
    out-of-memory kill or a hang ends only that attempt. ``start`` (``"LAYERSxD"``, e.g.
    ``72x1536``) begins the offloaded sizes there (the full sweep takes over an hour)."""
    import subprocess

    shapes = SCALE_SHAPES_QUICK if quick else SCALE_SHAPES
    stream_shapes = shapes
    if start:
        starts = [i for i, s in enumerate(shapes) if f"{s[0]}x{s[1]}" == start]
        if not starts:
            names = ", ".join(f"{s[0]}x{s[1]}" for s in shapes)
            raise SystemExit(f"bench scale: --from {start!r} is not one of the sizes: {names}")
        stream_shapes = shapes[starts[0] :]
    device_budget = (4 << 20) if quick else (1 << 30)
    timeout = 300 if quick else 3600
    results: dict = {"device_budget": device_budget, "attempts": []}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # NVMe state: the local disk
        for mode in ("none", "stream"):
            best = None
            for shape in shapes if mode == "none" else stream_shapes:
                workdir = Path(tmp) / f"{mode}_{'x'.join(map(str, shape))}"
                spec = json.dumps(
                    dict(
                        shape=shape,
                        mode=mode,
                        quick=quick,
                        workdir=str(workdir),
                        device_budget=device_budget,
                    )
                )
                code = f"from hetjax.bench import _scale_attempt; _scale_attempt({spec!r})"
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
                attempt.update(mode=mode, shape=list(shape), wall_s=time.perf_counter() - t0)
                results["attempts"].append(attempt)
                params = attempt.get("params", 0)
                status = "trains" if attempt["fits"] else f"fails: {attempt.get('why', '')[:90]}"
                rss = f"RSS {attempt['peak_rss'] / 2**30:5.2f} GiB" if "peak_rss" in attempt else ""
                print(
                    f"{mode:<7} {shape[0]:>3} x {shape[1]:<5} {params / 1e6:>9.1f}M params  "
                    f"{attempt['wall_s']:>7.1f} s  {rss:>14}  {status}",
                    flush=True,
                )
                if not attempt["fits"]:
                    break
                best = attempt
                import shutil

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


# -- gpu --------------------------------------------------------------------------------------


def bench_gpu(quick: bool) -> dict:
    """On a GPU: MFU of an offloaded run (params on the host, optimizer state in host
    RAM) vs an in-HBM run (``none``) of the same per-layer shape, and the TFLOP/s of a
    model deeper than HBM holds (16 B/param of state over the device's memory).
    Elsewhere: skipped, saying so."""
    from hetjax.train import train

    device = jax.devices()[0]
    if device.platform != "gpu":
        msg = f"bench gpu: skipped, no GPU (the default device is {device.platform})"
        print(msg)
        return {"skipped": msg}
    stats = device.memory_stats() or {}
    hbm = int(stats.get("bytes_limit", 0))
    d, heads = (1024, 8) if quick else (4096, 32)
    seq, batch = (256, 4) if quick else (2048, 8)
    layers_in_hbm = 2 if quick else 8
    per_layer = 12 * d * d
    layers_big = max(layers_in_hbm, int(1.1 * hbm / (16 * per_layer)) + 1) if hbm else 2
    if quick:
        layers_big = layers_in_hbm * 2
    steps, skip = (3, 1) if quick else (8, 3)
    base = Config().replace(
        model=dict(d_model=d, num_heads=heads, max_seq_len=seq, compute_dtype="bfloat16"),
        train=dict(steps=steps, batch_size=batch, seq_len=seq, eval_batches=0, log_every=1000),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=2_000_000),
    )
    rows = {
        "none": (layers_in_hbm, dict(mode="none")),
        "stream": (layers_in_hbm, dict(mode="stream", optimizer="host")),
        # 16 B/param of state over HBM: optimizer state on NVMe, params in host RAM
        "stream_big": (layers_big, dict(mode="stream", optimizer="nvme")),
    }
    results: dict = {"device": device.device_kind, "hbm_bytes": hbm}
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:
        for name, (layers, offload) in rows.items():
            config = base.replace(model=dict(num_layers=layers), offload=offload)
            try:
                run = train(config, Path(tmp) / name, verbose=False)
            except Exception as e:  # noqa: BLE001 — e.g. the NVMe path lacks the room
                results[name] = {"layers": layers, "failed": repr(e)[:300]}
                print(f"{name}: {layers} layers failed: {e!r}"[:300])
                continue
            timed = run.records[skip:]
            results[name] = {
                "layers": layers,
                "s_per_step": _steady_step_time(run.records, skip),
                "tflops": float(np.median([r["tflops"] for r in timed])),
                "mfu": float(np.median([r["mfu"] for r in timed])),
            }
    print(f"{'run':<12}{'layers':>8}{'s/step':>10}{'TFLOP/s':>10}{'MFU':>8}")
    for name, r in results.items():
        if isinstance(r, dict) and "failed" not in r:
            print(
                f"{name:<12}{r['layers']:>8}{r['s_per_step']:>10.3f}{r['tflops']:>10.1f}"
                f"{r['mfu']:>8.3f}"
            )
    if "mfu" in results["stream"] and "mfu" in results["none"]:
        results["mfu_ratio"] = results["stream"]["mfu"] / results["none"]["mfu"]
        print(f"offloaded / in-HBM MFU: {results['mfu_ratio']:.3f}")
    return results


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


def bench_zero(quick: bool) -> dict:
    """ZeRO-3 with the same global batch on 1, 2 and 4 devices: all-gather and
    reduce-scatter bytes per step and device (counted from the slabs gathered and the
    gradient slabs scattered, each moving (p-1)/p of its size per device) against
    PatrickStar's 6(p-1)/p M (fp16 params and gradients, M parameters) and the same
    formula for this run's dtypes; and the median s/step."""
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
        for p in (1, 2, 4):
            config = base.replace(distributed=dict(data_parallel=p))
            run = train(config, Path(tmp) / str(p), verbose=False)
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
            rows.append(
                dict(
                    devices=p,
                    all_gather_bytes=gathered,
                    reduce_scatter_bytes=scattered,
                    measured_bytes=gathered + scattered,
                    paper_bytes=6 * (p - 1) / p * M,  # fp16 params and grads
                    dtype_bytes=(p - 1) / p * M * (2 * compute + 4),  # fp32 grads
                    step_s=_steady_step_time(run.records, skip),
                    hlo_collectives=ops,
                )
            )
    print(
        f"model {M / 1e6:.2f}M params, global batch {base.train.batch_size} x "
        f"{base.train.seq_len}, {base.model.compute_dtype} compute, fp32 gradients"
    )
    print(
        f"{'devices':>8}{'gathered MB':>13}{'scattered MB':>14}{'measured MB':>13}"
        f"{'6(p-1)/p M':>12}{'same, dtypes':>14}{'ratio':>7}{'s/step':>9}  HLO collectives"
    )
    for r in rows:
        ratio = r["measured_bytes"] / r["dtype_bytes"] if r["dtype_bytes"] else float("nan")
        r["ratio"] = ratio
        ops = ", ".join(f"{k} {v}" for k, v in r["hlo_collectives"].items() if v) or "none"
        print(
            f"{r['devices']:>8}{r['all_gather_bytes'] / 1e6:>13.2f}"
            f"{r['reduce_scatter_bytes'] / 1e6:>14.2f}{r['measured_bytes'] / 1e6:>13.2f}"
            f"{r['paper_bytes'] / 1e6:>12.2f}{r['dtype_bytes'] / 1e6:>14.2f}{ratio:>7.3f}"
            f"{r['step_s']:>9.3f}  {ops}"
        )
    return {"params": M, "rows": rows}


def _plan_row(name: str, overrides: dict, steps: int, devices: int = 1) -> dict:
    """Plans config ``name`` with ``overrides`` on this machine (the measured ``local``
    profile, the traced model) and trains the plan: predicted and measured s/step. On one
    device that is ``offload.mode=auto``'s own plan; on ``devices`` data-parallel devices
    (ZeRO-3, which ``auto`` hands to the streaming runtime unplanned) the same planner
    with the profile's device count and the model traced at one device's rows."""

    from hetjax.planning.auto import plan_auto
    from hetjax.planning.hardware import measure_local
    from hetjax.planning.search import make_plan
    from hetjax.planning.tracer import trace
    from hetjax.train import train

    overrides = {
        **overrides,
        "train.steps": str(steps),
        "train.eval_batches": "1",
        "checkpoint.every_steps": "0",
        "checkpoint.at_end": "false",
    }
    config = load_config(name, overrides)
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:
        if devices == 1:
            planned, plan = plan_auto(config, tmp, log=lambda line: None)
            assert plan is not None, "the budget should make auto stream"
        else:
            config = config.replace(distributed=dict(data_parallel=devices))
            hw = measure_local(str(Path(tmp) / "nvme"), config.model.compute_dtype)
            hw = dataclasses.replace(hw, num_devices=devices)
            plan = make_plan(config, hw, trace(config, devices=devices))
            memory = dict(device_budget=plan.budgets["device"], host_budget=plan.budgets["host"])
            planned = config.replace(**plan.config_overrides(), memory=memory)
        result = train(planned, tmp, verbose=False)
    measured = _steady_step_time(result.records, skip=2)
    # The plan predicts both cases of sync mode with clipping; which one the measured
    # steps were: clipping bound in all of them (early training) or in none.
    counts = [r.get("optimizer_deferred", 0) + r.get("optimizer_redo", 0) for r in result.records]
    bound = [b > a for a, b in zip([0, *counts], counts, strict=False)][2:]
    clipped = bool(bound) and all(bound)
    predicted = plan.step_clipped_s if clipped else plan.step_s
    o = planned.offload
    desc = f"{o.mode}, params {o.params}, optimizer {o.optimizer}, keep {o.keep_blocks}"
    if devices > 1:
        desc += f", {plan.candidate.resident_blocks} resident"
    if clipped:
        desc += ", clipped"
    return dict(
        config=name,
        devices=devices,
        plan=desc,
        predicted_s=predicted,
        predicted_unclipped_s=plan.step_s,
        clipping_bound=clipped,
        measured_s=measured,
        ratio=measured / predicted,
    )


def _plan_row_on_cpu_devices(devices: int, *args) -> dict:
    """:func:`_plan_row` in a child process with ``devices`` virtual CPU devices (the
    XLA flag must be set before JAX starts)."""
    import re
    import subprocess

    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        **MALLOC_ENV,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_PLATFORMS": "cpu",
        # the child imports this hetjax, wherever it was imported from
        "PYTHONPATH": os.pathsep.join(
            p
            for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))
            if p
        ),
    }
    spec = json.dumps([*args, devices])
    code = (
        "import json; from hetjax.bench import _plan_row; "
        f"print('PLAN', json.dumps(_plan_row(*json.loads({spec!r}))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLAN ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the {devices}-device plan row failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("PLAN ") :])


def bench_plan(quick: bool) -> dict:
    """The planner's predicted step time vs the measured one, on this machine, for the
    tiny and small GPTs under a device budget tight enough that ``offload.mode=auto``
    streams (the plan: tracer + measured machine; then the training run, one process),
    and for the tiny GPT data-parallel (ZeRO-3) over 2 virtual CPU devices with a
    per-device budget that leaves some blocks streamed (a child process)."""
    cases = {
        "tiny": ("gpt_tiny", {"memory.device_budget": "120MiB"}, 10, 1),
        "small": (
            "gpt_small",
            {"memory.device_budget": "1200MiB", "train.batch_size": "4", "train.seq_len": "128"},
            8,
            1,
        ),
        "tiny dp2": ("gpt_tiny", {"memory.device_budget": "88MiB"}, 10, 2),
    }
    if quick:
        cases = {
            "tiny": ("gpt_tiny", {"memory.device_budget": "120MiB"}, 4, 1),
        }  # the dp2 row alone: tests/test_bench.py (slow)
    results: dict = {}
    print(f"{'model':<10}{'plan':<58}{'predicted s':>12}{'measured s':>12}{'ratio':>8}")
    for label, (name, overrides, steps, devices) in cases.items():
        if devices == 1:
            row = _plan_row(name, overrides, steps)
        else:
            row = _plan_row_on_cpu_devices(devices, name, overrides, steps)
        results[label] = row
        print(
            f"{label:<10}{row['plan']:<58}{row['predicted_s']:>12.4f}{row['measured_s']:>12.4f}"
            f"{row['ratio']:>8.2f}"
        )
    return results


BENCHMARKS = {
    "overhead": bench_overhead,
    "slabs": bench_slabs,
    "nvme": bench_nvme,
    "io": bench_io,
    "optimizer": bench_optimizer,
    "lockfree": bench_lockfree,
    "scale": bench_scale,
    "gpu": bench_gpu,
    "zero": bench_zero,
    "plan": bench_plan,
    "keep": bench_keep,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="a reduced run (for tests)")
    parser.add_argument("--out", default=None, help="JSON output (default runs/bench/NAME.json)")
    parser.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="LAYERSxD",
        help="scale: start the offloaded sizes at this one (e.g. 72x1536)",
    )
    args = parser.parse_args(argv)
    tuned = tune_host_allocator()  # as a training run does
    print(
        f"hetjax bench {args.name}: {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}), jax {jax.__version__}, host allocator "
        f"{'keeps freed blocks' if tuned else 'not tuned (HETJAX_MALLOC or MALLOC_* set)'}"
    )
    if args.start and args.name != "scale":
        parser.error("--from applies to the scale benchmark only")
    extra = {"start": args.start} if args.start else {}
    result = BENCHMARKS[args.name](args.quick, **extra)
    result.update(
        name=args.name,
        quick=args.quick,
        platform=jax.devices()[0].platform,
        host_allocator_tuned=tuned,
        date=time.strftime("%Y-%m-%d"),
    )
    out = Path(args.out or f"runs/bench/{args.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
