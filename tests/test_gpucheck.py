"""``python -m hetjax.gpucheck`` (issue #19 item 8) on a CPU: the driver (a child per
section, time boxes, resource checks, PASS/FAIL lines and gpucheck.jsonl), the sections
that run here, and ``--emulate`` (the equivalence section through two JAX clients)."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import pytest

from hetjax import gpucheck
from hetjax.config_values import format_bytes
from hetjax.gpucheck import training
from hetjax.gpucheck.common import GiB

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetjax.gpucheck", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def rows(out: Path) -> dict[str, dict]:
    lines = (out / "gpucheck.jsonl").read_text().splitlines()
    return {f"{r['section']}.{r['check']}": r for r in map(json.loads, lines)}


def test_a_cpu_without_emulate_stops_at_once_naming_the_install(tmp_path):
    """No GPU and no --emulate: exit 2 within a minute, one line naming the install,
    nothing run (never a model trained on the CPU by accident)."""
    t0 = time.perf_counter()
    proc = run("--out", str(tmp_path), env={"JAX_PLATFORMS": "cpu"})
    assert time.perf_counter() - t0 < 60
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpucheck: no GPU: JAX's backend here is cpu (JAX_PLATFORMS=cpu)")
    assert "pip install -e '.[cuda13]'" in line and "--emulate" in line
    assert not (tmp_path / "gpucheck.jsonl").exists()
    boxes = gpucheck.time_boxes(gpucheck.SECTIONS, quick=False)
    printed = " + ".join(f"{k} {v}" for k, v in boxes.items())
    total = sum(boxes.values())
    assert f"gpucheck: time boxes {printed} = {total} s at most" in proc.stdout  # at start


def test_the_time_boxes_fit_one_call_on_a_lent_machine():
    """A lent machine allows 600 s a call, its start included: the boxes' sum (the
    backend probe's too) fits 540 s, and 300 s with --quick. Each box is its section's
    work: JAX starts and compiles at the stated allowances, plus its run time."""
    full = gpucheck.time_boxes(gpucheck.SECTIONS, quick=False)
    quick = gpucheck.time_boxes(gpucheck.SECTIONS, quick=True)
    assert sum(full.values()) <= gpucheck.FULL_SECONDS == 540
    assert sum(quick.values()) <= gpucheck.QUICK_SECONDS == 300
    assert list(full) == ["probe", *gpucheck.RUNNERS]
    for s in gpucheck.SECTIONS:
        for fast in (True, False):
            w = s.work(fast)
            compiling = w.compiles * gpucheck.COMPILE_SECONDS / w.parallel
            assert s.box(fast) == math.ceil(w.starts * gpucheck.START_SECONDS + compiling + w.run)
        assert s.work(True).seconds() <= s.work(False).seconds()  # --quick: no more work
    memory = next(s for s in gpucheck.SECTIONS if s.name == "memory")
    assert memory.box(True) < memory.box(False)  # --quick honoured there too
    # --emulate on a CPU: no probe, and the equivalence section's own box (no lent call)
    equivalence = [s for s in gpucheck.SECTIONS if s.name == "equivalence"]
    assert gpucheck.time_boxes(equivalence, quick=False, emulate=True) == {"equivalence": 480}


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_a_dry_run_prints_each_sections_work_and_box(quick):
    """``--dry-run``: per section the JAX starts and compiles it will do and the box
    sized from them, the total within the lent call's limit; nothing runs (no --out)."""
    proc = run("--dry-run", *["--quick"] * quick)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for s in gpucheck.SECTIONS:
        w = s.work(quick)
        (line,) = [ln for ln in lines if ln.startswith(f"  {s.name}: ")]
        assert f"{w.compiles} compiles x {gpucheck.COMPILE_SECONDS:g} s" in line, line
        assert f"= {s.box(quick)} s;" in line and f"{w.starts} JAX start(s)" in line, line
    total = sum(gpucheck.time_boxes(gpucheck.SECTIONS, quick).values())
    limit = gpucheck.QUICK_SECONDS if quick else gpucheck.FULL_SECONDS
    assert f"  total {total} s (at most {limit} s)" in lines and total <= limit


def test_the_compilation_cache_is_one_directory_outside_out():
    cache = gpucheck.compilation_cache()
    where = Path(cache["JAX_COMPILATION_CACHE_DIR"])
    assert where.parent == Path(tempfile.gettempdir())
    assert cache["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"  # every program


def section(name: str, out: Path, *args: str, env: dict[str, str] | None = None):
    """One section's child process, as the driver starts it on a GPU machine."""
    return run("--section", name, "--out", str(out), *args, env=env)


def test_sections_on_a_cpu_say_what_passes_and_what_needs_a_gpu(tmp_path):
    procs = [section(name, tmp_path) for name in ("environment", "placement", "memory")]
    got = rows(tmp_path)
    assert procs[0].returncode == procs[1].returncode == procs[2].returncode == 0
    assert got["environment.device"]["status"] == "FAIL"  # a CPU is not an accelerator
    assert "(cpu)" in got["environment.device"]["line"]
    assert got["environment.memory_kinds"]["status"] == "PASS"  # device and pinned_host
    assert got["environment.native_kernel"]["status"] == "PASS"
    assert got["environment.bytes_limit"]["status"] == "SKIP"
    assert "XLA_CLIENT_MEM_FRACTION" in got["environment.bytes_limit"]["line"]
    for via in ("pinned_host", "host_optimizer"):
        for dtype in ("float32", "bfloat16"):
            assert got[f"placement.round_trip_{dtype}_{via}"]["status"] == "PASS"
    assert got["placement.zero_copy_view"]["status"] == "PASS", got["placement.zero_copy_view"]
    assert got["memory.device_budget"]["status"] == "SKIP"
    stdout = "".join(p.stdout for p in procs)
    for row in got.values():  # one printed line per row, in the same words
        assert f"{row['status']}  {row['section']}.{row['check']}: {row['line']}" in stdout


def test_the_native_kernel_is_skipped_without_a_compiler(tmp_path):
    env = {"PATH": str(tmp_path / "empty"), "CXX": ""}  # no g++, c++ or clang++
    proc = section("environment", tmp_path, env=env)
    row = rows(tmp_path)["environment.native_kernel"]
    assert row["status"] == "SKIP" and "no C++ compiler" in row["line"], proc.stderr


@pytest.mark.slow  # 12 s: the code paths of sections whose figures need a GPU
def test_bandwidth_and_overlap_measure_every_path(tmp_path):
    """On a CPU the figures mean nothing (one memory, no copy engines); the code paths
    run and every check reports its figure."""
    procs = [section(name, tmp_path, "--quick") for name in ("bandwidth", "overlap")]
    output = "".join(p.stdout + p.stderr for p in procs)
    got = rows(tmp_path)
    checks = ["h2d_pinned", "h2d_pages", "h2d_pageable", "d2h_pinned", "d2h_pages"]
    checks += ["d2h_pageable", "duplex", "publish"]
    for check in checks:
        assert got[f"bandwidth.{check}"]["status"] in ("PASS", "FAIL"), output
    assert got["bandwidth.publish"]["cross_client_gbs"] > 0
    assert got["overlap.compute_under_copies"]["alone_s"] > 0, output
    assert got["overlap.compute_under_copies"]["copy_bytes"] >= 16 << 20  # sized to the chain


def _work(run: int = 0, ram: int = 0, starts: int = 0) -> gpucheck.Work:
    return gpucheck.Work(starts=starts, compiles=0, run=run, ram=ram)


def test_a_section_past_its_time_box_fails(tmp_path):
    args = Namespace(quick=False, emulate=False)
    # JAX's import alone takes longer
    box = gpucheck.Section(name="overlap", quick=_work(1), full=_work(1), disk=0)
    assert gpucheck._run_section(box, args, tmp_path) == "FAIL"
    assert rows(tmp_path)["overlap.time_box"]["line"] == "did not finish within 1 s"


# A section that sleeps, having started a grandchild that sleeps too (as pytest's
# workers and the mfu rows are); it writes both pids, then waits to be ended.
SLEEPER = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
# The driver's part that a signal reaches: one section, under stopping_on_signals
DRIVER = """
import sys
from argparse import Namespace
from pathlib import Path
from hetjax import gpucheck
out, box = Path(sys.argv[1]), int(sys.argv[2])
work = gpucheck.Work(starts=0, compiles=0, run=box, ram=0)
section = gpucheck.Section(
    name="overlap", quick=work, full=work, disk=0,
    command=(sys.executable, "-c", sys.argv[3], str(out / "pids")),
)
with gpucheck.stopping_on_signals():
    try:
        print(gpucheck._run_section(section, Namespace(quick=False, emulate=False), out))
    except gpucheck.Stopped as e:
        sys.exit(128 + e.signum)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for init to reap does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _driver(out: Path, box: int) -> tuple[subprocess.Popen, list[int]]:
    """The driver (its output in ``out/driver.log``: a pipe would stay open as long as
    an orphaned section's process holds it) and its section's and grandchild's pids."""
    with open(out / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(out), str(box), SLEEPER],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out / "pids").exists():
        assert time.monotonic() < deadline and driver.poll() is None, _log(out)
        time.sleep(0.05)
    return driver, [int(p) for p in (out / "pids").read_text().split()]


def _log(out: Path) -> str:
    return (out / "driver.log").read_text()


def _end(pids: list[int]) -> list[int]:
    """Ends those of ``pids`` still running (a failed test leaves none behind); returns
    them."""
    running = [pid for pid in pids if _running(pid)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    return running


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_to_gpucheck_ends_the_sections_whole_group(tmp_path, signum):
    """SIGTERM or SIGINT to the driver reach the running section (a session of its
    own, out of the terminal's reach) and everything it started: the driver leaves
    only once its grandchild too has gone (it would hold the GPU for hours)."""
    driver, pids = _driver(tmp_path, 600)
    assert all(_running(pid) for pid in pids)
    driver.send_signal(signum)
    try:
        code = driver.wait(timeout=60)
    finally:
        driver.kill()  # (gone already where the test passes)
        left = _end(pids)
    assert code == 128 + signum, _log(tmp_path)
    assert not left, f"the section's processes {left} outlived the driver"


def test_a_time_box_ends_the_sections_whole_group(tmp_path):
    driver, pids = _driver(tmp_path, 3)
    try:
        assert driver.wait(timeout=60) == 0, _log(tmp_path)
    finally:
        left = _end(pids)
    assert not left and _log(tmp_path).splitlines()[-1] == "FAIL", _log(tmp_path)
    assert rows(tmp_path)["overlap.time_box"]["line"] == "did not finish within 3 s"


def test_a_section_without_the_ram_it_needs_is_skipped_saying_so(tmp_path):
    args = Namespace(quick=False, emulate=False)
    huge = gpucheck.Section(name="mfu", quick=_work(60), full=_work(60, ram=1 << 50), disk=0)
    assert gpucheck._run_section(huge, args, tmp_path) == "SKIP"
    assert "needs 1048576 GiB free RAM" in rows(tmp_path)["mfu.resources"]["line"]


def test_the_mfu_section_needs_the_ram_its_rows_hold():
    """Not 80 GiB whatever it runs: the offloaded row's state (16 bytes a parameter)
    and a process's; --quick's rows need a fraction of the full rows'."""
    mfu = next(s for s in gpucheck.SECTIONS if s.name == "mfu")
    quick, full = (mfu.work(q).ram for q in (True, False))
    s = gpucheck.MFU_SHAPES[False]
    params = s["layers"] * 12 * s["d"] ** 2 + 2 * 50257 * s["d"]
    assert full == params * 16 + gpucheck.PROCESS_RAM
    assert quick < 10 * GiB < full < 64 * GiB


def test_the_row_beyond_the_pool_is_sized_from_the_pool():
    """A sixteenth of an H200's pool (--quick): its state 1.5x that pool, in host RAM,
    about 18 GiB; the row checks that much is free before it trains."""
    pool = int(0.9 * (143_771 << 20) / 16)
    beyond = training._beyond_pool(gpucheck.MFU_SHAPES[True], pool)
    per_layer = 12 * 1024**2 * 16  # a d1024 block's fp32 state, gradient included
    assert 1.5 * pool - per_layer < beyond["state_bytes"] <= 1.5 * pool
    assert 15 * GiB < beyond["ram"] < 20 * GiB


def test_the_memory_sections_run_streams_its_blocks():
    """Its blocks' bf16 params alone exceed its device budget (the run before streamed
    nothing: all 8 d1024 blocks fit under 2 GiB), and a plan for an H200 under that
    budget keeps at most one block resident."""
    from hetjax.config import Config
    from hetjax.planning.hardware import PROFILES
    from hetjax.planning.search import make_plan

    m, budget = gpucheck.MEMORY_RUN, gpucheck.MEMORY_BUDGET
    assert 2 * m["layers"] * 12 * m["d"] ** 2 > budget
    config = Config().replace(
        model=dict(
            num_layers=m["layers"], d_model=m["d"], num_heads=m["heads"], vocab_size=m["vocab"],
            max_seq_len=m["seq"], compute_dtype="bfloat16",
        ),
        train=dict(batch_size=m["batch"], seq_len=m["seq"]),
        offload=dict(mode="stream"),
        memory=dict(device_budget=budget),
    )  # fmt: skip
    plan = make_plan(config, PROFILES["h200"])
    assert plan.candidate.mode == "stream" and plan.candidate.placement.resident_blocks <= 1


def test_unknown_section_is_a_clear_error(tmp_path):
    proc = run("--only", "bandwith", "--out", str(tmp_path))
    assert proc.returncode == 2 and "unknown section(s) bandwith; sections: " in proc.stderr


@pytest.mark.slow
def test_emulate_passes_on_a_cpu(tmp_path):
    """What issue #19 asks of a CPU machine: ``--emulate`` runs the equivalence section
    through the two-client topology and exits 0."""
    proc = run("--emulate", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = rows(tmp_path)
    assert set(got) == {"equivalence.tests", "equivalence.bf16_streaming_trains"}
    assert "passed" in got["equivalence.tests"]["line"]
    assert "gpucheck: 1 sections passed, 0 failed" in proc.stdout


@pytest.mark.slow  # compiles two stage function sets; on a GPU gpucheck runs it
def test_working_set_check_reports_estimate_and_compiled(tmp_path):
    """gpucheck's working-set check (the memory section's, run on a GPU there) on this
    CPU at a small shape: one line per chunk count with both figures, failing where the
    estimate is below WORKING_SET_LOW of the compiled size (at this shape the CPU fit's
    4-chunk estimate lies near that edge)."""
    from hetjax.gpucheck.common import Report
    from hetjax.gpucheck.training import working_set

    working_set(Report(tmp_path, "memory"), "cpu", d_model=256, batch=4, seq=256)
    rows = [json.loads(line) for line in (tmp_path / "gpucheck.jsonl").read_text().splitlines()]
    assert [r["check"] for r in rows] == ["working_set_1_chunks", "working_set_4_chunks"]
    for r in rows:  # (the PASS / FAIL rule on figures picked by hand: the test below)
        assert r["estimate"] > 0 and r["status"] in ("PASS", "FAIL"), r
        assert f"compiled {format_bytes(r['compiled'])}" in r["line"], r
    assert rows[1]["compiled"] < rows[0]["compiled"]  # the chunks' working set is smaller


class _Compiled:
    """Stands for ``StageFunctions``: its working set, by chunk count, as given."""

    working_sets: dict[int, int] = {}

    def __init__(self, model, layouts, placement, *, block_grad_dtype, batch_chunks):
        self.chunks = batch_chunks

    def memory_sizes(self, batch, seq, dtype):
        return Namespace(working_set=self.working_sets[self.chunks])


@pytest.mark.parametrize(
    "estimates, compiled, statuses",
    [
        # 760 / 1000 = 0.76x and 200 / 250 = 0.8x: inside 0.75x-1.5x, both pass
        ({1: 760, 4: 200}, {1: 1000, 4: 250}, ["PASS", "PASS"]),
        # 749 / 1000 under 0.75x fails; 750 / 1000, exactly 0.75x, passes
        ({1: 749, 4: 750}, {1: 1000, 4: 1000}, ["FAIL", "PASS"]),
        # 1.5x exactly passes; above it, the plan wastes a third of the device: fails
        ({1: 1500, 4: 151}, {1: 1000, 4: 100}, ["PASS", "FAIL"]),
        ({1: 2000, 4: 10}, {1: 1000, 4: 100}, ["FAIL", "FAIL"]),
    ],
    ids=["both_inside", "low_edge", "high_edge", "over_and_under"],
)
def test_the_working_set_check_fails_outside_its_band(
    tmp_path, monkeypatch, estimates, compiled, statuses
):
    """The working-set check's rule on figures picked by hand (no compilation): it
    reports the ratio of the planner's estimate to XLA's compiled working set and fails
    only outside the stated band (0.75x-1.5x)."""
    from hetjax.gpucheck.common import Report
    from hetjax.gpucheck.training import working_set
    from hetjax.planning.workload import Workload
    from hetjax.runtime.stages import functions as stages

    monkeypatch.setattr(_Compiled, "working_sets", compiled)
    monkeypatch.setattr(stages, "StageFunctions", _Compiled)
    estimate = lambda config, backend: Namespace(working_set=estimates[config.offload.batch_chunks])
    monkeypatch.setattr(Workload, "from_config", estimate)
    working_set(Report(tmp_path, "memory"), "cpu", d_model=64, batch=4, seq=32)
    got = rows(tmp_path).values()
    assert [r["status"] for r in got] == statuses
    assert training.WORKING_SET_BAND == (0.75, 1.5)
    for r in got:
        ratio = estimates[r["chunks"]] / compiled[r["chunks"]]
        assert r["ratio"] == ratio and f"{ratio:.2f}x (band 0.75x-1.5x)" in r["line"]


# -- the memory fraction's two names (jaxlib >= 0.7 refuses both at once) ----------------


@pytest.mark.parametrize(
    "given, after",
    [
        ({}, {"XLA_CLIENT_MEM_FRACTION": "0.9"}),  # neither: the new name
        ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_CLIENT_MEM_FRACTION": "0.5"}),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}),
        (
            {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
            {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
        ),
    ],
    ids=["neither", "new", "old", "both"],
)
def test_the_memory_fraction_is_set_only_where_neither_name_is(given, after):
    from hetjax import xla_env
    from hetjax.config import Config

    pinned = {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": xla_env.wanted(Config())[xla_env.PINNED_LIMIT]}
    environ = {**given, **pinned}
    notes = xla_env.apply(Config(), environ)
    assert environ == {**after, **pinned}
    # a value other than the config's (0.9 by default) is said, under its own name
    assert notes == [
        f"{k}={v} from the environment (the config asks 0.9)"
        for k, v in given.items()
        if v != "0.9"
    ]
    assert xla_env.mem_fraction(environ) == float(next(iter(after.values())))


def test_gpucheck_reads_both_names_and_a_child_gets_one():
    from hetjax import xla_env

    assert xla_env.mem_fraction({}) is None
    assert xla_env.mem_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}) == 0.6
    assert xla_env.mem_fraction({"XLA_CLIENT_MEM_FRACTION": "0.7"}) == 0.7
    old = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6", "PATH": "/bin"}
    assert xla_env.mem_fraction_setting(old) == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.6"
    assert xla_env.mem_fraction_setting({}) == "XLA_CLIENT_MEM_FRACTION unset"
    child = xla_env.with_mem_fraction(0.225, old)
    assert child == {"XLA_CLIENT_MEM_FRACTION": "0.225", "PATH": "/bin"}


# -- what the checks on a GPU compare ------------------------------------------------------


def test_the_mfu_floor_hides_the_optimizer_under_the_backward_only():
    """Sync mode: the next forward waits for the update, so an offloaded step is at
    least the forward (a third of the in-HBM step) plus the longer of the backward and
    the host optimizer's work: 0.8 while the optimizer fits under the backward."""
    assert pytest.approx(1 / 3) == training.FORWARD_SHARE
    assert gpucheck.mfu_floor(0.3, 0.2) == gpucheck.MFU_RATIO == 0.8  # 0.2 s = the backward
    assert gpucheck.mfu_floor(0.3, 0.0) == 0.8  # no host optimizer work recorded
    # 0.1 s forward + 0.5 s optimizer: 0.8 x 0.3 / 0.6 (full overlap would say 0.48)
    assert gpucheck.mfu_floor(0.3, 0.5) == pytest.approx(0.4)


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_the_equivalence_selection_has_a_bf16_streamed_vs_in_memory_test(quick):
    """gpucheck's selection, quick or full, collects the bf16 NVMe-tier test (in the
    default run: under the default marker selection) and the bit-exact deferred-update
    test where it runs the deferred file."""
    path, name = gpucheck.BF16_EQUIVALENCE.split("::")
    assert (ROOT / path).is_file() and "bfloat16-nvme" in name
    args = [a for a in gpucheck.equivalence_tests(quick) if a not in ("--dist", "load")]
    args = ["-n0" if a == "-n" else a for a in args if a != str(training.PYTEST_WORKERS)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"] + args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and gpucheck.BF16_EQUIVALENCE in proc.stdout, proc.stdout
    deferred = "test_deferred_equals_updating_every_expert_and_moves_fewer_bytes[8-nvme-float32]"
    assert (deferred in proc.stdout) is not quick
    assert "test_slab_optimizer_equals_optax_on_the_pytree[chunks-adamw" in proc.stdout or quick


# -- tests that assume the CPU backend are deselected on an accelerator --------------------


class _Item:
    def __init__(self, name: str, cpu_only: bool):
        self.name, self.cpu_only = name, cpu_only

    def get_closest_marker(self, name: str):
        return object() if name == "cpu_only" and self.cpu_only else None


def test_cpu_only_tests_are_deselected_on_an_accelerator():
    from conftest import cpu_only_deselected

    items = [_Item("a", False), _Item("b", True)]
    for platforms in ("cpu", "cpu,cuda"):
        assert cpu_only_deselected(items, platforms) == (items, [])
    for platforms in ("cuda,cpu", "gpu", "tpu"):
        assert cpu_only_deselected(items, platforms) == ([items[0]], [items[1]])


def test_the_cpu_only_tests_are_the_cpu_backends():
    """The marked tests, collected with JAX_PLATFORMS naming a GPU first: deselected."""
    marked = [
        "test_a_cpu_without_emulation_does_not_stage",
        "test_zero3_steps_have_no_implicit_transfers[host]",
        "test_zero3_steps_have_no_implicit_transfers[nvme]",
    ]
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    args += ["-n0", "-m", "slow or not slow", "tests/test_two_client.py"]
    collected = {}
    for platforms in ("cpu", "cuda,cpu"):
        env = {**os.environ, "JAX_PLATFORMS": platforms}
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        collected[platforms] = proc.stdout
    for name in marked:
        assert f"::{name}" in collected["cpu"] and f"::{name}" not in collected["cuda,cpu"]
    assert f"{len(marked)} deselected" in collected["cuda,cpu"]


TINY_MFU = dict(d=32, heads=4, seq=16, batch=4, layers=2, steps=3, skip=1)


@pytest.mark.slow  # two tiny trainings (the rows' code path; their figures need a GPU)
def test_mfu_rows_report_their_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "_mfu_shape", lambda quick: TINY_MFU)
    run = gpucheck.Run(quick=True, emulate=False, out=tmp_path)
    hbm, off = (gpucheck.mfu_row(row, run) for row in ("in_hbm", "offloaded"))
    assert (hbm["mode"], off["mode"]) == ("none", "stream")
    assert hbm["s_per_step"] > 0 and off["tflops"] > 0
    assert off["optimizer_busy_s"] > 0 and hbm["optimizer_busy_s"] == 0  # the host's work
    assert hbm["tokens_per_step"] == off["tokens_per_step"] == 4 * 16  # like with like
    assert hbm["attention"] == off["attention"] == "blockwise"  # (a CPU: no cuDNN)
    assert Path(off["timeline"]).is_file()
    # a CPU reports no pool: the row beyond it cannot be sized
    assert gpucheck.mfu_row("beyond_pool", run) == {"skip": "no bytes_limit: the pool is unknown"}


def test_mfu_states_the_ratio_and_its_floor(tmp_path, monkeypatch):
    """The section's lines from its rows' figures (each row a child on a GPU)."""
    same = dict(tokens_per_step=16384, attention="fused (cuDNN)")
    figures = {
        "in_hbm": dict(tflops=400.0, mfu=0.4, s_per_step=0.4, optimizer_busy_s=0.0, **same),
        "offloaded": dict(tflops=120.0, mfu=0.12, s_per_step=1.3, optimizer_busy_s=1.2, **same),
        "beyond_pool": dict(
            tflops=100.0, mode="stream", layers=9, pool_bytes=18 << 30, state_bytes=29 << 30,
            **same,
        ),
    }  # fmt: skip
    envs = {}

    def child(row, run, env=None):
        envs[row] = env
        return figures[row]

    monkeypatch.setattr(training, "_mfu_child", child)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    gpucheck.mfu(gpucheck.Report(tmp_path, "mfu"), gpucheck.Run(False, False, tmp_path))
    got = rows(tmp_path)
    ratio = got["mfu.offloaded_vs_in_hbm"]
    # 120 / 400 = 0.30x against 0.8 x 0.4 / (0.4 / 3 + 1.2) = 0.24x: the optimizer
    # bounds the step
    assert ratio["status"] == "PASS" and "0.30x (floor 0.24x" in ratio["line"], ratio["line"]
    assert "16384 tokens a step each" in ratio["line"] and "fused (cuDNN)" in ratio["line"]
    assert got["mfu.beyond_pool"]["status"] == "PASS"
    assert envs["beyond_pool"]["XLA_CLIENT_MEM_FRACTION"] == "0.225"  # a quarter of 0.9
    assert envs["in_hbm"] is None  # the whole pool, from this process's environment


# -- deterministic ops, the runtime's copy sizes ------------------------------------------


def test_deterministic_ops_are_probed_in_a_child_before_use(tmp_path, monkeypatch):
    """XLA aborts on a flag it does not know: the equivalence section adds
    ``--xla_gpu_exclude_nondeterministic_ops`` to the tests' XLA_FLAGS only after a
    child process started JAX with it; a flag XLA refuses leaves the flags as they
    were, with a SKIP line saying why."""
    from hetjax.gpucheck.common import DETERMINISTIC_OPS, Report

    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    got = training._deterministic(Report(tmp_path, "equivalence"), env)
    assert got["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {DETERMINISTIC_OPS}"
    assert rows(tmp_path)["equivalence.deterministic_ops"]["status"] == "PASS"
    bogus = "--xla_gpu_no_such_flag=true"
    monkeypatch.setattr(training, "DETERMINISTIC_OPS", bogus)
    assert training._deterministic(Report(tmp_path, "equivalence"), env) is env
    row = rows(tmp_path)["equivalence.deterministic_ops"]
    assert row["status"] == "SKIP" and "no_such_flag" in row["line"], row


def test_bandwidth_moves_the_sizes_the_runtime_moves():
    """A d4096 bf16 block: its 12 params leaves to the device (its largest 128 MiB),
    its gradient back as 193 pages of the default 4 MiB fp32 page's bf16 half."""
    from hetjax.gpucheck.transfer import runtime_copies

    copies = runtime_copies(4096, 32)
    assert len(copies["h2d"]) == 12 and max(copies["h2d"]) == 4096 * 16384 * 2
    assert len(copies["d2h"]) == 193 and set(copies["d2h"]) == {1_043_456 * 2}
    assert sum(copies["d2h"]) >= sum(copies["h2d"]) == 12 * 4096**2 * 2 + 13 * 4096 * 2
