"""gpucheck's sections that train: equivalence, memory (the working set), mfu."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetjax.gpucheck.common import (
    DETERMINISTIC_OPS,
    DEVICE_BUDGET_SLACK,
    MEMORY_BUDGET,
    MEMORY_RUN,
    MFU_RATIO,
    MFU_SHAPES,
    PROBE_SECONDS,
    PYTEST_WORKERS,
    ROOT,
    GiB,
    Report,
    Run,
    gpt_params,
    streamed_ram,
)
from hetjax.gpucheck.timing import PLUGIN

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)

BF16_EQUIVALENCE = "tests/test_stream.py::test_stream_equals_none_in_compute_dtype[bfloat16-nvme]"
EQUIVALENCE_K = "equal or two_client or pinned or fewer_bytes"  # the tests' -k


def equivalence_tests(quick: bool) -> list[str]:
    """The equivalence section's pytest arguments on an accelerator: the tests selected
    from these files by :data:`EQUIVALENCE_K` and not slow, in PYTEST_WORKERS
    processes; --quick, the two-client file and the bf16 streamed-vs-in-memory test
    (:data:`BF16_EQUIVALENCE`, the full selection's already)."""
    files = ["tests/test_two_client.py", "tests/test_stream.py", "tests/test_offload.py"]
    files.append("tests/test_expert_fetch.py")  # routed experts' copies, both ways
    files.append("tests/test_chunks.py")  # a micro-batch in chunks of rows
    files.append("tests/test_deferred_updates.py")  # experts' state left on disk
    files = [files[0], BF16_EQUIVALENCE] if quick else files
    workers = ["-n", str(PYTEST_WORKERS), "--dist", "load"]  # test by test
    return ["-m", "not slow", "-k", EQUIVALENCE_K, *workers, *files]


def equivalence(report: Report, run: Run) -> None:
    """The equivalence tests themselves (their criterion lives in ``tests/``;
    :func:`equivalence_tests`), then a bf16 run that must train. The tests run in a
    pytest child; this process starts no JAX until they are done, so the child has the
    device to itself."""
    from hetjax import xla_env

    if not (ROOT / "tests" / "test_two_client.py").is_file():
        report.check("tests", None, f"no tests/ beside the package ({ROOT}): run from a checkout")
    else:
        env = dict(os.environ)
        if run.emulate:
            env.update(JAX_PLATFORMS="cpu", HETJAX_HOST_CLIENT="separate")
        else:  # the accelerator first, the CPU client for the host optimizer
            env["JAX_PLATFORMS"] = f"{run.platform or 'cuda'},cpu"
            # Tiny models, dispatch- and compile-bound: PYTEST_WORKERS processes share
            # the GPU, each growing its pool on demand up to a share of the memory.
            env = xla_env.with_mem_fraction(0.8 / PYTEST_WORKERS, env)
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            # one compilation cache per worker (tests/conftest.py's): JAX writes its
            # entries without a lock
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            env = _deterministic(report, env)
        args = ["-m", "not slow", "-n0", "tests/test_two_client.py"]
        _pytest(report, "tests", args if run.emulate else equivalence_tests(run.quick), env)
    _bf16_trains(report, run.quick)


def _deterministic(report: Report, env: dict[str, str]) -> dict[str, str]:
    """``env`` with XLA's deterministic GPU ops (:data:`DETERMINISTIC_OPS`: scatter's
    atomics in the embedding's backward would make two equal runs differ in their last
    bits), where a child process shows that this jaxlib's XLA knows the flag (XLA aborts
    on a flag it does not know); else ``env``, the bit-exact tests comparing at their
    tolerance instead (``tests/equivalence.py``'s ``bit_exact_here``)."""
    flags = f"{env.get('XLA_FLAGS', '')} {DETERMINISTIC_OPS}".strip()
    trial = dict(env, XLA_FLAGS=flags)
    code = "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=trial, capture_output=True, text=True,
            timeout=PROBE_SECONDS,
        )  # fmt: skip
        tail = proc.stderr.strip().splitlines()
        why = f"exit {proc.returncode}: {tail[-1] if tail else ''}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        why = f"no answer within {PROBE_SECONDS} s"
    report.check(
        "deterministic_ops",
        None if why else True,
        f"{DETERMINISTIC_OPS}: " + (why or "accepted; the tests run with it"),
    )
    return env if why else trial


def _pytest(report: Report, check: str, args: list[str], env: dict[str, str]) -> None:
    """Runs pytest on ``args`` in a child (its compiles counted: ``timing.py``); one
    check line."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGIN, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = tail[-1] if tail else "no output"
    named = " ".join(a for a in args if a.startswith("tests/"))
    report.check(
        check,
        proc.returncode == 0,
        f"{named}: {summary} ({time.perf_counter() - t0:.0f} s)",
        output_tail="\n".join(tail[-40:]),
    )


def _bf16_trains(report: Report, quick: bool) -> None:
    import numpy as np

    from hetjax.config import Config
    from hetjax.train import train

    config = Config().replace(
        model=dict(num_layers=2, d_model=64, num_heads=4, compute_dtype="bfloat16"),
        train=dict(steps=40, batch_size=8, seq_len=32, eval_batches=0, log_every=1000),
        offload=dict(mode="stream", optimizer="host"),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=300_000),
    )
    with tempfile.TemporaryDirectory() as tmp:
        losses = train(config, tmp, verbose=False).losses
    first, last = float(losses[0]), float(np.mean(losses[-5:]))
    report.check(
        "bf16_streaming_trains",
        bool(np.all(np.isfinite(losses))) and last < 0.8 * first,
        f"bf16 compute, streamed: loss {first:.3f} -> {last:.3f} over {len(losses)} steps "
        "(must fall below 0.8x)",
        losses=[float(x) for x in losses],
    )


def chosen_mode(workdir) -> str:
    """The offload mode a run used (``auto`` resolved), from its ``config.json``."""
    return json.loads((Path(workdir) / "config.json").read_text())["offload"]["mode"]


def memory(report: Report, run: Run) -> None:
    """A streamed run under a device budget its blocks' params alone exceed
    (:data:`MEMORY_RUN` under :data:`MEMORY_BUDGET`): XLA's peak against the budget.
    Peak within the budget with more params than it holds: the blocks were streamed.
    Streaming is forced (``auto`` could choose ``none`` and test nothing of it, and would
    measure the machine first, its probes' buffers in the peak); the peak before
    training is read and must be below the budget, so the peak after is the run's. Then
    the working set (:func:`working_set`); --quick: 2 steps, the working set at half
    the width and sequence."""
    import jax

    from hetjax.config import Config
    from hetjax.config_values import format_bytes
    from hetjax.train import train
    from models import attention

    device = jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        report.check("device_budget", None, f"{device.platform}: no memory_stats()")
        return
    m, budget = MEMORY_RUN, MEMORY_BUDGET
    config = Config().replace(
        model=dict(
            num_layers=m["layers"], d_model=m["d"], num_heads=m["heads"],
            vocab_size=m["vocab"], max_seq_len=m["seq"], compute_dtype="bfloat16",
        ),
        train=dict(
            steps=2 if run.quick else 3, batch_size=m["batch"], seq_len=m["seq"],
            eval_batches=0, log_every=1000,
        ),
        offload=dict(mode="stream"),
        memory=dict(device_budget=budget),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=2_000_000),
    )  # fmt: skip
    blocks = 2 * (gpt_params(m["layers"], m["d"], 0))  # the blocks' bf16 params, bytes
    before = device.memory_stats()["peak_bytes_in_use"]
    with tempfile.TemporaryDirectory() as tmp:
        result = train(config, tmp, verbose=False)
        mode = chosen_mode(tmp)
    peak = device.memory_stats()["peak_bytes_in_use"]
    ledger = max(r.get("device_bytes_peak", 0) for r in result.records)
    streamed = mode == "stream" and blocks > budget and peak <= DEVICE_BUDGET_SLACK * budget
    report.check(
        "device_budget",
        before < budget and before <= peak and streamed,
        f"{mode}, {m['layers']} blocks d {m['d']} ({format_bytes(blocks)} of bf16 params, "
        f"more than the budget: streamed), attention {attention.chosen(config.model)}: XLA "
        f"peak {format_bytes(peak)} ({format_bytes(before)} before training) vs budget "
        f"{format_bytes(budget)} (ceiling {DEVICE_BUDGET_SLACK:g}x), ledger peak "
        f"{format_bytes(ledger)}",
        peak=peak,
        peak_before=before,
        ledger=ledger,
        budget=budget,
        block_bytes=blocks,
    )
    shape = dict(d_model=1024, seq=512) if run.quick else {}
    working_set(report, jax.default_backend(), **shape)


# The planner's working-set estimate over XLA's compiled one (``working_set``): fitted on
# XLA:CPU in fp32 and scaled to bf16 for a GPU, never fitted on a GPU. A first GPU run
# reports the ratio; outside this band the planner's plans would not fit (below) or would
# waste a third or more of the device (above): refit the band and the estimate on the
# first run's figures (docs/guide/gpu.md).
WORKING_SET_BAND = (0.75, 1.5)


def working_set(
    report: Report, backend: str, d_model: int = 2048, batch: int = 8, seq: int = 1024
) -> None:
    """The planner's estimated working set (``Workload.from_config`` for ``backend``)
    against the one XLA compiles here (``StageFunctions.memory_sizes``), for a GPT at a
    shape where the blocks' activations dominate (by default d 2048, 8 x 1024 tokens),
    bf16, whole and in 4 chunks of rows. A check per chunk count: the ratio, failing
    outside :data:`WORKING_SET_BAND`."""
    import jax.numpy as jnp

    from hetjax.config import load_config
    from hetjax.config_values import format_bytes
    from hetjax.parallel.layouts import stage_layouts
    from hetjax.parallel.single import SingleDevice
    from hetjax.planning.workload import Workload
    from hetjax.runtime.stages import functions as stages
    from models import build_model

    low, high = WORKING_SET_BAND
    for n in (1, 4):
        config = load_config("gpt_tiny", {
            "model.num_layers": "2", "model.d_model": str(d_model), "model.num_heads": "16",
            "model.vocab_size": "8192", "model.max_seq_len": str(seq),
            "model.compute_dtype": "bfloat16", "train.seq_len": str(seq),
            "train.batch_size": str(batch), "offload.mode": "stream",
            "offload.batch_chunks": str(n),
        })  # fmt: skip
        model = build_model(config.model)
        layouts = stage_layouts(model, config.memory.page_size, leaf_buffers=True)
        fns = stages.StageFunctions(
            model, layouts, SingleDevice(),
            block_grad_dtype=jnp.bfloat16, batch_chunks=n,
        )  # fmt: skip
        compiled = fns.memory_sizes(batch, seq, jnp.bfloat16).working_set
        estimate = Workload.from_config(config, backend=backend).working_set
        ratio = estimate / max(compiled, 1)
        report.check(
            f"working_set_{n}_chunks",
            low <= ratio <= high,
            f"GPT d {d_model}, {batch} x {seq} tokens, bf16, {n} chunk(s): estimated "
            f"{format_bytes(estimate)}, compiled {format_bytes(compiled)}: {ratio:.2f}x "
            f"(band {low:g}x-{high:g}x)",
            estimate=estimate,
            compiled=compiled,
            ratio=ratio,
            chunks=n,
        )


# The floor's overlap: in sync mode (the default) the host optimizer updates each stage
# as its gradient arrives, under the backward that goes on, but the next step's forward
# waits for the update of the stages it reads first (the last gradients out), so the
# optimizer's work hides under the backward only, never under the forward: an offloaded
# step lasts at least the forward plus the longer of the backward and the optimizer's
# work. The forward is FORWARD_SHARE of an in-HBM step (2 of the 6 FLOPs per parameter
# and token; with recompute more of the step is backward, so the floor is generous).
FORWARD_SHARE = 1 / 3


def mfu_floor(in_hbm_s: float, optimizer_s: float) -> float:
    """The floor of offloaded / in-HBM TFLOP/s at the same tokens per step: MFU_RATIO
    times the in-HBM step over the shortest offloaded step the overlap above allows,
    ``forward + max(backward, optimizer_s)`` of the in-HBM step's forward and backward
    (``optimizer_s``: the host optimizer's busy time per step, measured in the offloaded
    run): MFU_RATIO while the optimizer fits under the backward."""
    forward = FORWARD_SHARE * in_hbm_s
    shortest = forward + max(in_hbm_s - forward, optimizer_s)
    return MFU_RATIO * in_hbm_s / shortest if in_hbm_s > 0 else MFU_RATIO


# Both rows without gradient clipping: with it, the host optimizer redoes the steps
# whose global norm binds (every early step of a fresh model), twice the work.
MFU_ROWS = {"in_hbm": dict(mode="none"), "offloaded": dict(mode="stream", optimizer="host")}
ROW_PREFIX = "gpucheck-row: "  # the line a row's child prints its figures on


def _mfu_shape(quick: bool) -> dict[str, int]:
    return MFU_SHAPES[quick]


def _beyond_pool(s: dict[str, int], pool: int) -> dict[str, int]:
    """The row beyond the pool: its layers (its fp32 state 1.5x ``pool``), that state's
    bytes and the free RAM it needs (its state in host RAM)."""
    per_layer = 12 * s["d"] ** 2 * 16  # bytes of fp32 state (master, Adam, grads)
    layers = max(s["layers"] + 1, int(1.5 * pool / per_layer))
    ram = streamed_ram(gpt_params(layers, s["d"]))
    return dict(layers=layers, state_bytes=layers * per_layer, ram=ram)


def mfu_row(row: str, run: Run) -> dict[str, Any]:
    """One row of the mfu section, in its own process: ``in_hbm``, ``offloaded`` or
    ``beyond_pool`` (a model whose fp32 state is 1.5x this process's pool: the device
    memory fraction its parent gave it). Returns its median figures past the warm-up,
    or ``{"skip": why}`` (no pool reported; too little free RAM for the row)."""
    import jax
    import numpy as np

    from hetjax import xla_env
    from hetjax.config import Config
    from hetjax.planning.hardware import _mem_available
    from hetjax.train import train
    from models import attention

    s = _mfu_shape(run.quick)
    config = Config().replace(
        model=dict(
            d_model=s["d"], num_heads=s["heads"], max_seq_len=s["seq"], compute_dtype="bfloat16"
        ),
        train=dict(
            steps=s["steps"], batch_size=s["batch"], seq_len=s["seq"], eval_batches=0,
            log_every=1000,
        ),
        optimizer=dict(grad_clip=0.0),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=4_000_000),
    )  # fmt: skip
    figures: dict[str, Any] = {}
    if row == "beyond_pool":
        pool = int((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))
        if not pool:
            return {"skip": "no bytes_limit: the pool is unknown"}
        beyond, free = _beyond_pool(s, pool), _mem_available()
        if free < beyond["ram"]:
            return {
                "skip": f"skipped for memory: {beyond['layers']} layers' state in host RAM "
                f"needs {beyond['ram'] / GiB:.0f} GiB free, {free / GiB:.0f} GiB free"
            }
        fraction = xla_env.mem_fraction() or config.memory.device_fraction
        config = config.replace(
            model=dict(num_layers=beyond["layers"]), memory=dict(device_fraction=fraction)
        )
        figures = dict(layers=beyond["layers"], pool_bytes=pool, state_bytes=beyond["state_bytes"])
    else:
        config = config.replace(model=dict(num_layers=s["layers"]), offload=MFU_ROWS[row])
        if row == "offloaded":
            config = config.replace(train=dict(trace_every=s["steps"] - 1))
    with tempfile.TemporaryDirectory() as tmp:
        result = train(config, tmp, verbose=False)
        figures["mode"] = chosen_mode(tmp)
        t = json.loads((Path(tmp) / "config.json").read_text())["train"]
        figures["tokens_per_step"] = t["batch_size"] * t["seq_len"] * t["grad_accum"]
        pngs = sorted(Path(tmp).rglob("step_*.png"))
        if pngs:
            keep = run.out / f"timeline_{row}.png"
            shutil.copy(pngs[-1], keep)
            figures["timeline"] = str(keep)
    figures["attention"] = attention.chosen(config.model)
    timed = result.records[s["skip"] :]
    for key, name in [("step_time_s", "s_per_step"), ("mfu", "mfu"), ("tflops", "tflops")]:
        figures[name] = float(np.median([r.get(key, 0.0) for r in timed]))
    figures["optimizer_busy_s"] = float(np.median([r.get("optimizer_busy_s", 0.0) for r in timed]))
    return figures


def _mfu_child(row: str, run: Run, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs :func:`mfu_row` in a child process; its figures, or ``{"error": why}``."""
    cmd = [sys.executable, "-m", "hetjax.gpucheck", "--section", "mfu", "--row", row]
    cmd += ["--out", str(run.out)] + ["--quick"] * run.quick
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROW_PREFIX)]
    if proc.returncode or not rows:
        return {"error": f"the {row} row failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"}
    return json.loads(rows[-1].removeprefix(ROW_PREFIX))


def mfu(report: Report, run: Run) -> None:
    """Offloaded vs in-HBM MFU at one shape, and a model beyond the pool, each row in a
    child process of its own: this one never starts JAX, so each row has the device's
    whole pool, or, beyond the pool, a quarter of it (a sixteenth with --quick), its
    state (in host RAM: no NVMe files on a small disk) 1.5x what that pool holds."""
    from hetjax import xla_env

    got = {row: _mfu_child(row, run) for row in MFU_ROWS}
    failed = [r["error"] for r in got.values() if "error" in r]
    if failed:
        report.check("offloaded_vs_in_hbm", False, "; ".join(failed))
    else:
        _offloaded_vs_in_hbm(report, got, _mfu_shape(run.quick))
    fraction = (xla_env.mem_fraction() or 0.9) / (16 if run.quick else 4)
    out = _mfu_child("beyond_pool", run, xla_env.with_mem_fraction(fraction))
    if "error" in out or "skip" in out:
        report.check(
            "beyond_pool", None if "skip" in out else False, out.get("skip", out.get("error"))
        )
        return
    report.check(
        "beyond_pool",
        out["mode"] != "none" and out["tflops"] > 0,
        f"{out['layers']} layers, {out['state_bytes'] / GiB:.0f} GiB of state over a "
        f"{out['pool_bytes'] / GiB:.1f} GiB pool ({xla_env.MEM_FRACTION}={fraction:g}): "
        f"{out['mode']} at {out['tflops']:.1f} TFLOP/s, {out['tokens_per_step']} tokens a "
        f"step, attention {out['attention']}",
        **out,
    )


def _offloaded_vs_in_hbm(report: Report, got: dict[str, dict], shape: dict[str, int]) -> None:
    """The two rows' check: like with like (the same tokens per step), the ratio of
    their TFLOP/s against :func:`mfu_floor`."""
    hbm, off = got["in_hbm"], got["offloaded"]
    ratio = off["tflops"] / hbm["tflops"]
    floor = mfu_floor(hbm["s_per_step"], off["optimizer_busy_s"])
    same = hbm["tokens_per_step"] == off["tokens_per_step"]
    tokens = (
        f"{hbm['tokens_per_step']} tokens a step each"
        if same
        else f"NOT like with like: {hbm['tokens_per_step']} vs {off['tokens_per_step']} tokens"
    )
    report.check(
        "offloaded_vs_in_hbm",
        same and ratio >= floor,
        f"{shape['layers']} layers d {shape['d']}, {tokens}, no clipping, attention "
        f"{off['attention']}: in HBM {hbm['tflops']:.1f} TFLOP/s (MFU {hbm['mfu']:.3f}, "
        f"{hbm['s_per_step']:.3f} s/step), offloaded {off['tflops']:.1f} "
        f"({off['s_per_step']:.3f} s/step, host optimizer busy "
        f"{off['optimizer_busy_s']:.3f} s): {ratio:.2f}x (floor {floor:.2f}x: "
        f"{MFU_RATIO:g}x, the optimizer hidden under the backward only: sync mode's "
        f"forward waits for it); timeline {off.get('timeline', 'none')}",
        ratio=ratio,
        floor=floor,
        **{f"{k}_{f}": v for k, r in got.items() for f, v in r.items()},
    )
