"""``python -m hetjax.gpucheck`` (issue #19 item 8) on a CPU: the driver (a child per
section, time boxes, resource checks, PASS/FAIL lines and gpucheck.jsonl), the sections
that run here, and ``--emulate`` (the equivalence section through two JAX clients)."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from hetjax import gpucheck

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetjax.gpucheck", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def rows(out: Path) -> dict[str, dict]:
    lines = (out / "gpucheck.jsonl").read_text().splitlines()
    return {f"{r['section']}.{r['check']}": r for r in map(json.loads, lines)}


def test_sections_on_a_cpu_say_what_passes_and_what_needs_a_gpu(tmp_path):
    proc = run("--only", "environment,placement,memory", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a CPU is not an accelerator
    got = rows(tmp_path)
    assert got["environment.device"]["status"] == "FAIL"
    assert "(cpu)" in got["environment.device"]["line"]
    assert got["environment.memory_kinds"]["status"] == "PASS"  # device and pinned_host
    assert got["environment.native_kernel"]["status"] == "PASS"
    assert got["environment.bytes_limit"]["status"] == "SKIP"
    for via in ("pinned_host", "host_optimizer"):
        for dtype in ("float32", "bfloat16"):
            assert got[f"placement.round_trip_{dtype}_{via}"]["status"] == "PASS"
    assert got["memory.device_budget"]["status"] == "SKIP"
    for row in got.values():  # one printed line per row, in the same words
        assert f"{row['status']}  {row['section']}.{row['check']}: {row['line']}" in proc.stdout
    assert "gpucheck: 1 sections passed, 1 failed (environment), 1 skipped (memory)" in proc.stdout


@pytest.mark.slow  # 12 s: the code paths of sections whose figures need a GPU
def test_bandwidth_and_overlap_measure_every_path(tmp_path):
    """On a CPU the figures mean nothing (one memory, no copy engines); the code paths
    run and every check reports its figure."""
    proc = run("--only", "bandwidth,overlap", "--quick", "--out", str(tmp_path))
    got = rows(tmp_path)
    checks = ["h2d_pinned", "h2d_pages", "h2d_pageable", "d2h_pinned", "d2h_pages"]
    checks += ["d2h_pageable", "duplex", "publish"]
    for check in checks:
        assert got[f"bandwidth.{check}"]["status"] in ("PASS", "FAIL"), proc.stdout
    assert got["bandwidth.publish"]["cross_client_gbs"] > 0
    assert got["overlap.compute_under_copies"]["alone_s"] > 0, proc.stdout + proc.stderr


def test_a_section_past_its_time_box_fails(tmp_path):
    args = Namespace(quick=False, emulate=False)
    box = gpucheck.Section("overlap", 1, 0, 0)  # JAX's import alone takes longer
    assert gpucheck._run_section(box, args, tmp_path) == "FAIL"
    assert rows(tmp_path)["overlap.time_box"]["line"] == "did not finish within 1 s"


def test_a_section_without_the_ram_it_needs_is_skipped_saying_so(tmp_path):
    args = Namespace(quick=False, emulate=False)
    huge = gpucheck.Section("mfu", 60, 1 << 50, 0)
    assert gpucheck._run_section(huge, args, tmp_path) == "SKIP"
    assert "needs 1048576 GiB free RAM" in rows(tmp_path)["mfu.resources"]["line"]


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
    from hetjax.gpucheck import Report, working_set

    working_set(Report(tmp_path, "memory"), "cpu", d_model=256, batch=4, seq=256)
    rows = [json.loads(line) for line in (tmp_path / "gpucheck.jsonl").read_text().splitlines()]
    assert [r["check"] for r in rows] == ["working_set_1_chunks", "working_set_4_chunks"]
    from hetjax.gpucheck import WORKING_SET_LOW

    for r in rows:
        low = r["estimate"] < WORKING_SET_LOW * r["compiled"]
        assert r["estimate"] > 0 and r["status"] == ("FAIL" if low else "PASS"), r
    assert rows[1]["compiled"] < rows[0]["compiled"]  # the chunks' working set is smaller
