"""``python -m hetjax.bench optimizer``: host optimizer params/s vs the memory-bandwidth
bound measured in the same run."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from hetjax.planning.hardware import measure_optimizer


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
            "s", *self.state, grad, (0.0, 0.0), in_place=self.mode in ("in place", "host"), **kwargs
        )
        jax.block_until_ready((slabs, pages))
        self.times.append(time.perf_counter() - t0)
        if self.spare is not None:  # the copy before last, as the loop recycles
            self.spare = self.state[0]
        self.state = (slabs, scalars)


def _optimizer_rows(quick: bool, label: str = "") -> dict:
    """The host optimizer's params/s against the memory-bandwidth bound: AdamW moves
    28 B/param (read param, grad, m, v: 16; write param, m, v: 12), so the bound is the
    machine's copy bandwidth (all cores, as the update runs) / 28. Measured refreshing
    bf16 params (the GPU compute dtype: 2 B/param more), for both kernels
    (``optimizer.host_kernel``) and both ways the loop writes the new state: into the
    copy before last (``spare``: state in RAM) and over a stage just read
    (``in place``), and for the native kernel also in place over host buffers outside
    XLA (``host``: what the NVMe tier runs, ``SlabOptimizer.update_host``) and into fresh
    buffers (what the loop avoids: each costs page faults on the first touch).

    This VM's memory bandwidth drifts by tens of percent within a minute, so each round
    times the copy and then every update, and a ratio is the median over rounds of the
    round's rate / the round's bound. The headline is the run's kernel on the NVMe
    tier's path (in place)."""
    from hetjax.storage.pages import aligned_concatenate

    n = (4 if quick else 32) << 20
    cores = os.cpu_count() or 1
    grad = aligned_concatenate([np.full(n, 1e-3, np.float32)])
    runs = _runs(n)
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
    kernel, rate, ratio = _print_rows(label, n, cores, bw, bw1, bound, rows, rate32)
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


def _runs(n: int) -> dict:
    """(kernel, how the new state is written) -> its timed run, each kernel that builds."""
    from hetjax.planning.hardware import slab_optimizer
    from hetjax.storage.states import flat

    runs = {}
    for kernel in ("auto", "optax"):
        opt = slab_optimizer(n, "bfloat16", page_elems=1 << 18, kernel=kernel)
        name = "native" if opt.native else "optax"
        if name in {k for k, _ in runs}:
            continue  # auto fell back to optax
        modes = ("spare", "in place")
        if opt.native:  # and over host buffers, the NVMe tier's pooled ones (update_host)
            modes = ("fresh", *modes, "host")
        for mode in modes:
            state = opt.init("s", np.ones(n, np.float32))
            if mode == "host":
                state = ({k: np.array(flat(v)) for k, v in state[0].items()}, state[1])
            spare = opt.init("s", np.ones(n, np.float32))[0] if mode == "spare" else None
            runs[name, mode] = _Run(opt, mode, state, spare)
    return runs


def _print_rows(label, n, cores, bw, bw1, bound, rows, rate32) -> tuple[str, float, float]:
    """The table; returns the headline's kernel, rate and rate / bound."""
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
    kernel, mode = ("native", "host") if ("native", "host") in rows else ("optax", "in place")
    rate, _, ratio = rows[kernel, mode]
    print(
        f"{pad}achieved / bound {ratio:.2f} ({kernel}, {mode}: the NVMe tier's update); "
        f"state in RAM {rows[kernel, 'spare'][2]:.2f}; fp32 params {rate32 / 1e6:.0f} M "
        f"params/s"
    )
    return kernel, rate, ratio


def bench_optimizer(quick: bool) -> dict:
    """Host optimizer params/s vs the memory-bandwidth bound measured in the same run
    (:func:`_optimizer_rows`)."""
    return _optimizer_rows(quick)
