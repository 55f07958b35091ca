"""Where the process's host memory goes: the RSS census.

On the CPU backend every JAX buffer (``device`` and ``pinned_host`` kinds alike),
numpy array, TensorStore buffer and XLA executable is host memory, and almost all of it
comes from glibc's ``malloc``. So the census splits the resident set into:

* ``malloc_in_use``: bytes the program holds through ``malloc`` (JAX/XLA buffers,
  numpy arrays, TensorStore's chunk and I/O buffers, Python objects), from
  ``mallinfo2``'s in-use counters over every arena, mmap'd blocks included;
* ``malloc_free``: bytes ``malloc`` has freed but keeps in its heaps (allocator
  retention; resident until trimmed, except pages never touched again);
* ``jax_bytes`` by memory kind: the part of ``malloc_in_use`` that is live JAX arrays;
* ``other``: the rest of the RSS (code and shared libraries, thread stacks, buffers
  mapped outside ``malloc``).

``python -m hetjax.launch`` writes ``rss_bytes``, ``rss_peak_bytes``,
``malloc_in_use_bytes`` and ``malloc_free_bytes`` with every step (``metrics.jsonl``);
:func:`census` adds the walk over live JAX arrays (slower: for reports, not per step).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import platform

from hetjax.config_values import format_bytes


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # non-mmapped bytes obtained from the system (all arenas)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmapped blocks (in use by definition)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the arenas
            "fordblks",  # bytes free in the arenas (retained)
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33 and later), or None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    fn = getattr(ctypes.CDLL("libc.so.6"), "mallinfo2", None)
    if fn is not None:
        fn.restype = _Mallinfo2
    return fn


def rss() -> tuple[int, int]:
    """(current, peak) resident set of this process in bytes (``/proc/self/status``:
    VmRSS, VmHWM); (0, 0) where there is no procfs."""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, kib = line.split()[:2]
                    values[key] = int(kib) * 1024
    except OSError:
        return 0, 0
    return values.get("VmRSS:", 0), values.get("VmHWM:", 0)


def malloc_bytes() -> tuple[int, int]:
    """(in use, free but retained) bytes of glibc's ``malloc`` over all arenas; (0, 0)
    without glibc's ``mallinfo2``."""
    fn = _mallinfo2()
    if fn is None:
        return 0, 0
    info = fn()
    return info.uordblks + info.hblkhd, info.fordblks


def step_fields() -> dict[str, int]:
    """The cheap part of the census (no walk over arrays), for every step's record."""
    current, peak = rss()
    in_use, free = malloc_bytes()
    return {
        "rss_bytes": current,
        "rss_peak_bytes": peak,
        "malloc_in_use_bytes": in_use,
        "malloc_free_bytes": free,
    }


def jax_bytes() -> dict[str, int]:
    """Bytes of the live JAX arrays in this process by memory kind (every shard)."""
    import jax  # start-up cost: the launcher imports this module before JAX is needed

    totals: dict[str, int] = collections.defaultdict(int)
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            kind = shard.data.sharding.memory_kind or "device"
            totals[kind] += shard.data.nbytes
    return dict(totals)


def census() -> dict[str, int]:
    """The whole census: :func:`step_fields`, live JAX bytes by kind (``jax_<kind>``),
    and ``other_bytes``, the RSS that ``malloc`` does not explain."""
    out = step_fields()
    for kind, n in jax_bytes().items():
        out[f"jax_{kind}_bytes"] = n
    explained = out["malloc_in_use_bytes"] + out["malloc_free_bytes"]
    out["other_bytes"] = max(out["rss_bytes"] - explained, 0)
    return out


def describe(fields: dict[str, int]) -> str:
    """One log line of a census."""
    names = {
        "rss_bytes": "rss",
        "rss_peak_bytes": "peak",
        "malloc_in_use_bytes": "malloc in use",
        "malloc_free_bytes": "malloc free (retained)",
        "other_bytes": "other",
    }
    parts = [f"{label} {format_bytes(fields[k])}" for k, label in names.items() if k in fields]
    parts += [
        f"{k[4:-6]} arrays {format_bytes(v)}" for k, v in fields.items() if k.startswith("jax_")
    ]
    return "memory: " + ", ".join(parts)
