"""The host allocator (glibc ``malloc``) settings: keep freed blocks for reuse (the
faster setting, the default, with or without a host budget), or, with
``HETJAX_MALLOC=1``, return them to the system (a smaller RSS, slower steps).

A host budget used to switch to the second: the runtime's own buffers were allocated
afresh every step (NVMe reads, refreshed params) and a dispatching thread running ahead
held every block's, so kept freed blocks left the process 1.2x over its bound. With
those pooled at their source (``storage/iopool.py``) and the device at most one use
behind (``runtime/loop/window.py``), the fast settings hold the bound, and returning freed
blocks would only cost step time (docs/results/2026-11-25.md)."""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's allocator keeps freed buffers (per-thread arenas; large buffers reused from a
# heap it never trims), so a streaming run's RSS is about twice its live arrays: measured
# with bench scale's config, peak RSS 3.9 GiB at 57M params with 0.9 GiB of runtime
# buffers, 2.3 GiB with these settings; 7.8 -> 5.5 GiB at 151M. The price is page
# faults on fresh mmap'd buffers: median step 0.83 -> 2.3 s at 57M, 3.9 -> 5.3 s at 151M.
# Any fixed threshold costs that (it turns off glibc's adaptive mmap threshold; measured
# through the command line at 57M: MALLOC_ARENA_MAX=2 alone, or with a 64 MiB mmap
# threshold, kept 4.3 GiB RSS at ~1.1 s/step; a 512 MiB trim threshold alone went to
# 2.4 GiB and 3.7 s/step), so it is applied only when HETJAX_MALLOC=1 asks for it.
# Heaps (arenas) the threads share: glibc's default, eight per core, keeps a high-water
# mark in each thread's heap. Two cost no measurable speed and cut a streaming run's peak
# RSS by a fifth (8 layers of configs/gpt310m_peer.py, params and state on NVMe, pooled
# I/O buffers: 3.98 -> 3.15 GiB, in memory 3.02 GiB; docs/results/2026-11-23.md).
ARENAS = 2
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": str(ARENAS),
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
}
# Under a host budget, the free top of a heap beyond this goes back to the system. Peak
# RSS of a run with params and state on NVMe (tests/test_host_memory.py's 27M model, 512
# MiB budget) 1682-1807 MiB with the 1 GiB threshold, 1578-1624 MiB with 64-128 MiB, at
# the same step time; at 310.8M with a 3 GiB budget 3.59 -> 3.55 GiB, 7.13 -> 6.73 s/step
# (docs/results/2026-11-25.md).
BUDGET_TRIM = 128 << 20
# The same settings through mallopt(3): M_ARENA_MAX, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}


def tune_malloc(environ=os.environ) -> dict[str, str]:
    """Applies :data:`MALLOC_ENV` to this process with glibc's ``mallopt`` (glibc reads
    the variables only at start-up) and exports them for child processes. A variable
    already set is left alone (glibc applied the user's value); ``HETJAX_MALLOC=0``
    keeps glibc's defaults. Returns the settings applied (none without glibc)."""
    if environ.get("HETJAX_MALLOC") == "0" or platform.libc_ver()[0] != "glibc":
        return {}
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    applied = {}
    for name, value in MALLOC_ENV.items():
        if name not in environ and mallopt(_MALLOPT[name], int(value)) == 1:
            environ[name] = applied[name] = value
    return applied


def tune_host_allocator(host_budget: int = 0) -> bool:
    """Keeps freed host memory in the process for reuse (glibc ``mallopt``: no ``mmap``
    per large block, no trimming), as PyTorch's caching allocator keeps its blocks, in
    :data:`ARENAS` heaps. With a ``host_budget`` (``memory.host_budget``) a heap's free
    top beyond :data:`BUDGET_TRIM` goes back to the system.

    XLA's CPU buffers come from ``malloc``; glibc serves large blocks by fresh ``mmap``
    and unmaps them when freed, so a new buffer (the optimizer's refreshed pages,
    activations, transfers on the CPU backend) can pay a page fault per 4 KiB. The host
    optimizer took ~10k faults per 32M-param update: with them gone it runs 1.4x as fast
    with state streamed from NVMe (``bench optimizer``, README).

    Called when a runtime starts. Not applied when any of those variables is set (the
    user's choice, or the launcher's with ``HETJAX_MALLOC=1``: :data:`MALLOC_ENV`), with
    ``HETJAX_MALLOC=0`` (glibc's defaults) or ``1``, or without glibc. Returns whether it
    applied."""
    env = os.environ
    if env.get("HETJAX_MALLOC") in ("0", "1") or any(k in env for k in MALLOC_ENV):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    limit = 1 << 30  # blocks above 1 GiB are still mapped and unmapped
    mmap_ok = mallopt(_MALLOPT["MALLOC_MMAP_THRESHOLD_"], limit) == 1
    arenas_ok = mallopt(_MALLOPT["MALLOC_ARENA_MAX"], ARENAS) == 1
    trim = BUDGET_TRIM if host_budget else limit
    return mmap_ok and arenas_ok and mallopt(_MALLOPT["MALLOC_TRIM_THRESHOLD_"], trim) == 1
