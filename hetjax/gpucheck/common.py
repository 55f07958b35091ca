"""gpucheck's sections, their time boxes and floors, and how a check reports (the
driver: ``hetjax/gpucheck/__init__.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)

ROOT = Path(__file__).resolve().parents[2]  # a source checkout: tests/ beside hetjax/
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
# XLA's deterministic GPU ops (scatter, GEMMs, attention), for the equivalence tests
# that compare bit for bit (XLA's determinism notes); probed before use
DETERMINISTIC_OPS = "--xla_gpu_exclude_nondeterministic_ops=true"
OVERLAP_SLOWDOWN = 1.3  # compute under copies both ways, at most this much slower
DEVICE_BUDGET_SLACK = 1.10  # XLA's peak vs the budget: its scratch and fragmentation
# Offloaded vs in-HBM TFLOP/s where the host optimizer keeps up with the device: a step
# cannot be shorter than the optimizer's work, so the floor scales by the in-HBM step
# over the optimizer's busy time per step where that is longer (mfu_floor).
MFU_RATIO = 0.8


# What a section's time box allows, on a lent H200 with a cold compilation cache (the
# first run of a machine; a rerun finds the cache warm and takes less):
# START_SECONDS each process that starts JAX on the device (Python's imports, CUDA's
# context, the client and its pool), COMPILE_SECONDS each XLA compile (autotuning
# included: the tiny test models' programs take well under it, the mfu rows' d4096
# blocks several times it, which their count in RUN seconds covers), and the section's
# run time beside its compiles (its work measured or predicted for the GPU, with margin).
# The compiles are counted on the CPU by gpucheck's own counter (``timing.py``), the
# GPU's compile seconds printed per section on the first run: the figures to refit by.
START_SECONDS = 6
COMPILE_SECONDS = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Work:
    """What one run of a section does: its waits for processes to start JAX (one after
    another; pytest's workers start together: one wait), XLA compiles (spread over
    ``parallel`` processes at once), seconds of work beside them, and the free RAM it
    needs to start."""

    starts: int
    compiles: int
    run: int
    ram: int
    parallel: int = 1

    def seconds(self) -> int:
        compiling = self.compiles * COMPILE_SECONDS / self.parallel
        return math.ceil(self.starts * START_SECONDS + compiling + self.run)

    def describe(self) -> str:
        spread = f" over {self.parallel} processes" if self.parallel > 1 else ""
        return (
            f"{self.starts} JAX start(s) x {START_SECONDS} s + {self.compiles} compiles x "
            f"{COMPILE_SECONDS:g} s{spread} + {self.run} s of work = {self.seconds()} s"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
    name: str
    quick: Work  # what --quick does
    full: Work
    disk: int  # free disk under --out needed to start it
    gpu_only: bool = True
    # --emulate, on a CPU (no lent machine's call to fit): 0, the same as on a GPU
    emulate_seconds: int = 0
    # the child's command line, for tests (None: ``python -m hetjax.gpucheck --section``)
    command: tuple[str, ...] | None = None

    def work(self, quick: bool) -> Work:
        return self.quick if quick else self.full

    def box(self, quick: bool, emulate: bool = False) -> int:
        """The section's time box in seconds: its work's (:class:`Work`)."""
        if emulate and self.emulate_seconds:
            return self.emulate_seconds
        return self.work(quick).seconds()


# -- host RAM, from what each run holds ------------------------------------------------

# Host bytes per parameter of a streamed run's state: the fp32 master and two Adam
# moments (12), the bf16 params' and gradients' pages (2 + 2).
HOST_BYTES_PER_PARAM = 16
# A training process besides its state: Python, JAX on a GPU and the CPU client, the
# data, pinned staging buffers.
PROCESS_RAM = 6 * GiB
VOCAB = 50257  # the configs' default vocabulary (hetjax/config_model.py), GPT-2's


def gpt_params(layers: int, d: int, vocab: int = VOCAB) -> int:
    """A GPT's parameters: 12 d^2 a block, the embedding and an untied head."""
    return layers * 12 * d * d + 2 * vocab * d


def streamed_ram(params: int) -> int:
    """Free RAM a streamed run of ``params`` parameters needs (state in host RAM)."""
    return params * HOST_BYTES_PER_PARAM + PROCESS_RAM


# The mfu rows' shapes (--quick, full): d, heads, sequence, batch, layers, steps, and
# the steps skipped as warm-up (compiles) before the medians
MFU_SHAPES = {
    True: dict(d=1024, heads=16, seq=512, batch=8, layers=4, steps=4, skip=1),
    False: dict(d=4096, heads=32, seq=2048, batch=8, layers=8, steps=6, skip=2),
}


def mfu_ram(quick: bool) -> int:
    """The mfu section's free RAM to start: its offloaded row's (the in-HBM row holds
    less; the row beyond the pool checks its own, sized from the pool it finds)."""
    s = MFU_SHAPES[quick]
    return streamed_ram(gpt_params(s["layers"], s["d"]))


# The memory section's streamed run: 12 d2048 blocks (1.2 GB of bf16 params) under a
# 1 GiB device budget, so that they cannot all stay on the device: streamed
MEMORY_RUN = dict(layers=12, d=2048, heads=16, vocab=8192, seq=512, batch=4)
MEMORY_BUDGET = 1 * GiB
MEMORY_RAM = streamed_ram(gpt_params(MEMORY_RUN["layers"], MEMORY_RUN["d"], MEMORY_RUN["vocab"]))

# pytest-xdist processes sharing the GPU in the equivalence section (16 cores on a lent
# machine; a tenth of an H200's memory each is plenty for the tests' tiny models)
PYTEST_WORKERS = 8

# XLA compiles (--quick, full), counted on the CPU by timing.py (2026-11-29, JAX 0.10):
# the equivalence tests (--emulate's 17 two-client tests and its bf16 run: 380, and the
# bf16 test; the full selection's 43 tests: 1286, and the bf16 run: 32), the memory
# section's streamed run (32) and working sets (8), the mfu rows (in HBM 8, offloaded
# 32, beyond the pool as offloaded), each with cuDNN's probe
EQUIVALENCE_COMPILES = (440, 1320)
MEMORY_COMPILES = 42
MFU_COMPILES = 78

# The backend probe's box: one JAX start (seconds on a GPU, a cold CUDA context's).
PROBE_SECONDS = 20
# The boxes add up to what one 10-minute call on a lent machine leaves after its start
# and the transfers: 540 s, and 300 s with --quick (tests/test_gpucheck.py).
SECTIONS = [
    # the native kernel's build (g++, cold) and cuDNN's probe
    Section(
        name="environment",
        quick=Work(starts=1, compiles=4, run=12, ram=1 * GiB),
        full=Work(starts=1, compiles=4, run=12, ram=1 * GiB),
        disk=0,
    ),
    Section(
        name="placement",
        quick=Work(starts=1, compiles=2, run=5, ram=2 * GiB),
        full=Work(starts=1, compiles=2, run=5, ram=2 * GiB),
        disk=0,
    ),
    # the runtime's copy sizes: a d2048 (quick) or d4096 block's, best of 3 each way
    Section(
        name="bandwidth",
        quick=Work(starts=1, compiles=2, run=6, ram=4 * GiB),
        full=Work(starts=1, compiles=2, run=12, ram=6 * GiB),
        disk=0,
    ),
    Section(
        name="overlap",
        quick=Work(starts=1, compiles=3, run=6, ram=4 * GiB),
        full=Work(starts=1, compiles=3, run=10, ram=10 * GiB),
        disk=0,
    ),
    # the deterministic-ops probe, pytest's workers, then the section's bf16 run (its
    # compiles, one after another, in its run seconds); --emulate on 2 busy CPU cores
    # took 298 s (458 s under a load of 22)
    Section(
        name="equivalence",
        quick=Work(
            starts=3,
            compiles=EQUIVALENCE_COMPILES[0],
            run=40,
            ram=8 * GiB,
            parallel=PYTEST_WORKERS,
        ),
        full=Work(
            starts=3,
            compiles=EQUIVALENCE_COMPILES[1],
            run=75,
            ram=8 * GiB,
            parallel=PYTEST_WORKERS,
        ),
        disk=2 * GiB,
        gpu_only=False,
        emulate_seconds=480,
    ),  # fmt: skip
    # a streamed run beyond its budget, then the working set's stage functions
    Section(
        name="memory",
        quick=Work(starts=1, compiles=MEMORY_COMPILES, run=10, ram=MEMORY_RAM),
        full=Work(starts=1, compiles=MEMORY_COMPILES, run=20, ram=MEMORY_RAM),
        disk=1 * GiB,
    ),
    # three rows, each its own process: in HBM, offloaded, beyond the pool (the
    # section's own process starts no JAX); the d4096 rows' compiles in the run seconds
    Section(
        name="mfu",
        quick=Work(starts=3, compiles=MFU_COMPILES, run=35, ram=mfu_ram(quick=True)),
        full=Work(starts=3, compiles=MFU_COMPILES, run=150, ram=mfu_ram(quick=False)),
        disk=2 * GiB,
    ),
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
