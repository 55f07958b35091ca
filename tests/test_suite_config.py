"""The suite's own settings (pyproject.toml, .ci/run): CI runs the slow suite after the
default run, a hung test fails with its threads' stacks, an xfail that passes fails."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """Runs pytest with this project's settings on one test file written from ``source``."""
    test = tmp_path / "test_probe.py"
    test.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-n0", "-q"]
        + ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), *args, str(test)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


def test_ci_runs_the_slow_suite_after_the_default_run():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    default = next(i for i, ln in enumerate(lines) if ln.endswith("-m pytest -q"))
    slow = lines.index('.venv/bin/python -m pytest -q -m "slow and not alone"')
    alone = lines.index('.venv/bin/python -m pytest -q -m "slow and alone" -n0')
    assert default < slow < alone


def test_a_hung_test_fails_with_its_threads_stacks(tmp_path, pytestconfig):
    """A test waiting on a thread that never finishes (a deadlock) fails at the limit
    (here 3 s, the project's in pyproject.toml) and prints the thread's stack."""
    source = (
        "import threading\n"
        "def test_hangs():\n"
        "    done = threading.Event()\n"
        "    t = threading.Thread(target=done.wait, name='stuck-loop', daemon=True)\n"
        "    t.start()\n"
        "    t.join()\n"
    )
    proc = _pytest(tmp_path, source, "--timeout=3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout" in out and "stuck-loop" in out, out
    # and the project sets a limit for every test
    assert float(pytestconfig.getini("timeout")) > 0


def test_an_xfail_that_passes_fails_the_run(tmp_path):
    source = "import pytest\n@pytest.mark.xfail(reason='fixed')\ndef test_fixed():\n    pass\n"
    proc = _pytest(tmp_path, source)
    assert proc.returncode == 1 and "XPASS(strict)" in proc.stdout, proc.stdout
