"""The XLA settings a run needs before JAX starts, from its config: set by the launcher
(``python -m hetjax.launch``), since XLA reads them once, when the backend starts.

* ``XLA_CLIENT_MEM_FRACTION`` = ``memory.device_fraction``: the share of each GPU's
  memory JAX's allocator preallocates (JAX alone takes 0.75, so a plan for 90% of an
  H100 would not fit). The planner plans within the same fraction. jaxlib >= 0.7 reads
  this name and still the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``, and refuses to
  start (ValueError) when both are set: so if either is set, neither is touched.
* ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``: XLA caps a GPU process's ``pinned_host``
  memory (param slabs, gradient pages, boundary activations on the host) at 64 GiB by
  default. The launcher sets it to :func:`pinned_bound`: ``memory.host_budget`` (or 90%
  of the machine's RAM without a budget), which bounds the host plan's pinned part. Not
  the plan's own pinned bytes: XLA reads the variable when the backend starts, and the
  host plan is made after that (its sizes come from the stage functions' shapes, its
  placement from the devices). The runtime checks the plan's pinned bytes plus
  :data:`PINNED_MARGIN` against the limit in force (:func:`pinned_limit`,
  ``HostMemoryPlan.check_pinned``).

A variable already set in the environment wins (the launcher says so). On the CPU
backend neither applies: there is no separate device memory and no pinned cap.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping

from hetjax.config import Config

MEM_FRACTION = "XLA_CLIENT_MEM_FRACTION"  # jaxlib >= 0.7's name
OLD_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # deprecated, still read by jaxlib
MEM_FRACTION_NAMES = (MEM_FRACTION, OLD_MEM_FRACTION)
PINNED_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_PINNED_DEFAULT = 64 << 30  # XLA's own cap on GPU pinned host memory
GiB = 1 << 30
# Pinned host memory XLA allocates besides the host plan's pinned part: the staging
# buffers its transfers from pageable memory go through (batches, scalars, an expert's
# rows), and the pinned allocator's rounding of each allocation up to its bin and of its
# growth to whole regions. The runtime refuses a plan that leaves less under the cap.
PINNED_MARGIN = 2 * GiB


def machine_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def wanted(config: Config) -> dict[str, str]:
    """The variables ``config`` asks for."""
    return {
        MEM_FRACTION: f"{config.memory.device_fraction:g}",
        PINNED_LIMIT: str(max(1, math.ceil(pinned_bound(config) / GiB))),
    }


def pinned_bound(config: Config) -> int:
    """Bytes the host plan's pinned part is planned within, known before JAX starts:
    ``memory.host_budget`` (the whole plan fits it), or 90% of the machine's RAM."""
    return config.memory.host_budget or int(0.9 * machine_ram())


def _aliases(name: str) -> tuple[str, ...]:
    """The names XLA reads for the setting ``name`` names."""
    return MEM_FRACTION_NAMES if name == MEM_FRACTION else (name,)


def apply(config: Config, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Sets what ``config`` asks for where the environment does not set it already
    (under either of its names); returns a line per variable the environment
    overrides, for the log."""
    notes = []
    for name, value in wanted(config).items():
        given = [n for n in _aliases(name) if n in environ]
        for n in given:
            if environ[n] != value:
                notes.append(f"{n}={environ[n]} from the environment (the config asks {value})")
        if not given:
            environ[name] = value
    return notes


def mem_fraction(environ: Mapping[str, str] = os.environ) -> float | None:
    """The device memory fraction the environment sets (either name; the new one
    first), or None where neither is set."""
    value = next((environ[n] for n in MEM_FRACTION_NAMES if environ.get(n)), None)
    return float(value) if value is not None else None


def mem_fraction_setting(environ: Mapping[str, str] = os.environ) -> str:
    """``NAME=value`` for each memory-fraction variable set, or ``unset``: for a log."""
    given = [f"{n}={environ[n]}" for n in MEM_FRACTION_NAMES if n in environ]
    return ", ".join(given) or f"{MEM_FRACTION} unset"


def with_mem_fraction(fraction: float, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` for a child process that preallocates ``fraction`` of
    each GPU: the deprecated name removed (both at once stop jaxlib), the new one set."""
    env = {k: v for k, v in environ.items() if k not in MEM_FRACTION_NAMES}
    env[MEM_FRACTION] = f"{fraction:g}"
    return env


def pinned_limit(environ: Mapping[str, str] = os.environ) -> int:
    """Bytes of ``pinned_host`` memory XLA allows a GPU process now."""
    value = environ.get(PINNED_LIMIT)
    return int(float(value) * GiB) if value else XLA_PINNED_DEFAULT
