"""What each test costs (issue #56): its wall time split into JAX's compile time and the
rest, and the programs it compiles. On with ``--cost`` or ``HETJAX_TEST_COST=1``
(``--cost-json PATH`` or ``HETJAX_TEST_COST_JSON=PATH`` also writes the figures, and
the session's wall time: ``.ci/run`` reads it against the budget); off, it registers
nothing.

Per test (setup, call and teardown together: a module fixture's compiles count in the
test that first asks for it), from JAX's monitoring events (jax 0.10):
- ``trace``: ``/jax/core/compile/jaxpr_trace_duration`` (a top-level jit's tracing) and
  ``lower``: ``/jax/core/compile/jaxpr_to_mlir_module_duration`` (to StableHLO);
- ``xla``: ``/jax/core/compile/backend_compile_duration``, each one a program this process
  compiled (``programs``): a persistent-cache hit (``/jax/compilation_cache/cache_hits``:
  the read, ``load``) or a miss (``/jax/compilation_cache/cache_misses``: XLA compiled it,
  ``compile``);
- ``run``: the wall time less trace, lower and xla.
A test's child processes (the crash and multi-process tests) compile in the child: their
compiles count as the test's run time. Under pytest-xdist each worker measures its own
tests and sends the figures with the test's report (``user_properties``); the controller
adds them up and prints the table, and counts the distinct programs in the persistent
caches the workers used (each a file ``<key>-cache``).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
XLA = "/jax/core/compile/backend_compile_duration"
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
FIELDS = ("wall", "trace", "lower", "xla", "load", "compile", "run", "programs", "hits", "misses")
PROPERTY = "hetjax_cost"  # the user_properties entry a report carries
TOP = 30


def enabled(config) -> bool:
    """``--cost``, or the environment's ``HETJAX_TEST_COST`` (taken out of the environment,
    so that a test's own child pytest neither reports nor writes the figures; the
    controller tells its pytest-xdist workers: :class:`Handover`)."""
    on = os.environ.pop("HETJAX_TEST_COST", "") not in ("", "0")
    on = on or getattr(config, "workerinput", {}).get(PROPERTY, False)
    path = os.environ.pop("HETJAX_TEST_COST_JSON", "")
    config.option.cost = config.option.cost or on
    config.option.cost_json = config.option.cost_json or path
    return bool(config.option.cost)


def addoption(parser):
    group = parser.getgroup("hetjax cost")
    group.addoption("--cost", action="store_true", help="report each test's compile and run time")
    group.addoption("--cost-json", default="", help="also write the figures to this file")


class Meter:
    """Process-wide counters fed by JAX's listeners (compiles on any thread count)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(FIELDS[1:], 0.0)
        self._hit = threading.local()

    def on_event(self, event: str, **_):
        if event == HITS:
            self._hit.flag = True
            with self.lock:
                self.totals["hits"] += 1
        elif event == MISSES:
            with self.lock:
                self.totals["misses"] += 1

    def on_duration(self, event: str, secs: float, **_):
        with self.lock:
            if event == TRACE:
                self.totals["trace"] += secs
            elif event == LOWER:
                self.totals["lower"] += secs
            elif event == XLA:
                self.totals["xla"] += secs
                self.totals["programs"] += 1
                # the hit event came on this thread inside this compile
                hit = getattr(self._hit, "flag", False)
                self.totals["load" if hit else "compile"] += secs
                self._hit.flag = False

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.totals)


class WorkerCost:
    """In a process that runs tests: each report carries its phase's compile figures."""

    def __init__(self):
        import jax
        from jax import monitoring

        self.meter = Meter()
        monitoring.register_event_listener(self.meter.on_event)
        monitoring.register_event_duration_secs_listener(self.meter.on_duration)
        self.last = self.meter.snapshot()
        self.cache_dir = jax.config.jax_compilation_cache_dir or ""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        now = self.meter.snapshot()
        delta = {k: now[k] - self.last[k] for k in now}
        self.last = now
        delta["cache_dir"] = self.cache_dir
        report.user_properties.append((PROPERTY, delta))


class Collector:
    """Where the reports arrive (the controller, or the one process under -n0): adds up
    each test's figures and prints them."""

    def __init__(self, config):
        self.config = config
        self.tests: dict[str, dict] = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
        self.cache_dirs: set[str] = set()
        self.start = time.time()

    def pytest_runtest_logreport(self, report):
        for name, delta in report.user_properties:
            if name != PROPERTY:
                continue
            row = self.tests[report.nodeid]
            row["wall"] += report.duration
            for k in FIELDS[1:]:
                if k != "run":
                    row[k] += delta.get(k, 0)
            if delta.get("cache_dir"):
                self.cache_dirs.add(delta["cache_dir"])

    def rows(self) -> dict[str, dict]:
        for row in self.tests.values():
            row["run"] = max(0.0, row["wall"] - row["trace"] - row["lower"] - row["xla"])
        return self.tests

    def distinct_programs(self) -> dict:
        """The persistent caches' entries: all, distinct keys, and those written in this
        session (a cold run: every program it compiled)."""
        names, new, total = set(), set(), 0
        for d in sorted(self.cache_dirs):
            for p in Path(d).glob("*-cache"):
                total += 1
                names.add(p.name)
                if p.stat().st_mtime >= self.start:
                    new.add(p.name)
        return dict(
            entries=total, distinct=len(names), written_now=len(new), dirs=len(self.cache_dirs)
        )

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.rows()
        files = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0.0) | {"tests": 0})
        for nodeid, row in rows.items():
            f = files[nodeid.split("::")[0]]
            f["tests"] += 1
            for k in FIELDS:
                f[k] += row[k]
        total = dict.fromkeys(FIELDS, 0.0) | {"tests": len(rows)}
        for f in files.values():
            for k in FIELDS:
                total[k] += f[k]
        caches = self.distinct_programs()
        path = self.config.getoption("cost_json")
        if path:  # the session's time too, whatever ran (.ci/run reads it)
            session = time.time() - self.start
            doc = dict(session_s=session, total=total, caches=caches, files=files, tests=rows)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True))
        if rows:
            self.print(terminalreporter, files, rows, total, caches)

    @staticmethod
    def print(terminalreporter, files, rows, total, caches):
        write = terminalreporter.write_line
        terminalreporter.section("test cost (tests/_cost.py)")
        write(format_table("file", sorted(files.items(), key=lambda kv: -kv[1]["wall"]), total))
        top = sorted(rows.items(), key=lambda kv: -kv[1]["wall"])[:TOP]
        write("")
        write(format_table(f"the {TOP} most expensive tests", top, None))
        write("")
        write(
            f"programs compiled in-process {total['programs']:.0f} (persistent cache: "
            f"{total['hits']:.0f} hits, {total['misses']:.0f} misses); persistent caches: "
            f"{caches['dirs']} dirs, {caches['entries']} entries, {caches['distinct']} distinct "
            f"programs, {caches['written_now']} written by this run"
        )


class Handover:
    """The controller's: each pytest-xdist worker measures too."""

    @staticmethod
    def pytest_configure_node(node):
        node.workerinput[PROPERTY] = True


def format_table(title: str, items, total) -> str:
    """Seconds per row: wall = trace + lower + xla (load: cache hits' reads, compile: XLA's)
    + run."""
    head = (
        f"{'wall s':>8} {'trace':>7} {'lower':>7} {'xla':>7} {'(load)':>7} {'run':>8} "
        f"{'progs':>6} {'miss':>5}  {title}"
    )
    lines = [head]
    for name, r in list(items) + ([("TOTAL", total)] if total else []):
        n = f" ({r['tests']:.0f})" if "tests" in r else ""
        lines.append(
            f"{r['wall']:8.1f} {r['trace']:7.1f} {r['lower']:7.1f} {r['xla']:7.1f} "
            f"{r['load']:7.1f} {r['run']:8.1f} {r['programs']:6.0f} {r['misses']:5.0f}  {name}{n}"
        )
    return "\n".join(lines)


def configure(config):
    """Registers the meter where tests run and the collector where reports arrive."""
    if not enabled(config):
        return
    worker = hasattr(config, "workerinput")
    distributed = not worker and (config.getoption("numprocesses", None) or 0) not in (0, "0")
    if not distributed:  # a process that runs tests: -n0, or an xdist worker
        config.pluginmanager.register(WorkerCost(), "hetjax-cost-worker")
    else:
        config.pluginmanager.register(Handover(), "hetjax-cost-handover")
    if not worker:
        config.pluginmanager.register(Collector(config), "hetjax-cost-collector")
