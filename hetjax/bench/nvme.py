"""``python -m hetjax.bench nvme``: the NVMe tier and host optimizer against their limits
in one run, and the DeepSpeed ZeRO-3 NVMe peer shape's s/step."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from hetjax.bench.common import PEER_BATCH, PEER_S_PER_STEP, PEER_SHAPE, _scratch_dir
from hetjax.bench.io import _disk_rows
from hetjax.bench.optimizer import _optimizer_rows
from hetjax.config import Config
from hetjax.memory import IO_READAHEAD
from hetjax.planning.hardware import drop_page_cache


def _step_parts(runtime, batch) -> dict:
    """Forward+backward alone, the optimizer alone (state in RAM) and the step's NVMe
    I/O alone (read every stage's state and params, write them back), each timed
    separately. The I/O is timed twice: as the step meets it (``io_s``: the files as
    the last step left them, so recent writes may still be in the page cache) and cold
    (``io_cold_s``: synced and dropped from the page cache first, every read from the
    disk); writes complete into the page cache in both, as in the step (no fsync)."""

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
        if nvme_params:
            for n in names:
                params.prefetch(n)
        for i, n in enumerate(names):  # as the loop: read ahead into the pooled buffers
            for ahead in names[i : i + 1 + IO_READAHEAD]:
                states.prefetch(ahead)
            states.put(n, *states.get(n))
            if nvme_params:  # read as the device takes it; written as a new slab's pages
                layout = runtime.layouts[runtime.layout_name(n)]
                slab = layout.flatten_np(
                    layout.unflatten_pages(params.get(n)), runtime.compute_dtype
                )
                params.publish(n, list(slab.reshape(-1, layout.page_elems)))
        states.abort()  # waits for the writes (into the uncommitted copy)
        if nvme_params:
            params.abort()
        return time.perf_counter() - t0

    warm = io()
    os.sync()
    drop_page_cache(runtime.nvme_dir)
    cold = io()

    # As the loop updates a stage read from NVMe: in place, in host buffers
    held = {n: states.committed(n) for n in names}
    t0 = time.perf_counter()
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
