"""Which test guards which equivalence of the support matrix (issue #56): a cell is a
tier, a parallelism (``hetjax/support.py``'s ``PARALLELISMS``) and a compute dtype
(``hetjax/config_model.py``'s ``DTYPES``); a test that fails when training in that cell
stops equalling its reference marks itself

    @pytest.mark.guards(tier="nvme", parallel="data")              # float32
    @pytest.mark.guards(tier="host", parallel="tensor", ids=("tp2", "tp4"))

(``tier``, ``parallel`` and ``dtype`` a name or a tuple of names; ``ids``: only those
parametrizations of the test guard the cells). The table is generated from the tests'
markers, never written by hand: ``python tests/_matrix.py`` collects every test (the
default run's and the slow suite's: CI runs both) and prints it; ``--check`` also fails
where a cell has no guard and is not in :data:`GAPS`, or where a gap has one now.

Tiers: where the run's state lives. ``device``: ``offload.mode=none`` (the whole state on
the device, one jitted step); ``host``: streamed, the params and the optimizer state in
host RAM; ``nvme``: streamed, the optimizer state (and the params, or not) on NVMe. The
reference of every equivalence is the one-device in-memory run in the same dtype, so
(``device``, ``single``) is no cell: its own checks are against transformers and numpy.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import sys

from hetjax.config_model import DTYPES
from hetjax.support import PARALLELISMS, SINGLE

TIERS = ("device", "host", "nvme")
MARKER = "guards"
HELP = (
    f"{MARKER}(tier=, parallel=, dtype='float32', ids=()): the support matrix's cells this "
    "test fails in when their equivalence breaks (tests/_matrix.py)"
)
# Cells without a guard, and why: --check fails on a new one and on one guarded now.
_LOW = ("bfloat16", "float16")
_SHARDED = tuple(p for p in PARALLELISMS if p != SINGLE)
GAPS = {
    (tier, parallel, dtype): "no equivalence test trains in a 16-bit compute dtype on a mesh"
    for tier in TIERS
    for parallel in _SHARDED
    for dtype in _LOW
}


def all_cells() -> list[tuple[str, str, str]]:
    return [
        (t, p, d)
        for t, p, d in itertools.product(TIERS, PARALLELISMS, DTYPES)
        if (t, p) != ("device", SINGLE)
    ]


def _names(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def cells_of(item) -> set[tuple[str, str, str]]:
    """The cells ``item`` (a collected test) guards; raises ValueError naming a marker
    that names an unknown tier, parallelism, dtype or parametrization."""
    cells: set[tuple[str, str, str]] = set()
    for mark in item.iter_markers(MARKER):
        if mark.args or set(mark.kwargs) - {"tier", "parallel", "dtype", "ids"}:
            raise ValueError(f"{item.nodeid}: {HELP}")
        tiers = _names(mark.kwargs.get("tier", ()))
        parallels = _names(mark.kwargs.get("parallel", ()))
        dtypes = _names(mark.kwargs.get("dtype", "float32"))
        for value, known in ((tiers, TIERS), (parallels, PARALLELISMS), (dtypes, DTYPES)):
            if not value or set(value) - set(known):
                raise ValueError(f"{item.nodeid}: {value} not among {known}: {HELP}")
        ids = _names(mark.kwargs.get("ids", ()))
        callspec = getattr(item, "callspec", None)
        if ids and callspec is None:
            raise ValueError(f"{item.nodeid}: ids= {ids} on a test without parameters")
        if ids and callspec.id not in ids:
            continue
        new = set(itertools.product(tiers, parallels, dtypes))
        if ("device", SINGLE) in {(t, p) for t, p, _ in new}:
            raise ValueError(f"{item.nodeid}: (device, single) is the reference, not a cell")
        cells |= new
    return cells


def check_items(items) -> None:
    """At collection (tests/conftest.py): every marker names known cells."""
    for item in items:
        cells_of(item)


def unknown_ids(items) -> list[str]:
    """Markers whose ``ids`` name no parametrization of their test (all of ``items``
    collected: a renamed parametrization leaves its cell unguarded)."""
    wanted: dict[str, set[str]] = {}
    seen: dict[str, set[str]] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        key = f"{item.nodeid.split('::')[0]}::{item.originalname}"
        seen.setdefault(key, set()).add(callspec.id if callspec else "")
        for mark in item.iter_markers(MARKER):
            wanted.setdefault(key, set()).update(_names(mark.kwargs.get("ids", ())))
    return [
        f"{k}: guards(ids=) names no test: {sorted(v - seen[k])}"
        for k, v in wanted.items()
        if v - seen[k]
    ]


def guards(items) -> dict[tuple[str, str, str], list]:
    """Each cell's guards among ``items``."""
    table: dict[tuple[str, str, str], list] = {c: [] for c in all_cells()}
    for item in items:
        for cell in cells_of(item):
            table[cell].append(item)
    return table


def _cell_text(tests) -> str:
    """A cell's guards, one test function a line with its parametrizations; ``(slow)``
    where none of them is in the default run."""
    by_test: dict[str, list] = {}
    for item in tests:
        by_test.setdefault(f"{item.nodeid.split('::')[0]}::{item.originalname}", []).append(item)
    lines = []
    for name, items in sorted(by_test.items()):
        ids = [i.callspec.id for i in items if getattr(i, "callspec", None)]
        slow = all(i.get_closest_marker("slow") for i in items)
        lines.append(f"`{name}`" + (f" [{', '.join(ids)}]" if ids else "") + (" (slow)" * slow))
    return "<br>".join(lines)


def markdown(table) -> str:
    lines = ["| tier | parallelism | dtype | guarded by |", "|---|---|---|---|"]
    for cell, tests in table.items():
        text = _cell_text(tests) or f"**none**: {GAPS.get(cell, 'unguarded')}"
        lines.append(f"| {' | '.join(cell)} | {text} |")
    return "\n".join(lines)


def problems(table, items) -> list[str]:
    """Cells without a guard that are not listed gaps, listed gaps that have one, and
    ``ids`` that name no test."""
    out = unknown_ids(items)
    out += [f"unguarded: {c}" for c, tests in table.items() if not tests and c not in GAPS]
    out += [f"a listed gap is guarded now (remove it from GAPS): {c}" for c in GAPS if table.get(c)]
    return out


class _Collect:
    def __init__(self):
        self.items = []

    def pytest_collection_finish(self, session):
        self.items = list(session.items)


def collect(args=("tests",)):
    """Every test (no -m filter), collected in this process, pytest's output dropped."""
    import pytest

    plugin = _Collect()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(
            ["--collect-only", "-q", "-m", "", "-n0", "-p", "no:cacheprovider", *args],
            plugins=[plugin],
        )
    if code != 0:
        raise SystemExit(f"collection failed ({code}):\n{out.getvalue()[-3000:]}")
    return plugin.items


def main(argv: list[str]) -> int:
    items = collect()
    table = guards(items)
    print(markdown(table))
    found = problems(table, items)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
