"""``python -m hetjax.gpucheck [--quick] [--out DIR] [--emulate]``: the first thing to run
on a GPU machine (issue #19). One command, whole within 10 minutes on an H100 with 128 GB
of RAM and a 64 GB disk, that says whether hetjax's data path works there and how fast.

It needs a CUDA jaxlib (``pip install -e '.[cuda13]'``, or ``.[cuda12]`` for an older
driver; on a machine with only an image's packages, ``python3 -m hetjax.gpucheck`` from
the repository root). It first asks a short child process which backend JAX starts:
on a CPU it stops there (exit 2, a line naming the install), so it never trains on a
CPU by accident. It sets the XLA variables (``xla_env.py``) and a compilation cache
under ``DIR`` (a rerun compiles less), prints the time boxes' sum, then runs each
section in a child process (its own process group) under a time box: a section that
hangs or runs out of memory is a FAIL, not a stuck command. Free RAM and disk are
checked before each. The driver itself never starts JAX, so every child has the GPU to
itself. Every check prints one line, ``PASS``/``FAIL``/``SKIP`` with its figures, and
is appended to ``DIR/gpucheck.jsonl`` as it goes. The command exits 0 only when nothing
failed.

Sections:

* ``environment``: versions, the device, its memory kinds and ``bytes_limit``, the
  native Adam kernel's build (SKIP without a C++ compiler).
* ``placement``: round trips device <-> ``pinned_host`` and device <-> the CPU client;
  ``np.asarray`` of a ``pinned_host`` array is a view of its buffer (no copy).
* ``bandwidth``: host -> device and back, as pages vs one slab, both directions at
  once, from pageable vs pinned memory, and the host optimizer's refreshed params going
  to the device's ``pinned_host`` through numpy (the runtime's path) vs across clients.
* ``overlap``: a matmul chain's completion alone vs with copies both ways under it,
  the copies sized to take about as long as the chain.
* ``equivalence``: the two-client and streaming equivalence tests (``tests/``, 1e-5,
  ``precision=highest``), a bf16 streamed-vs-in-memory test, and a bf16 run that must
  train.
* ``memory``: a streamed run's ``memory.device_budget`` vs the device's
  ``peak_bytes_in_use`` vs the runtime's ledger; the planner's working-set estimate for
  a GPU in bf16 (the fp32 XLA:CPU fit scaled, never measured on a GPU before) vs the
  compiled stage functions', whole and in chunks of rows (``offload.batch_chunks``):
  the figures to refit it by.
* ``mfu``: offloaded vs in-HBM MFU at a shape that fits the pool, and a model beyond
  the pool under a reduced device memory fraction, each row in its own child process,
  with a timeline PNG (what ``bench gpu`` measured, sized for this machine: no NVMe
  files, state in host RAM).

``--emulate`` (a CPU-only machine): the equivalence section through the two-client
emulation of the GPU topology (``HETJAX_HOST_CLIENT=separate``); the other sections need
a GPU and are not run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)
from hetjax.planning.hardware import _best_time, _mem_available

ROOT = Path(__file__).resolve().parent.parent  # a source checkout: tests/ beside hetjax/
GiB = 1 << 30
MiB = 1 << 20

# What a CPU-only jaxlib lacks: the line gpucheck stops with on a CPU.
INSTALL = (
    "pip install -e '.[cuda13]' (NVIDIA driver 580 or newer; '.[cuda12]' for older "
    "drivers), or on a CPU-only machine run --emulate"
)

# Floors a healthy GPU machine clears by a wide margin. PCIe 4.0 x16 moves ~25 GB/s and
# 5.0 ~50 GB/s each way from pinned memory; below MIN_PINNED_GBS the pinned path is not
# DMA (or the link is degraded). Pages move within PAGES_VS_SLAB of one slab's speed when
# per-copy overheads are small at the streaming runtime's page size.
MIN_PINNED_GBS = 8.0
PAGES_VS_SLAB = 0.8
DUPLEX_GAIN = 1.2  # both directions at once move this much more than one alone
# The host optimizer's params reach pinned_host through a numpy view (the runtime's
# path) because the cross-client copy goes through an XLA Literal: numpy must not be the
# slower of the two, beyond best-of-3 timing noise.
NUMPY_VS_CROSS_CLIENT = 0.9
OVERLAP_SLOWDOWN = 1.3  # compute under copies both ways, at most this much slower
DEVICE_BUDGET_SLACK = 1.10  # XLA's peak vs the budget: its scratch and fragmentation
# Offloaded vs in-HBM TFLOP/s where the host optimizer keeps up with the device: a step
# cannot be shorter than the optimizer's work, so the floor scales by the in-HBM step
# over the optimizer's busy time per step where that is longer (mfu_floor).
MFU_RATIO = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
    name: str
    seconds: int  # the time box (full run)
    ram: int  # free RAM needed to start it
    disk: int  # free disk under --out needed to start it
    gpu_only: bool = True
    quick_seconds: int = 0  # 0: half of seconds
    # --emulate, on a CPU (no lent machine's call to fit): 0, the same as on a GPU
    emulate_seconds: int = 0

    def box(self, quick: bool, emulate: bool = False) -> int:
        """The section's time box in seconds."""
        if emulate and self.emulate_seconds:
            return self.emulate_seconds
        return (self.quick_seconds or self.seconds // 2) if quick else self.seconds


# The backend probe's box: JAX's import and a GPU's start (seconds on an H100).
PROBE_SECONDS = 30
# The boxes add up to what one 10-minute call on a lent H100 leaves after the machine's
# start and the transfers: 540 s, and 300 s with --quick (tests/test_gpucheck.py).
SECTIONS = [
    Section(name="environment", seconds=25, ram=1 * GiB, disk=0, quick_seconds=20),
    Section(name="placement", seconds=20, ram=2 * GiB, disk=0, quick_seconds=15),
    Section(name="bandwidth", seconds=40, ram=12 * GiB, disk=0, quick_seconds=20),
    Section(name="overlap", seconds=30, ram=8 * GiB, disk=0, quick_seconds=20),
    # --emulate on 2 busy CPU cores: the two-client tests and the bf16 run took 298 s
    Section(
        name="equivalence",
        seconds=180,
        ram=8 * GiB,
        disk=2 * GiB,
        gpu_only=False,
        quick_seconds=100,
        emulate_seconds=480,
    ),  # fmt: skip
    Section(name="memory", seconds=45, ram=8 * GiB, disk=1 * GiB, quick_seconds=30),
    Section(name="mfu", seconds=170, ram=80 * GiB, disk=2 * GiB, quick_seconds=65),
]
FULL_SECONDS, QUICK_SECONDS = 540, 300


def time_boxes(sections: list[Section], quick: bool, emulate: bool = False) -> dict[str, int]:
    """Each step's time box in seconds, the backend probe first (not under --emulate)."""
    boxes = {} if emulate else {"probe": PROBE_SECONDS}
    return boxes | {s.name: s.box(quick, emulate) for s in sections}


@dataclasses.dataclass(frozen=True)
class Run:
    """What a section runs with: ``--quick``, ``--emulate``, the output directory and
    the accelerator's JAX platform name (the probe's; "" under --emulate)."""

    quick: bool
    emulate: bool
    out: Path
    platform: str = ""


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


def environment(report: Report, run: Run) -> None:
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
        f"{limit / GiB:.1f} GiB allocatable ({xla_env.mem_fraction_setting()}, pinned limit "
        f"{xla_env.pinned_limit() / GiB:.0f} GiB)",
        bytes_limit=limit,
    )
    if native._compiler() is None:  # the kernel is optional: optax runs instead
        report.check("native_kernel", None, "no C++ compiler (g++, c++, clang++ or CXX): optax")
        return
    try:
        lib = native.load()
        report.check("native_kernel", True, f"built: {lib._name}")
    except native.NativeKernelError as e:
        report.check("native_kernel", False, f"{e} (optax runs instead, slower)")


def placement(report: Report, run: Run) -> None:
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
    # The host optimizer reads gradients in pinned_host through numpy views: a copy
    # there would double the host's memory traffic.
    pinned = jax.block_until_ready(jax.device_put(x, place.host))
    view = np.asarray(pinned)
    buffer = pinned.addressable_data(0).unsafe_buffer_pointer()
    shared = view.ctypes.data == buffer
    found = "a view of its buffer" if shared else f"a copy ({view.ctypes.data:#x} vs {buffer:#x})"
    report.check(
        "zero_copy_view", shared, f"np.asarray of a {x.nbytes >> 20} MiB pinned_host array: {found}"
    )


def bandwidth(report: Report, run: Run) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.runtime.placement import Shardings

    place = Shardings.single_device()
    nbytes = (256 << 20) if run.quick else (2 << 30)
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
        numpy_path >= NUMPY_VS_CROSS_CLIENT * cross,
        f"host optimizer -> pinned_host through numpy (the runtime's path) {numpy_path:.1f} "
        f"GB/s vs across clients {cross:.1f} GB/s, {numpy_path / cross:.2f}x (floor "
        f"{NUMPY_VS_CROSS_CLIENT:g}x)",
        cross_client_gbs=cross,
        numpy_gbs=numpy_path,
    )


def overlap(report: Report, run: Run) -> None:
    """A matmul chain's completion alone vs with copies both ways dispatched beside it,
    the copies sized to take about as long as the chain alone: on a GPU the copy
    engines move them while the SMs compute, so the chain finishes about as soon."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.runtime.placement import Shardings

    place = Shardings.single_device()
    cpu = jax.devices()[0].platform == "cpu"  # the code path only: a CPU has no copy engines
    n, depth = (256, 4) if cpu else (2048, 16) if run.quick else (4096, 16)
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16) * 0.01, place.device)

    @jax.jit
    def chain(x):
        for _ in range(depth):
            x = jnp.tanh(x @ x)
        return x

    repeats = 8
    alone = _best_time(lambda: jax.block_until_ready([chain(a) for _ in range(repeats)]))

    def buffers(nbytes):
        elems = nbytes // 4
        return (
            jax.block_until_ready(jax.device_put(np.ones(elems, np.float32), place.host)),
            jax.block_until_ready(jax.device_put(np.ones(elems, np.float32), place.device)),
        )

    def copies(host, dev):
        return [jax.device_put(host, place.device), jax.device_put(dev, place.host)]

    probe = 16 * MiB if cpu else 256 * MiB
    probes = buffers(probe)
    seconds_per_byte = _best_time(lambda: jax.block_until_ready(copies(*probes))) / probe
    cap = 256 * MiB if cpu else (1 * GiB if run.quick else 4 * GiB)
    nbytes = int(min(cap, max(16 * MiB, alone / seconds_per_byte))) // MiB * MiB
    host, dev = buffers(nbytes)
    copy_time = _best_time(lambda: jax.block_until_ready(copies(host, dev)))

    def chain_under_copies() -> float:
        t0 = time.perf_counter()
        # the chain first: a copy whose dispatch waited for its transfer would delay it
        out = [chain(a) for _ in range(repeats)]
        moving = copies(host, dev)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        jax.block_until_ready(moving)  # not timed: the chain's completion only
        return seconds

    chain_under_copies()  # warm-up
    busy = min(chain_under_copies() for _ in range(3))
    slowdown = busy / alone
    report.check(
        "compute_under_copies",
        slowdown <= OVERLAP_SLOWDOWN,
        f"matmul chain done in {alone * 1e3:.1f} ms alone, {busy * 1e3:.1f} ms with "
        f"{nbytes >> 20} MiB copied each way beside it ({copy_time * 1e3:.1f} ms alone): "
        f"{slowdown:.2f}x (ceiling {OVERLAP_SLOWDOWN:g}x)",
        alone_s=alone,
        with_copies_s=busy,
        copies_s=copy_time,
        copy_bytes=nbytes,
    )


# The bf16 fast path's equivalence, streamed vs in memory, NVMe tier (in the default run
# too): run by node id, beside the selection (--quick selects one file only).
BF16_EQUIVALENCE = "tests/test_stream.py::test_stream_equals_none_in_compute_dtype[bfloat16-nvme]"
BF16_ARGS = ("-n0", BF16_EQUIVALENCE)  # (the default marker selection: not slow)
PYTEST_WORKERS = 4  # pytest-xdist processes sharing the GPU (16 cores on a lent H100)


def equivalence(report: Report, run: Run) -> None:
    """The equivalence tests themselves (their criterion lives in ``tests/``), then a
    bf16 run that must train. The tests run in a pytest child; this process starts no
    JAX until they are done, so the child has the device to itself."""
    from hetjax import xla_env

    if not (ROOT / "tests" / "test_two_client.py").is_file():
        report.check("tests", None, f"no tests/ beside the package ({ROOT}): run from a checkout")
    else:
        env = dict(os.environ)
        if run.emulate:
            env.update(JAX_PLATFORMS="cpu", HETJAX_HOST_CLIENT="separate")
            files, select = ["tests/test_two_client.py"], ["-n0"]
        else:  # the accelerator first, the CPU client for the host optimizer
            env["JAX_PLATFORMS"] = f"{run.platform or 'cuda'},cpu"
            # Tiny models, dispatch- and compile-bound: PYTEST_WORKERS processes share
            # the GPU, each growing its pool on demand up to a share of the memory.
            env = xla_env.with_mem_fraction(0.8 / PYTEST_WORKERS, env)
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            # one compilation cache per worker (tests/conftest.py's): JAX writes its
            # entries without a lock
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            files = ["tests/test_two_client.py", "tests/test_stream.py", "tests/test_offload.py"]
            files.append("tests/test_expert_fetch.py")  # routed experts' copies, both ways
            files.append("tests/test_chunks.py")  # a micro-batch in chunks of rows
            files.append("tests/test_deferred_updates.py")  # experts' state left on disk
            if run.quick:
                files = files[:1]
            select = ["-k", "equal or two_client or pinned or fewer_bytes"]
            select += ["-n", str(PYTEST_WORKERS), "--dist", "load"]  # test by test
        _pytest(report, "tests", ["-m", "not slow", *select, *files], env)
        if not run.emulate:
            _pytest(report, "bf16_stream_equals_none", list(BF16_ARGS), env)
    _bf16_trains(report, run.quick)


def _pytest(report: Report, check: str, args: list[str], env: dict[str, str]) -> None:
    """Runs pytest on ``args`` in a child; one check line."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
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
    """A streamed run under a 2 GiB device budget: XLA's peak against it. Streaming is
    forced (``auto`` could choose ``none`` and test nothing of it, and would measure the
    machine first, its probes' buffers in the peak); the peak before training is read
    and must be below the budget, so the peak after is the run's."""
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
        offload=dict(mode="stream"),
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
        before < budget and before <= peak <= DEVICE_BUDGET_SLACK * budget,
        f"{mode}: XLA peak {format_bytes(peak)} ({format_bytes(before)} before training) vs "
        f"budget {format_bytes(budget)} (ceiling {DEVICE_BUDGET_SLACK:g}x), ledger peak "
        f"{format_bytes(ledger)}",
        peak=peak,
        peak_before=before,
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


def mfu_floor(in_hbm_s: float, optimizer_s: float) -> float:
    """The floor of offloaded / in-HBM TFLOP/s: MFU_RATIO where the host optimizer's
    work per step (``optimizer_s``, measured in the offloaded run) fits within the
    in-HBM step (``in_hbm_s``), scaled by ``in_hbm_s / optimizer_s`` where it does not:
    an offloaded step cannot be shorter than its optimizer's work."""
    return MFU_RATIO * min(1.0, in_hbm_s / optimizer_s) if optimizer_s > 0 else MFU_RATIO


# Both rows without gradient clipping: with it, the host optimizer redoes the steps
# whose global norm binds (every early step of a fresh model), twice the work.
MFU_ROWS = {"in_hbm": dict(mode="none"), "offloaded": dict(mode="stream", optimizer="host")}
ROW_PREFIX = "gpucheck-row: "  # the line a row's child prints its figures on


def _mfu_shape(quick: bool) -> dict[str, int]:
    if quick:
        return dict(d=1024, heads=16, seq=512, batch=8, layers=4, steps=4, skip=1)
    return dict(d=4096, heads=32, seq=2048, batch=8, layers=8, steps=6, skip=2)


def mfu_row(row: str, run: Run) -> dict[str, Any]:
    """One row of the mfu section, in its own process: ``in_hbm``, ``offloaded`` or
    ``beyond_pool`` (a model whose fp32 state is 1.5x this process's pool: the device
    memory fraction its parent gave it). Returns its median figures past the warm-up."""
    import jax
    import numpy as np

    from hetjax import xla_env
    from hetjax.config import Config
    from hetjax.train import train

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
        per_layer = 12 * s["d"] ** 2 * 16  # bytes of fp32 state (master, Adam, grads)
        layers = max(s["layers"] + 1, int(1.5 * pool / per_layer))
        fraction = xla_env.mem_fraction() or config.memory.device_fraction
        config = config.replace(
            model=dict(num_layers=layers), memory=dict(device_fraction=fraction)
        )
        figures = dict(layers=layers, pool_bytes=pool, state_bytes=layers * per_layer)
    else:
        config = config.replace(model=dict(num_layers=s["layers"]), offload=MFU_ROWS[row])
        if row == "offloaded":
            config = config.replace(train=dict(trace_every=s["steps"] - 1))
    with tempfile.TemporaryDirectory() as tmp:
        result = train(config, tmp, verbose=False)
        figures["mode"] = chosen_mode(tmp)
        pngs = sorted(Path(tmp).rglob("step_*.png"))
        if pngs:
            keep = run.out / f"timeline_{row}.png"
            shutil.copy(pngs[-1], keep)
            figures["timeline"] = str(keep)
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
        hbm, off, shape = got["in_hbm"], got["offloaded"], _mfu_shape(run.quick)
        ratio = off["tflops"] / hbm["tflops"]
        floor = mfu_floor(hbm["s_per_step"], off["optimizer_busy_s"])
        report.check(
            "offloaded_vs_in_hbm",
            ratio >= floor,
            f"{shape['layers']} layers d {shape['d']}, no "
            f"clipping: in HBM {hbm['tflops']:.1f} TFLOP/s (MFU {hbm['mfu']:.3f}, "
            f"{hbm['s_per_step']:.3f} s/step), offloaded {off['tflops']:.1f} "
            f"({off['s_per_step']:.3f} s/step, host optimizer busy "
            f"{off['optimizer_busy_s']:.3f} s): {ratio:.2f}x (floor {floor:.2f}x: "
            f"{MFU_RATIO:g}x, scaled by the in-HBM step over the optimizer's time where "
            f"longer); timeline {off.get('timeline', 'none')}",
            ratio=ratio,
            floor=floor,
            **{f"{k}_{f}": v for k, r in got.items() for f, v in r.items()},
        )
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


# JAX's default backend, by the name JAX_PLATFORMS takes: "gpu" there would ask for
# every GPU platform (cuda, rocm, ...) and fail on the ones not installed.
PROBE = """
import jax
platform = jax.default_backend()
for name in ("cuda", "rocm") if platform == "gpu" else ():
    try:
        jax.devices(name)
        platform = name
        break
    except RuntimeError:
        pass
print(platform)
"""


def probe_platform(timeout: float = PROBE_SECONDS) -> tuple[str, str]:
    """The platform JAX starts here by default (``cuda``, ``cpu``, ...), asked of a
    child process so that this one never starts JAX and the sections' own children get
    the whole device; ``("", why)`` where it could not tell."""
    code = PROBE
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the probe takes no pool
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "", f"JAX did not start within {timeout:g} s"
    lines = proc.stdout.split()
    if proc.returncode or not lines:
        tail = proc.stderr.strip().splitlines()
        return "", f"JAX did not start: {tail[-1] if tail else proc.returncode}"
    return lines[-1], ""


def _no_gpu_line(platform: str, why: str) -> str:
    forced = os.environ.get("JAX_PLATFORMS")
    found = why or f"JAX's backend here is {platform}" + (
        f" (JAX_PLATFORMS={forced})" if forced else " (jaxlib is a CPU build)"
    )
    return f"gpucheck: no GPU: {found}; install a CUDA jaxlib: {INSTALL}"


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
    box = section.box(args.quick, args.emulate)
    cmd = [sys.executable, "-m", "hetjax.gpucheck", "--section", section.name, "--out", str(out)]
    cmd += ["--quick"] * args.quick + ["--emulate"] * args.emulate
    platform = getattr(args, "platform", "")
    cmd += ["--platform", platform] if platform else []
    before = _count(out)
    # A process group of its own: the time box ends the section's children too (pytest,
    # the mfu rows), which would otherwise hold the GPU for the sections after it.
    proc = subprocess.Popen(cmd, cwd=ROOT if ROOT.is_dir() else None, start_new_session=True)
    try:
        proc.wait(timeout=box)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        report.check("time_box", False, f"did not finish within {box} s")
        return "FAIL"
    except BaseException:  # Ctrl-C: the group is not in the terminal's any more
        _kill_group(proc)
        raise
    rows = _rows(out)[before:]
    if proc.returncode != 0 and not any(r["status"] == "FAIL" for r in rows):
        report.check("exit", False, f"the section's process exited with {proc.returncode}")
        return "FAIL"
    statuses = {r["status"] for r in rows}
    return "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIP"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _rows(out: Path) -> list[dict]:
    path = out / "gpucheck.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _count(out: Path) -> int:
    return len(_rows(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.gpucheck",
        description="Checks hetjax's GPU data path on this machine; exits 0 if all pass, "
        f"2 without a GPU (install: {INSTALL}).",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter boxes")
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
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)  # an mfu row's child
    parser.add_argument("--platform", default="", help=argparse.SUPPRESS)  # the probe's
    args = parser.parse_args(argv)
    out = Path(args.out or f"gpucheck-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return _child(args, out)
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; sections: {', '.join(RUNNERS)}")

    from hetjax import xla_env
    from hetjax.config import Config

    for note in xla_env.apply(Config()):  # the children inherit them
        print(f"note: {note}")
    # A compilation cache under DIR: a rerun (a lent machine's next call) compiles less.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str((out / "jax-cache").resolve()))
    sections = [s for s in SECTIONS if not (args.emulate and s.gpu_only)]
    sections = [s for s in sections if not only or s.name in only]
    boxes = time_boxes(sections, args.quick, args.emulate)
    print(
        f"gpucheck: time boxes {' + '.join(f'{k} {v}' for k, v in boxes.items())} = "
        f"{sum(boxes.values())} s at most",
        flush=True,
    )
    t0 = time.perf_counter()
    if not args.emulate:
        args.platform, why = probe_platform()
        if args.platform in ("", "cpu"):
            print(_no_gpu_line(args.platform, why), file=sys.stderr, flush=True)
            return 2
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
    run = Run(args.quick, args.emulate, out, args.platform)
    if args.row:  # one mfu row: its figures on stdout for the section's process
        print(ROW_PREFIX + json.dumps(mfu_row(args.row, run)), flush=True)
        return 0
    report = Report(out, args.section)
    try:
        RUNNERS[args.section](report, run)
    except Exception as e:  # noqa: BLE001 — one line per failure, the traceback after it
        import traceback

        report.check("error", False, f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
