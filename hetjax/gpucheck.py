"""``python -m hetjax.gpucheck [--quick] [--out DIR] [--emulate]``: the first thing to run
on a GPU machine (issue #19). One command, whole within 10 minutes on an H100 with 128 GB
of RAM and a 64 GB disk, that says whether hetjax's data path works there and how fast.

It sets the XLA variables first (``xla_env.py``), then runs each section in a child
process under a time box (a section that hangs or runs out of memory is a FAIL, not a
stuck command), checking free RAM and disk before each. Every check prints one line,
``PASS``/``FAIL``/``SKIP`` with its figures, and is appended to ``DIR/gpucheck.jsonl``
as it goes. The command exits 0 only when nothing failed.

Sections:

* ``environment``: versions, the device, its memory kinds and ``bytes_limit``, the
  native Adam kernel's build.
* ``placement``: round trips device <-> ``pinned_host`` and device <-> the CPU client.
* ``bandwidth``: host -> device and back, as pages vs one slab, both directions at
  once, from pageable vs pinned memory, and across JAX clients (the host optimizer's
  refreshed params going to the device's ``pinned_host``).
* ``overlap``: a matmul chain alone vs with copies both ways under it.
* ``equivalence``: the two-client and streaming equivalence tests (``tests/``, 1e-5,
  ``precision=highest``) and a bf16 training sanity run.
* ``memory``: ``memory.device_budget`` vs the device's ``peak_bytes_in_use`` vs the
  runtime's ledger; the planner's working-set estimate for a GPU in bf16 (the fp32
  XLA:CPU fit scaled, never measured on a GPU before) vs the compiled stage functions',
  whole and in chunks of rows (``offload.batch_chunks``): the figures to refit it by.
* ``mfu``: offloaded vs in-HBM MFU at a shape that fits the pool, and a model beyond
  the pool under a reduced ``memory.device_fraction``, with a timeline PNG (what
  ``bench gpu`` measured, sized for this machine: no NVMe files, state in host RAM).

``--emulate`` (a CPU-only machine): the equivalence section through the two-client
emulation of the GPU topology (``HETJAX_HOST_CLIENT=separate``); the other sections need
a GPU and are not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)
from hetjax.planning.hardware import _best_time, _mem_available

ROOT = Path(__file__).resolve().parent.parent  # a source checkout: tests/ beside hetjax/
GiB = 1 << 30

# Floors a healthy GPU machine clears by a wide margin. PCIe 4.0 x16 moves ~25 GB/s and
# 5.0 ~50 GB/s each way from pinned memory; below MIN_PINNED_GBS the pinned path is not
# DMA (or the link is degraded). Pages move within PAGES_VS_SLAB of one slab's speed when
# per-copy overheads are small at the streaming runtime's page size.
MIN_PINNED_GBS = 8.0
PAGES_VS_SLAB = 0.8
DUPLEX_GAIN = 1.2  # both directions at once move this much more than one alone
OVERLAP_SLOWDOWN = 1.3  # compute under copies both ways, at most this much slower
DEVICE_BUDGET_SLACK = 1.10  # XLA's peak vs the budget: its scratch and fragmentation


@dataclasses.dataclass
class Section:
    name: str
    seconds: int  # the time box (full run)
    ram: int  # free RAM needed to start it
    disk: int  # free disk under --out needed to start it
    gpu_only: bool = True


SECTIONS = [
    Section("environment", 120, 1 * GiB, 0),
    Section("placement", 60, 2 * GiB, 0),
    Section("bandwidth", 90, 12 * GiB, 0),
    Section("overlap", 60, 8 * GiB, 0),
    Section("equivalence", 240, 8 * GiB, 2 * GiB, gpu_only=False),
    Section("memory", 60, 8 * GiB, 1 * GiB),
    Section("mfu", 240, 80 * GiB, 2 * GiB),
]


# -- reporting -----------------------------------------------------------------------------


class Report:
    """Prints a check's line and appends it to ``gpucheck.jsonl``."""

    def __init__(self, out: Path, section: str):
        self.path = out / "gpucheck.jsonl"
        self.section = section

    def check(self, name: str, ok: bool | None, line: str, **figures: Any) -> bool:
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{status}  {self.section}.{name}: {line}", flush=True)
        row = {"section": self.section, "check": name, "status": status, "line": line}
        with open(self.path, "a") as f:
            f.write(json.dumps({**row, **figures}, default=str) + "\n")
        return ok is not False


def _gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- sections (each runs in its own child process) ---------------------------------------


def environment(report: Report, quick: bool, emulate: bool) -> None:
    from importlib.metadata import version

    import jax

    from hetjax import xla_env
    from hetjax.optimizer import native

    packages = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore")
    versions = {name: version(name) for name in packages}
    report.check("versions", True, " ".join(f"{k} {v}" for k, v in versions.items()), **versions)
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    report.check(
        "device",
        accelerator,
        f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s)",
        platform=device.platform,
        kind=device.device_kind,
    )
    kinds = sorted(m.kind for m in device.addressable_memories())
    report.check("memory_kinds", {"device", "pinned_host"} <= set(kinds), ", ".join(kinds))
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    report.check(
        "bytes_limit",
        limit > 0 if accelerator else None,
        f"{limit / GiB:.1f} GiB allocatable ({xla_env.MEM_FRACTION}="
        f"{os.environ.get(xla_env.MEM_FRACTION, 'unset')}, pinned limit "
        f"{xla_env.pinned_limit() / GiB:.0f} GiB)",
        bytes_limit=limit,
    )
    try:
        lib = native.load()
        report.check("native_kernel", True, f"built: {lib._name}")
    except native.NativeKernelError as e:
        report.check("native_kernel", False, f"{e} (optax runs instead, slower)")


def placement(report: Report, quick: bool, emulate: bool) -> None:
    import jax
    import numpy as np

    from hetjax.runtime.placement import Shardings

    place = Shardings.single_device()
    x = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)
    for dtype in ("float32", "bfloat16"):
        a = x.astype(dtype)
        on_device = jax.device_put(a, place.device)
        hops = {
            "pinned_host": jax.device_put(jax.device_put(on_device, place.host), place.device),
            "host optimizer": jax.device_put(
                jax.device_put(on_device, place.optimizer), place.device
            ),
        }
        for via, back in hops.items():
            same = np.array_equal(np.asarray(back), a)
            report.check(
                f"round_trip_{dtype}_{via.replace(' ', '_')}",
                same,
                f"device -> {via} -> device, {a.nbytes >> 20} MiB {dtype}: "
                + ("bit-exact" if same else "values differ"),
            )


def bandwidth(report: Report, quick: bool, emulate: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.runtime.placement import Shardings

    place = Shardings.single_device()
    nbytes = (256 << 20) if quick else (2 << 30)
    page = 16 << 20
    n = nbytes // 4
    slab = np.ones(n, np.float32)
    pages = [np.ones(page // 4, np.float32) for _ in range(nbytes // page)]
    put = lambda a, s: jax.block_until_ready(jax.device_put(a, s))
    pinned_slab, pinned_pages = put(slab, place.host), put(pages, place.host)
    dev_slab, dev_pages = put(slab, place.device), put(pages, place.device)
    on_cpu_client = put(slab, place.optimizer)
    rate = {
        "h2d_slab": _gbs(nbytes, _best_time(lambda: put(pinned_slab, place.device))),
        "h2d_pages": _gbs(nbytes, _best_time(lambda: put(pinned_pages, place.device))),
        "d2h_slab": _gbs(nbytes, _best_time(lambda: put(dev_slab, place.host))),
        "d2h_pages": _gbs(nbytes, _best_time(lambda: put(dev_pages, place.host))),
        "h2d_pageable": _gbs(nbytes, _best_time(lambda: put(slab, place.device))),
        # a fresh array each time: an array caches its numpy value (the device-side copy
        # is ~1% of the transfer at HBM speed)
        "d2h_pageable": _gbs(nbytes, _best_time(lambda: np.asarray(jnp.copy(dev_slab)))),
    }

    def both():
        up = jax.device_put(pinned_slab, place.device)
        down = jax.device_put(dev_slab, place.host)
        jax.block_until_ready((up, down))

    rate["duplex"] = _gbs(2 * nbytes, _best_time(both))
    # The host optimizer's refreshed params -> the device's pinned_host memory: straight
    # across JAX clients (XLA goes through a Literal) vs through a numpy view.
    rate["publish_cross_client"] = _gbs(nbytes, _best_time(lambda: put(on_cpu_client, place.host)))
    rate["publish_via_numpy"] = _gbs(
        nbytes, _best_time(lambda: put(np.asarray(on_cpu_client), place.host))
    )
    size = f"{nbytes >> 20} MiB"
    for way in ("h2d", "d2h"):
        r = rate[f"{way}_slab"]
        report.check(
            f"{way}_pinned",
            r >= MIN_PINNED_GBS,
            f"{r:.1f} GB/s from a pinned {size} slab (floor {MIN_PINNED_GBS:g})",
            gbs=r,
        )
        ratio = rate[f"{way}_pages"] / r
        report.check(
            f"{way}_pages",
            ratio >= PAGES_VS_SLAB,
            f"{rate[f'{way}_pages']:.1f} GB/s as {page >> 20} MiB pages, {ratio:.2f}x the slab "
            f"(floor {PAGES_VS_SLAB:g})",
            gbs=rate[f"{way}_pages"],
        )
        pageable = rate[f"{way}_pageable"]
        report.check(
            f"{way}_pageable",
            r >= pageable,
            f"pageable {pageable:.1f} GB/s vs pinned {r:.1f}: pinned must not be slower",
            gbs=pageable,
        )
    single = max(rate["h2d_slab"], rate["d2h_slab"])
    report.check(
        "duplex",
        rate["duplex"] >= DUPLEX_GAIN * single,
        f"{rate['duplex']:.1f} GB/s both ways at once, {rate['duplex'] / single:.2f}x one way "
        f"(floor {DUPLEX_GAIN:g}x)",
        gbs=rate["duplex"],
    )
    cross, numpy_path = rate["publish_cross_client"], rate["publish_via_numpy"]
    report.check(
        "publish",
        cross >= 0.5 * numpy_path,
        f"host optimizer -> pinned_host across clients {cross:.1f} GB/s vs through numpy "
        f"{numpy_path:.1f} GB/s",
        cross_client_gbs=cross,
        numpy_gbs=numpy_path,
    )


def overlap(report: Report, quick: bool, emulate: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.runtime.placement import Shardings

    place = Shardings.single_device()
    n, depth = (4096, 16) if not quick else (2048, 16)
    if jax.devices()[0].platform == "cpu":  # the code path only: a CPU has no copy engines
        n, depth = 256, 4
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16) * 0.01, place.device)

    @jax.jit
    def chain(x):
        for _ in range(depth):
            x = jnp.tanh(x @ x)
        return x

    nbytes = (512 << 20) if quick else (2 << 30)
    nbytes = min(nbytes, 64 << 20) if n == 256 else nbytes
    host = jax.device_put(np.ones(nbytes // 4, np.float32), place.host)
    dev = jax.device_put(np.ones(nbytes // 4, np.float32), place.device)
    repeats = 8
    alone = _best_time(lambda: jax.block_until_ready([chain(a) for _ in range(repeats)]))

    def with_copies():
        copies = [jax.device_put(host, place.device), jax.device_put(dev, place.host)]
        out = [chain(a) for _ in range(repeats)]
        jax.block_until_ready(out)
        return copies

    def copies_only():
        jax.block_until_ready([jax.device_put(host, place.device), jax.device_put(dev, place.host)])

    busy = _best_time(lambda: jax.block_until_ready(with_copies()))
    copy_time = _best_time(copies_only)
    slowdown = busy / alone
    report.check(
        "compute_under_copies",
        slowdown <= OVERLAP_SLOWDOWN,
        f"matmul chain {alone * 1e3:.1f} ms alone, {busy * 1e3:.1f} ms with "
        f"{nbytes >> 20} MiB copied each way ({copy_time * 1e3:.1f} ms alone): "
        f"{slowdown:.2f}x (ceiling {OVERLAP_SLOWDOWN:g}x)",
        alone_s=alone,
        with_copies_s=busy,
        copies_s=copy_time,
    )


def equivalence(report: Report, quick: bool, emulate: bool) -> None:
    """The equivalence tests themselves (their criterion lives in ``tests/``), then a
    bf16 run that must train."""
    if not (ROOT / "tests" / "test_two_client.py").is_file():
        report.check("tests", None, f"no tests/ beside the package ({ROOT}): run from a checkout")
    else:
        env = dict(os.environ)
        if emulate:
            env.update(JAX_PLATFORMS="cpu", HETJAX_HOST_CLIENT="separate")
            files = ["tests/test_two_client.py"]
        else:  # the accelerator first, the CPU client for the host optimizer
            import jax

            env["JAX_PLATFORMS"] = f"{jax.devices()[0].platform},cpu"
            files = ["tests/test_two_client.py", "tests/test_stream.py", "tests/test_offload.py"]
            files.append("tests/test_expert_fetch.py")  # routed experts' copies, both ways
            files.append("tests/test_chunks.py")  # a micro-batch in chunks of rows
            files.append("tests/test_deferred_updates.py")  # experts' state left on disk
            if quick:
                files = files[:1]
        select = [] if emulate else ["-k", "equal or two_client or pinned or fewer_bytes"]
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n0"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*args, "-m", "not slow", *select, *files],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        summary = tail[-1] if tail else "no output"
        report.check(
            "tests",
            proc.returncode == 0,
            f"{' '.join(files)}: {summary} ({time.perf_counter() - t0:.0f} s)",
            output_tail="\n".join(tail[-40:]),
        )
    _bf16_trains(report, quick)


def _bf16_trains(report: Report, quick: bool) -> None:
    import tempfile

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


def memory(report: Report, quick: bool, emulate: bool) -> None:
    import tempfile

    import jax

    from hetjax.config import Config
    from hetjax.config_values import format_bytes
    from hetjax.train import train

    device = jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        report.check("device_budget", None, f"{device.platform}: no memory_stats()")
        return
    budget = 2 * GiB
    config = Config().replace(
        model=dict(num_layers=8, d_model=1024, num_heads=16, compute_dtype="bfloat16"),
        train=dict(steps=3, batch_size=8, seq_len=512, eval_batches=0, log_every=1000),
        memory=dict(device_budget=budget),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=2_000_000),
    )
    before = device.memory_stats()["peak_bytes_in_use"]
    with tempfile.TemporaryDirectory() as tmp:
        result = train(config, tmp, verbose=False)
        mode = chosen_mode(tmp)
    peak = device.memory_stats()["peak_bytes_in_use"]
    ledger = max(r.get("device_bytes_peak", 0) for r in result.records)
    report.check(
        "device_budget",
        peak <= DEVICE_BUDGET_SLACK * budget and peak >= before,
        f"auto chose {mode}; XLA peak {format_bytes(peak)} vs budget {format_bytes(budget)} "
        f"(ceiling {DEVICE_BUDGET_SLACK:g}x), ledger peak {format_bytes(ledger)}",
        peak=peak,
        ledger=ledger,
        budget=budget,
    )
    working_set(report, jax.default_backend())


# The planner may over-estimate a working set (a plan that could fit more) but not
# under-estimate it by more than the fit's band (tests/test_planner.py): a plan would
# then not fit the device it was made for.
WORKING_SET_LOW = 0.75


def working_set(
    report: Report, backend: str, d_model: int = 2048, batch: int = 8, seq: int = 1024
) -> None:
    """The planner's estimated working set (``Workload.from_config`` for ``backend``)
    against the one XLA compiles here (``StageFunctions.memory_sizes``), for a GPT at a
    shape where the blocks' activations dominate (by default d 2048, 8 x 1024 tokens),
    bf16, whole and in 4 chunks of rows. A check per chunk count, with both figures."""
    import jax.numpy as jnp

    from hetjax.config import load_config
    from hetjax.config_values import format_bytes
    from hetjax.planning.workload import Workload
    from hetjax.runtime import stages
    from hetjax.runtime.placement import SingleDevice
    from models import build_model

    for n in (1, 4):
        config = load_config("gpt_tiny", {
            "model.num_layers": "2", "model.d_model": str(d_model), "model.num_heads": "16",
            "model.vocab_size": "8192", "model.max_seq_len": str(seq),
            "model.compute_dtype": "bfloat16", "train.seq_len": str(seq),
            "train.batch_size": str(batch), "offload.mode": "stream",
            "offload.batch_chunks": str(n),
        })  # fmt: skip
        model = build_model(config.model)
        layouts = stages.stage_layouts(model, config.memory.page_size, leaf_buffers=True)
        fns = stages.StageFunctions(
            model, layouts, SingleDevice(),
            block_grad_dtype=jnp.bfloat16, batch_chunks=n,
        )  # fmt: skip
        compiled = fns.memory_sizes(batch, seq, jnp.bfloat16).working_set
        estimate = Workload.from_config(config, backend=backend).working_set
        ratio = estimate / max(compiled, 1)
        report.check(
            f"working_set_{n}_chunks",
            ratio >= WORKING_SET_LOW,
            f"GPT d {d_model}, {batch} x {seq} tokens, bf16, {n} chunk(s): estimated "
            f"{format_bytes(estimate)}, compiled {format_bytes(compiled)} ({ratio:.2f}x; "
            f"at least {WORKING_SET_LOW:g}x)",
            estimate=estimate,
            compiled=compiled,
            chunks=n,
        )


def mfu(report: Report, quick: bool, emulate: bool) -> None:
    """Offloaded vs in-HBM MFU at one shape, and a model beyond the pool. The pool is
    this process's ``memory.device_fraction`` of HBM: the beyond-pool row runs in a
    child with a quarter of it, so its state (in host RAM: no NVMe files on a small
    disk) is well above what the device holds."""
    import tempfile

    import jax
    import numpy as np

    from hetjax.bench.common import _steady_step_time
    from hetjax.config import Config
    from hetjax.train import train

    d, heads, seq, batch = (1024, 16, 512, 8) if quick else (4096, 32, 2048, 8)
    steps, skip = (4, 1) if quick else (8, 3)
    base = Config().replace(
        model=dict(d_model=d, num_heads=heads, max_seq_len=seq, compute_dtype="bfloat16"),
        train=dict(steps=steps, batch_size=batch, seq_len=seq, eval_batches=0, log_every=1000),
        checkpoint=dict(every_steps=0, at_end=False),
        data=dict(corpus_bytes=4_000_000),
    )
    rows = {"in_hbm": dict(mode="none"), "offloaded": dict(mode="stream", optimizer="host")}
    layers = 4 if quick else 8
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, offload in rows.items():
            config = base.replace(model=dict(num_layers=layers), offload=offload)
            if name == "offloaded":
                config = config.replace(train=dict(trace_every=steps - 1))
            run = train(config, Path(tmp) / name, verbose=False)
            timed = run.records[skip:]
            got[name] = {
                "s_per_step": _steady_step_time(run.records, skip),
                "mfu": float(np.median([r.get("mfu", 0.0) for r in timed])),
                "tflops": float(np.median([r["tflops"] for r in timed])),
            }
            pngs = sorted((Path(tmp) / name).rglob("step_*.png"))
            if pngs:
                keep = report.path.parent / f"timeline_{name}.png"
                shutil.copy(pngs[-1], keep)
                got[name]["timeline"] = str(keep)
    ratio = got["offloaded"]["tflops"] / got["in_hbm"]["tflops"]
    report.check(
        "offloaded_vs_in_hbm",
        ratio >= 0.8,
        f"{layers} layers d {d}: in HBM {got['in_hbm']['tflops']:.1f} TFLOP/s "
        f"(MFU {got['in_hbm']['mfu']:.3f}), offloaded {got['offloaded']['tflops']:.1f} "
        f"({ratio:.2f}x; floor 0.8x); timeline {got['offloaded'].get('timeline', 'none')}",
        **{f"{k}_{f}": v for k, r in got.items() for f, v in r.items()},
    )
    device = jax.devices()[0]
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    if not limit:
        report.check("beyond_pool", None, "no bytes_limit: the pool is unknown")
        return
    fraction = 0.25 * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"))
    pool = limit / 4
    per_layer = 12 * d * d * 16  # bytes of fp32 state (master, Adam moments, grads) / layer
    deep = max(layers + 1, int(1.5 * pool / per_layer))
    script = (
        "import json, sys, tempfile, numpy as np\n"
        "from hetjax.config import Config\nfrom hetjax.train import train\n"
        "from hetjax.gpucheck import chosen_mode\n"
        f"c = Config().replace(**json.loads({json.dumps(base.to_dict())!r}))\n"
        f"c = c.replace(model=dict(num_layers={deep}), "
        f"memory=dict(device_fraction={fraction}))\n"
        "with tempfile.TemporaryDirectory() as t:\n"
        "    r = train(c, t, verbose=False)\n"
        "    mode = chosen_mode(t)\n"
        f"rec = r.records[{skip}:]\n"
        "print(json.dumps({'tflops': float(np.median([x['tflops'] for x in rec])),"
        " 'mode': mode}))\n"
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:g}")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode:
        report.check("beyond_pool", False, f"failed: {proc.stderr.strip()[-500:]}")
        return
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    state = deep * per_layer
    report.check(
        "beyond_pool",
        out["mode"] != "none" and out["tflops"] > 0,
        f"{deep} layers, {state / GiB:.0f} GiB of state over a {pool / GiB:.0f} GiB pool: "
        f"{out['mode']} at {out['tflops']:.1f} TFLOP/s",
        **out,
    )


RUNNERS = {
    "environment": environment,
    "placement": placement,
    "bandwidth": bandwidth,
    "overlap": overlap,
    "equivalence": equivalence,
    "memory": memory,
    "mfu": mfu,
}


# -- the driver ----------------------------------------------------------------------------


def _run_section(section: Section, args, out: Path) -> str:
    """Runs one section in a child under its time box; returns PASS, FAIL or SKIP."""
    report = Report(out, section.name)
    ram, disk = _mem_available(), shutil.disk_usage(out).free
    if ram < section.ram or disk < section.disk:
        report.check(
            "resources",
            None,
            f"needs {section.ram / GiB:.0f} GiB free RAM and {section.disk / GiB:.0f} GiB "
            f"free disk; {ram / GiB:.1f} and {disk / GiB:.1f} free",
        )
        return "SKIP"
    box = section.seconds // 2 if args.quick else section.seconds
    cmd = [sys.executable, "-m", "hetjax.gpucheck", "--section", section.name, "--out", str(out)]
    cmd += ["--quick"] * args.quick + ["--emulate"] * args.emulate
    before = _count(out)
    try:
        proc = subprocess.run(cmd, timeout=box, cwd=ROOT if ROOT.is_dir() else None)
    except subprocess.TimeoutExpired:
        report.check("time_box", False, f"did not finish within {box} s")
        return "FAIL"
    rows = _rows(out)[before:]
    if proc.returncode != 0 and not any(r["status"] == "FAIL" for r in rows):
        report.check("exit", False, f"the section's process exited with {proc.returncode}")
        return "FAIL"
    statuses = {r["status"] for r in rows}
    return "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIP"


def _rows(out: Path) -> list[dict]:
    path = out / "gpucheck.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _count(out: Path) -> int:
    return len(_rows(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.gpucheck",
        description="Checks hetjax's GPU data path on this machine; exits 0 if all pass.",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, half the time")
    parser.add_argument(
        "--out", default="", help="where gpucheck.jsonl goes (default ./gpucheck-<date>)"
    )
    parser.add_argument(
        "--emulate", action="store_true", help="CPU only: equivalence through two JAX clients"
    )
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections ({', '.join(RUNNERS)})"
    )
    parser.add_argument("--section", default="", help=argparse.SUPPRESS)  # a child's one
    args = parser.parse_args(argv)
    out = Path(args.out or f"gpucheck-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return _child(args, out)

    from hetjax import xla_env
    from hetjax.config import Config

    for note in xla_env.apply(Config()):  # the children inherit them
        print(f"note: {note}")
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; sections: {', '.join(RUNNERS)}")
    sections = [s for s in SECTIONS if not (args.emulate and s.gpu_only)]
    sections = [s for s in sections if not only or s.name in only]
    t0 = time.perf_counter()
    results = {s.name: _run_section(s, args, out) for s in sections}
    failed = [n for n, r in results.items() if r == "FAIL"]
    skipped = [n for n, r in results.items() if r == "SKIP"]
    print(
        f"gpucheck: {len(results) - len(failed) - len(skipped)} sections passed, "
        f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
        f"{len(skipped)} skipped{' (' + ', '.join(skipped) + ')' if skipped else ''} "
        f"in {time.perf_counter() - t0:.0f} s; results in {out / 'gpucheck.jsonl'}"
    )
    return 1 if failed else 0


def _child(args, out: Path) -> int:
    if args.emulate:
        os.environ["HETJAX_HOST_CLIENT"] = "separate"
    report = Report(out, args.section)
    try:
        RUNNERS[args.section](report, args.quick, args.emulate)
    except Exception as e:  # noqa: BLE001 — one line per failure, the traceback after it
        import traceback

        report.check("error", False, f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
