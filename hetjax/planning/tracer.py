"""The tracer: measures the model's stage functions on this machine (time and XLA's
memory sizes) for the planner."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import SWAP_LEVELS, Config
from hetjax.memory import block_grad_dtype
from hetjax.parallel.single import Shardings, SingleDevice
from hetjax.planning.workload import Workload, kept_key
from hetjax.runtime.stages.functions import StageFunctions
from models import build_model


def trace(
    config: Config,
    repeats: int = 5,
    devices: int = 1,
    expert_fraction: float | None = None,
    tensor: int = 1,
) -> Workload:
    """The model measured on this machine (:func:`trace_splits` at one degree)."""
    return trace_splits(config, repeats, devices, expert_fraction, (tensor,))[tensor]


def trace_splits(
    config: Config,
    repeats: int = 5,
    devices: int = 1,
    expert_fraction: float | None = None,
    tensors: tuple[int, ...] = (1,),
) -> dict[int, Workload]:
    """Measures the model on this machine: each stage function's time for one
    micro-batch (compiled and run on random params and tokens, median of ``repeats``) and
    XLA's memory sizes. Allocates one block's, the embedding's and the head's params.
    ``devices``: data-parallel devices sharing the batch; each runs its rows of the
    micro-batch, so that is what is timed and sized (on one device).
    ``expert_fraction``: as :meth:`Workload.from_config`'s. One workload per degree of
    ``tensors`` (``tensor`` of :meth:`Workload.from_config`), from one measurement:
    under tensor parallelism a device's rows with the whole block are what a model
    group's device computes (its data group's rows, 1/tensor of the heads and MLP
    units)."""
    m, t = config.model, config.train
    model = build_model(m)
    dtype = jnp.dtype(m.compute_dtype)
    layouts = SingleDevice().stage_layouts(model, config.memory.page_size)  # as it runs
    dev = Shardings.single_device().device
    fns = StageFunctions(
        model,
        layouts,
        SingleDevice(),
        batch_chunks=config.offload.batch_chunks,
    )
    rows = max(1, t.micro_batch_size // devices)  # one device's rows of a micro-batch
    sizes = fns.memory_sizes(rows, t.seq_len, dtype)
    rng = np.random.default_rng(0)

    def slab(name):  # a stage's params as the device takes them
        L = layouts[name]
        flat = rng.normal(0, 0.02, L.padded_size).astype(dtype)
        return jax.device_put(L.leaf_views(flat), dev)

    e, h = slab("embed"), slab("head")
    tokens = jax.device_put(rng.integers(0, m.vocab_size, (rows, t.seq_len)).astype(np.int32), dev)
    one = jnp.asarray(1.0, jnp.float32)

    best = lambda fn: _median_s(fn, repeats)

    # Each stage group's input and blocks (a model of several, T5's encoder and decoder:
    # a block's times are the mean over every block, the inputs' add to the embed's).
    L = sum(g.num_layers for g in model.groups)
    measured = dict.fromkeys(("embed_fwd", "block_fwd", "block_bwd", "embed_bwd"), 0.0)
    measured |= {kept_key(level): 0.0 for level in sizes.kept}

    def time_group(group, prev, share: float):
        """Adds group's input and (its share of) block times; returns its output."""
        b = slab(group.group.name)
        x, c = group.input_fwd(e, prev, tokens, tokens)
        dc = group.zero_context(c) if jax.tree.leaves(c) else ()
        measured["embed_fwd"] += best(lambda: group.input_fwd(e, prev, tokens, tokens))
        measured["block_fwd"] += share * best(lambda: group.block_fwd(b, x, c))
        measured["block_bwd"] += share * best(lambda: group.block_bwd(b, x, x, None, c, dc))
        measured["embed_bwd"] += best(lambda: group.input_bwd(e, prev, tokens, tokens, x, dc))
        for level in sizes.kept:  # a kept block's backward from each level's residuals
            vjp = group.kept_forward(level)(b, x, c)[1]
            run = lambda vjp=vjp: group.block_bwd_kept(vjp, x, None, dc)
            measured[kept_key(level)] += share * best(run)
            del vjp
        return x

    x = None
    for group in fns.groups:
        x = time_group(group, x, group.group.num_layers / L)
    measured["head"] = best(lambda: fns.head_fwd_bwd(h, e, x, tokens, one))
    workloads = {}
    for t in tensors:
        w = Workload.from_config(config, sizes, devices, expert_fraction=expert_fraction, tensor=t)
        workloads[t] = dataclasses.replace(
            w, measured=measured, **measure_on_mesh(config, devices, t, w.kept)
        )
    return workloads


def _median_s(fn, repeats: int) -> float:
    """``fn``'s median time over ``repeats`` runs after one to warm up (its compile)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t1 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t1)
    return float(np.median(times))


def measure_on_mesh(config: Config, devices: int, tensor: int, levels) -> dict:
    """Where a block's compute needs the mesh (``tensor`` > 1, or the config's
    ``distributed.expert_parallel``), what XLA's layout over it decides, measured as the
    runtime measures it at start-up, with its stage functions on a mesh of this
    process's first ``devices`` devices (compiled, not run): the working set (the
    largest stage function's temporaries, its collectives' included:
    ``StageFunctions.memory_sizes``), the contexts, and what one kept block's vjp and
    one swapped block's residuals hold on a device at each of ``levels``
    (``StageFunctions.held_bytes``). As :class:`Workload` fields; empty where no mesh
    is needed, or this process has fewer devices (then estimated from the one
    device's measurement)."""
    # (imported here: the runtime's ZeRO-3 placement is needed by this measurement only)
    from hetjax.parallel.zero import Zero3

    G = config.distributed.expert_parallel
    if (tensor == 1 and G == 1) or jax.device_count() < devices or jax.process_count() > 1:
        return {}
    dist = dict(data_parallel=devices // (tensor * G), tensor_parallel=tensor, expert_parallel=G)
    run = config.replace(distributed=dist)
    parallel = Zero3(run)
    layouts = parallel.stage_layouts(build_model(run.model), config.memory.page_size)
    compute_model = build_model(run.model, parallel.expert_axis)
    fns = StageFunctions(
        compute_model, layouts, parallel, block_grad_dtype=block_grad_dtype(run),
        kept_blocks=False, batch_chunks=run.offload.batch_chunks,
    )  # fmt: skip
    t, dtype = run.train, jnp.dtype(run.model.compute_dtype)
    batch = (t.micro_batch_size, t.seq_len, dtype)
    sizes = fns.memory_sizes(*batch)
    swappable = len(fns.groups) == 1  # (swapped blocks: one stage group's, streaming.py)
    return dict(
        working_set=sizes.working_set,
        context=sizes.context,
        held_kept={level: fns.held_bytes("kept", level, *batch) for level in levels},
        held_swapped={
            level: fns.held_bytes("swapped", level, *batch)
            for level in levels
            if level in SWAP_LEVELS and swappable
        },
    )
