"""``python -m hetjax.gpucheck [--quick] [--out DIR] [--emulate] [--dry-run]``: the first
thing to run on a GPU machine (issue #19). One command, whole within 10 minutes on an
H100 or H200 with 128 GB of RAM and a 64 GB disk, that says whether hetjax's data path
works there and how fast.

It needs a CUDA jaxlib (``pip install -e '.[cuda13]'``, or ``.[cuda12]`` for an older
driver; on a machine with only an image's packages, ``python3 -m hetjax.gpucheck`` from
the repository root). It first asks a short child process which backend JAX starts:
on a CPU it stops there (exit 2, a line naming the install), so it never trains on a
CPU by accident. It sets the XLA variables (``xla_env.py``) and one compilation cache
for every section under the system's temp dir (:func:`compilation_cache`), prints the
time boxes' sum, then runs each section in a child process (its own process group)
under a time box sized from its work (``common.Work``; ``--dry-run`` prints them): a
section that hangs or runs out of memory is a FAIL, not a stuck command, and a line
gives its wall time and its compiles' count and seconds. SIGTERM or SIGINT to the
driver end the running section's whole group first. Free RAM and disk are checked
before each. The driver itself never starts JAX, so every child has the GPU to itself.
Every check prints one line, ``PASS``/``FAIL``/``SKIP`` with its figures, and is
appended to ``DIR/gpucheck.jsonl`` as it goes. The command exits 0 only when nothing
failed.

Sections:

* ``environment``: versions, the device, its memory kinds and ``bytes_limit``, which
  attention ``auto`` runs (cuDNN's, where its probe passes), the native Adam kernel's
  build (SKIP without a C++ compiler).
* ``placement``: round trips device <-> ``pinned_host`` and device <-> the CPU client;
  ``np.asarray`` of a ``pinned_host`` array is a view of its buffer (no copy).
* ``bandwidth``: host -> device and back, at the sizes the runtime moves (a block's
  leaves in, its gradient's pages out) vs one slab, both directions at once, from
  pageable vs pinned memory, and the host optimizer's refreshed params going to the
  device's ``pinned_host`` through numpy (the runtime's path) vs across clients.
* ``overlap``: a matmul chain's completion alone vs with copies both ways under it,
  the copies sized to take about as long as the chain.
* ``equivalence``: the two-client and streaming equivalence tests (``tests/``, 1e-5,
  ``precision=highest``; XLA's deterministic ops where its flag is known), a bf16
  streamed-vs-in-memory test, and a bf16 run that must train.
* ``memory``: a streamed run's ``memory.device_budget`` (its blocks' params beyond it)
  vs the device's
  ``peak_bytes_in_use`` vs the runtime's ledger; the planner's working-set estimate for
  a GPU in bf16 (the fp32 XLA:CPU fit scaled, never measured on a GPU before) vs the
  compiled stage functions', whole and in chunks of rows (``offload.batch_chunks``):
  the ratio, within a band, the figures to refit it by.
* ``mfu``: offloaded vs in-HBM MFU at a shape that fits the pool (the same tokens per
  step; the floor's overlap: ``training.mfu_floor``), and a model beyond
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
import tempfile
import time
from pathlib import Path

from hetjax.errors import check_output_dir, entry_point
from hetjax.gpucheck import timing

# the sections (the names tests and docs read here too)
from hetjax.gpucheck.common import (  # noqa: F401
    COMPILE_SECONDS,
    FULL_SECONDS,
    INSTALL,
    MEMORY_BUDGET,
    MEMORY_RUN,
    MFU_RATIO,
    MFU_SHAPES,
    PROBE_SECONDS,
    PROCESS_RAM,
    QUICK_SECONDS,
    ROOT,
    SECTIONS,
    START_SECONDS,
    GiB,
    Report,
    Run,
    Section,
    Work,
    time_boxes,
)
from hetjax.gpucheck.training import (  # noqa: F401
    BF16_EQUIVALENCE,
    ROW_PREFIX,
    equivalence,
    equivalence_tests,
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


class Stopped(Exception):  # noqa: N818 — a signal, not an error
    """SIGTERM or SIGINT reached the driver: its section's processes are ended first."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopping_on_signals():
    """SIGTERM and SIGINT raise :class:`Stopped` in the driver (the main thread), so the
    running section's process group (a session of its own, out of the terminal's
    reach) is ended before the driver goes, never orphaned holding the GPU."""

    def stop(signum, frame):
        raise Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# Seconds a section's processes get to leave after the signal forwarded to them, then
# after SIGKILL, before the driver goes on without them.
GRACE_SECONDS = 10


def _run_section(section: Section, args, out: Path) -> str:
    """Runs one section in a child under its time box; returns PASS, FAIL or SKIP."""
    report = Report(out, section.name)
    work = section.work(args.quick)
    ram, disk = _mem_available(), shutil.disk_usage(out).free
    if ram < work.ram or disk < section.disk:
        report.check(
            "resources",
            None,
            f"needs {work.ram / GiB:.0f} GiB free RAM and {section.disk / GiB:.0f} GiB "
            f"free disk; {ram / GiB:.1f} and {disk / GiB:.1f} free",
        )
        return "SKIP"
    box = section.box(args.quick, args.emulate)
    cmd = list(section.command or _section_command(section, args, out))
    counted = Path(tempfile.mkdtemp(prefix="hetjax-gpucheck-")) / "compiles.jsonl"
    env = dict(os.environ, **{timing.VARIABLE: str(counted)})
    before, t0 = _count(out), time.perf_counter()
    # A process group of its own: the time box ends the section's children too (pytest,
    # the mfu rows), which would otherwise hold the GPU for the sections after it.
    proc = subprocess.Popen(
        cmd, cwd=ROOT if ROOT.is_dir() else None, env=env, start_new_session=True
    )
    try:
        proc.wait(timeout=box)
    except subprocess.TimeoutExpired:
        end_group(proc, signal.SIGKILL)
        report.check("time_box", False, f"did not finish within {box} s")
        return "FAIL"
    except Stopped as e:  # forwarded: the section's processes may clean up first
        end_group(proc, e.signum)
        raise
    except BaseException:
        end_group(proc, signal.SIGKILL)
        raise
    finally:
        _print_times(section.name, time.perf_counter() - t0, box, counted)
    rows = _rows(out)[before:]
    if proc.returncode != 0 and not any(r["status"] == "FAIL" for r in rows):
        report.check("exit", False, f"the section's process exited with {proc.returncode}")
        return "FAIL"
    statuses = {r["status"] for r in rows}
    return "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIP"


def _section_command(section: Section, args, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "hetjax.gpucheck", "--section", section.name, "--out", str(out)]
    cmd += ["--quick"] * args.quick + ["--emulate"] * args.emulate
    platform = getattr(args, "platform", "")
    return cmd + (["--platform", platform] if platform else [])


def _print_times(name: str, wall: float, box: int, counted: Path) -> None:
    compiles, seconds = timing.totals(counted)
    shutil.rmtree(counted.parent, ignore_errors=True)
    print(
        f"gpucheck: {name}: {wall:.0f} s of its {box} s box; {compiles} compiles took "
        f"{seconds:.0f} s (summed over its processes), the rest {max(wall - seconds, 0):.0f} s",
        flush=True,
    )


def end_group(proc: subprocess.Popen, signum: int) -> None:
    """Sends ``signum`` to ``proc``'s process group and waits until every process of it
    has gone (the group, not only its leader: pytest's workers, the mfu rows, anything
    they started); SIGKILL after GRACE_SECONDS."""
    for sig in dict.fromkeys((signum, signal.SIGKILL)):
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline:
            proc.poll()  # the leader: reaped here (the others are init's to reap)
            if not group_alive(proc.pid):
                return
            time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, waiting for its parent
    to reap it, holds nothing: not counted)."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: whether the kernel still knows the group
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


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
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print each section's work (JAX starts, compiles) and time box, then exit",
    )
    parser.add_argument("--section", default="", help=argparse.SUPPRESS)  # a child's one
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)  # an mfu row's child
    parser.add_argument("--platform", default="", help=argparse.SUPPRESS)  # the probe's
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; sections: {', '.join(RUNNERS)}")
    sections = [s for s in SECTIONS if not (args.emulate and s.gpu_only)]
    sections = [s for s in sections if not only or s.name in only]
    if args.dry_run:
        print_work(sections, args.quick, args.emulate)
        return 0
    out = check_output_dir(args.out or f"gpucheck-{time.strftime('%Y-%m-%d')}", "--out")
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return _child(args, out)

    from hetjax import xla_env
    from hetjax.config import Config

    for note in xla_env.apply(Config()):  # the children inherit them
        print(f"note: {note}")
    for name, value in compilation_cache().items():  # warm across sections and reruns
        os.environ.setdefault(name, value)
    boxes = time_boxes(sections, args.quick, args.emulate)
    print(
        f"gpucheck: time boxes {' + '.join(f'{k} {v}' for k, v in boxes.items())} = "
        f"{sum(boxes.values())} s at most",
        flush=True,
    )
    t0 = time.perf_counter()
    with stopping_on_signals():
        try:
            if not args.emulate:
                args.platform, why = probe_platform()
                if args.platform in ("", "cpu"):
                    print(_no_gpu_line(args.platform, why), file=sys.stderr, flush=True)
                    return 2
            results = {s.name: _run_section(s, args, out) for s in sections}
        except Stopped as e:
            print(f"gpucheck: stopped by {e}; the running section's processes ended", flush=True)
            return 128 + e.signum
    failed = [n for n, r in results.items() if r == "FAIL"]
    skipped = [n for n, r in results.items() if r == "SKIP"]
    print(
        f"gpucheck: {len(results) - len(failed) - len(skipped)} sections passed, "
        f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
        f"{len(skipped)} skipped{' (' + ', '.join(skipped) + ')' if skipped else ''} "
        f"in {time.perf_counter() - t0:.0f} s; results in {out / 'gpucheck.jsonl'}"
    )
    return 1 if failed else 0


def compilation_cache() -> dict[str, str]:
    """JAX's persistent compilation cache for every section's processes: one directory
    under the system's temp dir (never in ``--out``, whose results it would crowd), so
    the sections after the first and a rerun on the same machine find their programs
    compiled; every program cached, however short its compile."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(Path(tempfile.gettempdir()) / "hetjax-gpucheck-jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def print_work(sections: list[Section], quick: bool, emulate: bool) -> None:
    """``--dry-run``: each section's work and the time box sized from it, and the sum."""
    boxes = time_boxes(sections, quick, emulate)
    limit = QUICK_SECONDS if quick else FULL_SECONDS
    print(
        f"gpucheck --dry-run{' --quick' * quick}{' --emulate' * emulate}: time boxes from "
        f"the work, {START_SECONDS} s a JAX start and {COMPILE_SECONDS:g} s a compile "
        "(cold cache, autotuning included)"
    )
    if "probe" in boxes:
        print(f"  probe: one JAX start asking the backend: {PROBE_SECONDS} s")
    for s in sections:
        work = s.work(quick)
        what = (
            f"{s.emulate_seconds} s (--emulate on a CPU: its measured run)"
            if emulate and s.emulate_seconds
            else work.describe()
        )
        print(f"  {s.name}: {what}; needs {work.ram / GiB:.0f} GiB free RAM")
    total = sum(boxes.values())
    print(f"  total {total} s (at most {limit} s{' on a GPU' * emulate})")


def _child(args, out: Path) -> int:
    timing.install()  # this process's compiles, counted for the driver's line
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
