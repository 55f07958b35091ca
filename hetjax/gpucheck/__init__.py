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
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hetjax.errors import check_output_dir, entry_point

# the sections (the names tests and docs read here too)
from hetjax.gpucheck.common import (  # noqa: F401
    FULL_SECONDS,
    INSTALL,
    MFU_RATIO,
    PROBE_SECONDS,
    QUICK_SECONDS,
    ROOT,
    SECTIONS,
    GiB,
    Report,
    Run,
    Section,
    time_boxes,
)
from hetjax.gpucheck.training import (  # noqa: F401
    BF16_ARGS,
    BF16_EQUIVALENCE,
    ROW_PREFIX,
    equivalence,
    memory,
    mfu,
    mfu_floor,
    mfu_row,
)
from hetjax.gpucheck.transfer import bandwidth, environment, overlap, placement

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)
from hetjax.planning.hardware import _mem_available

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


@entry_point("hetjax.gpucheck")
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
    out = check_output_dir(args.out or f"gpucheck-{time.strftime('%Y-%m-%d')}", "--out")
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
