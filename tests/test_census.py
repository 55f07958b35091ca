"""The RSS census (hetjax/census.py): what malloc holds and which JAX arrays are live."""

import mmap

import jax
import numpy as np
from conftest import require

from hetjax import census

MiB = 1 << 20


def test_malloc_in_use_follows_a_buffer():
    require(census.malloc_bytes() != (0, 0), "glibc 2.33 or later (mallinfo2)")
    # mallinfo2 counts the whole process: threads of other tests' runtimes in this worker
    # may malloc or free meanwhile (CI once saw 64 MiB less 99 KiB). A window counts only
    # if nothing else moved: in use the same before the buffer and after its release.
    for _ in range(5):
        in_use, _ = census.malloc_bytes()
        buf = np.ones(64 * MiB // 8)  # 64 MiB through malloc
        grown = census.malloc_bytes()[0] - in_use
        del buf
        released = census.malloc_bytes()[0] - in_use
        if released == 0:
            break
    assert 64 * MiB <= grown < 66 * MiB, grown
    assert released < 2 * MiB, released


def test_rss_and_its_peak_follow_fresh_pages():
    """Pages mapped outside malloc (whose freed memory may be resident already)."""
    rss, _ = census.rss()
    pages = mmap.mmap(-1, 64 * MiB)
    for offset in range(0, 64 * MiB, mmap.PAGESIZE):  # every page touched
        pages[offset] = 1
    grown = census.rss()[0] - rss
    # the kernel updates its RSS counters in batches: a few pages of slack
    assert 63 * MiB <= grown < 80 * MiB, grown
    pages.close()
    current, peak = census.rss()
    assert peak >= rss + 63 * MiB > current, (rss, current, peak)


def test_jax_bytes_by_memory_kind():
    device = jax.devices()[0]
    kinds = ("device", "pinned_host")
    put = lambda k: jax.device_put(
        np.zeros(MiB // 4, np.float32), jax.sharding.SingleDeviceSharding(device, memory_kind=k)
    )
    # Threads of other tests' runtimes in this worker may make or drop arrays meanwhile:
    # a window counts only if the other arrays were the same at its start and its end.
    for _ in range(5):
        before = census.jax_bytes()
        arrays = {k: put(k) for k in kinds}
        after = census.jax_bytes()
        del arrays
        if census.jax_bytes() == before:
            break
    for k in kinds:
        assert after.get(k, 0) - before.get(k, 0) == MiB, (k, before, after)
    arrays = {k: put(k) for k in kinds}
    fields = census.census()
    assert fields["jax_pinned_host_bytes"] >= MiB
    line = census.describe(fields)
    assert line.startswith("memory: rss ") and "pinned_host arrays" in line
    del arrays
