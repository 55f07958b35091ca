"""The XLA settings a run needs before JAX starts, from its config: set by the launcher
(``python -m hetjax.launch``), since XLA reads them once, when the backend starts.

* ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = ``memory.device_fraction``: the share of each
  GPU's memory JAX's allocator preallocates (JAX alone takes 0.75, so a plan for 90% of
  an H100 would not fit). The planner plans within the same fraction.
* ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``: XLA caps a GPU process's ``pinned_host``
  memory (param slabs, gradient pages, boundary activations on the host) at 64 GiB by
  default. The launcher raises it to ``memory.host_budget`` (or 90% of the machine's RAM
  without a budget), which bounds the host plan's pinned part; the runtime checks the
  plan's pinned bytes against the limit in force (:func:`pinned_limit`).

A variable already set in the environment wins (the launcher says so). On the CPU
backend neither applies: there is no separate device memory and no pinned cap.
"""

from __future__ import annotations

import math
import os

from hetjax.config import Config

MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PINNED_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_PINNED_DEFAULT = 64 << 30  # XLA's own cap on GPU pinned host memory
GiB = 1 << 30


def machine_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def wanted(config: Config) -> dict[str, str]:
    """The variables ``config`` asks for."""
    mem = config.memory
    pinned = mem.host_budget or int(0.9 * machine_ram())
    return {
        MEM_FRACTION: f"{mem.device_fraction:g}",
        PINNED_LIMIT: str(max(1, math.ceil(pinned / GiB))),
    }


def apply(config: Config, environ=os.environ) -> list[str]:
    """Sets what ``config`` asks for where the environment does not set it already;
    returns a line per variable the environment overrides, for the log."""
    notes = []
    for name, value in wanted(config).items():
        if name in environ and environ[name] != value:
            notes.append(f"{name}={environ[name]} from the environment (the config asks {value})")
        else:
            environ[name] = value
    return notes


def pinned_limit(environ=os.environ) -> int:
    """Bytes of ``pinned_host`` memory XLA allows a GPU process now."""
    value = environ.get(PINNED_LIMIT)
    return int(float(value) * GiB) if value else XLA_PINNED_DEFAULT
