"""gpucheck's sections, their time boxes and floors, and how a check reports (the
driver: ``hetjax/gpucheck/__init__.py``)."""

from __future__ import annotations

import dataclasses
import json
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
