"""Each section's compile time, counted in every process it starts (the section's own,
its pytest children and their xdist workers, the mfu rows): JAX reports each backend
compile (a persistent-cache hit included, cheaper) to its monitoring listeners; a
process that :func:`install` ran in appends its count and seconds, at exit, as one line
to the file ``HETJAX_GPUCHECK_COMPILES`` names. The driver sums a section's lines.

A pytest child loads this module as a plugin (``-p hetjax.gpucheck.timing``), which
installs it where the variable is set: the workers of ``pytest -n`` inherit it too.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

VARIABLE = "HETJAX_GPUCHECK_COMPILES"  # the file a section's processes append to
PLUGIN = ("-p", "hetjax.gpucheck.timing")  # pytest's arguments that load this module
EVENT = "/jax/core/compile/backend_compile_duration"  # jax/_src/dispatch.py's

_totals = {"compiles": 0, "seconds": 0.0}
_installed: list[str] = []


def _listen(event: str, duration: float, **_) -> None:
    if event == EVENT:
        _totals["compiles"] += 1
        _totals["seconds"] += duration


def _write(path: str) -> None:
    if _totals["compiles"]:
        line = json.dumps({"pid": os.getpid(), **_totals})
        with open(path, "a") as f:  # one short append per process
            f.write(line + "\n")
        _totals.update(compiles=0, seconds=0.0)


def pytest_unconfigure(config) -> None:
    """pytest's end (an xdist worker's too, which may leave without running atexit)."""
    if _installed:
        _write(_installed[0])


def install(environ=os.environ) -> None:
    """Counts this process's compiles into the file ``environ[VARIABLE]`` names (none:
    nothing). Imports only jax's monitoring module: starts no backend."""
    path = environ.get(VARIABLE, "")
    if not path or _installed:
        return
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_listen)
    atexit.register(_write, path)
    _installed.append(path)


def totals(path: Path) -> tuple[int, float]:
    """The compiles and seconds the processes that wrote ``path`` counted."""
    if not path.exists():
        return 0, 0.0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r["compiles"] for r in lines), sum(r["seconds"] for r in lines)


install()  # as a pytest plugin (or any import) in a process given the variable
