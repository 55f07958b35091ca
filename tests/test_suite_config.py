"""The suite's own settings (pyproject.toml, .ci/run): CI runs the slow suite after the
default run, a hung test fails with its threads' stacks, an xfail that passes fails."""

import subprocess
import sys
from pathlib import Path

import pytest

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


# -- the support matrix's guards (tests/_matrix.py) ----------------------------------------


class _Item:
    """A collected test as tests/_matrix.py reads it."""

    def __init__(self, name: str, *marks, param: str | None = None):
        self.originalname = name
        self.nodeid = f"tests/test_x.py::{name}" + (f"[{param}]" if param else "")
        self.callspec = type("CallSpec", (), {"id": param})() if param else None
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)

    def get_closest_marker(self, name):
        return next(self.iter_markers(name), None)


def test_the_matrix_table_names_each_cells_guards_and_its_gaps():
    import _matrix

    guard = pytest.mark.guards
    items = [
        _Item("test_a", guard(tier="host", parallel="data", ids="h"), param="h"),
        _Item("test_a", guard(tier="host", parallel="data", ids="h"), param="n"),
        _Item("test_b", guard(tier="nvme", parallel=("data", "tensor")), pytest.mark.slow),
    ]
    table = _matrix.guards(items)
    assert [i.nodeid for i in table["host", "data", "float32"]] == ["tests/test_x.py::test_a[h]"]
    assert len(table["nvme", "tensor", "float32"]) == 1 and not table["nvme", "expert", "float32"]
    text = _matrix.markdown(table)
    assert "| host | data | float32 | `tests/test_x.py::test_a` [h] |" in text
    assert "| nvme | tensor | float32 | `tests/test_x.py::test_b` (slow) |" in text
    found = _matrix.problems(table, items)
    assert "unguarded: ('device', 'data', 'float32')" in found
    assert not any("'host', 'data', 'float32'" in line for line in found)
    # a gap that is guarded now must leave GAPS; ids that name no parametrization fail
    gap = next(iter(_matrix.GAPS))
    found = _matrix.problems(
        _matrix.guards([_Item("test_c", guard(tier=gap[0], parallel=gap[1], dtype=gap[2]))]), []
    )
    assert any("guarded now" in line for line in found)
    renamed = [_Item("test_a", guard(tier="host", parallel="data", ids="old"), param="new")]
    assert any("names no test: ['old']" in line for line in _matrix.unknown_ids(renamed))
    for bad in (dict(tier="ram", parallel="data"), dict(tier="device", parallel="single")):
        with pytest.raises(ValueError):
            _matrix.cells_of(_Item("test_d", guard(**bad)))


@pytest.mark.slow  # collects every test (~10 s of CPU)
def test_every_cell_of_the_support_matrix_has_a_guard_in_ci():
    """Each (tier, parallelism, dtype) cell has a test that fails when its equivalence
    breaks, or is one of tests/_matrix.py's listed gaps (``python tests/_matrix.py``
    prints the table)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_matrix.py"), "--check"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| host | single | float32 |" in proc.stdout


def test_the_compilation_cache_writes_entries_whole(tmp_path, monkeypatch):
    """The one cache every process of a run shares (tests/_cache.py): an entry appears
    whole, by a rename, never written in place where another process could read it
    half-written; an existing entry stays."""
    from jax._src import lru_cache

    assert getattr(lru_cache.LRUCache.put, "writes_whole", False)  # conftest patched it
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    entry = tmp_path / "k-cache"
    written = []
    path_type = type(cache.path)  # pathlib's, or etils' where it is installed
    write_bytes = path_type.write_bytes

    def recording(path, data):
        written.append(str(path))
        assert not entry.exists()
        return write_bytes(path, data)

    monkeypatch.setattr(path_type, "write_bytes", recording)
    cache.put("k", b"whole entry")
    assert written and str(entry) not in written  # written elsewhere, renamed into place
    cache.put("k", b"another")
    assert cache.get("k") == b"whole entry"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k-cache"]
