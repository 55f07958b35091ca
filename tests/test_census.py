"""The RSS census (hetjax/census.py): what malloc holds and which JAX arrays are live."""

import jax
import numpy as np
import pytest

from hetjax import census

MiB = 1 << 20


def test_malloc_in_use_follows_a_buffer_and_rss_follows_its_pages():
    if census.malloc_bytes() == (0, 0):
        pytest.skip("glibc's mallinfo2 is not available here")
    in_use, _ = census.malloc_bytes()
    rss, _ = census.rss()
    buf = np.ones(64 * MiB // 8)  # 64 MiB, every page touched
    grown_in_use = census.malloc_bytes()[0] - in_use
    grown_rss = census.rss()[0] - rss
    assert 64 * MiB <= grown_in_use < 66 * MiB, grown_in_use
    assert grown_rss >= 60 * MiB, grown_rss
    del buf
    assert census.malloc_bytes()[0] - in_use < 2 * MiB


def test_jax_bytes_by_memory_kind():
    device = jax.devices()[0]
    kinds = ("device", "pinned_host")
    before = census.jax_bytes()
    arrays = {
        k: jax.device_put(
            np.zeros(MiB // 4, np.float32), jax.sharding.SingleDeviceSharding(device, memory_kind=k)
        )
        for k in kinds
    }
    after = census.jax_bytes()
    for k in kinds:
        assert after.get(k, 0) - before.get(k, 0) == MiB, (k, before, after)
    fields = census.census()
    assert fields["jax_pinned_host_bytes"] >= MiB
    line = census.describe(fields)
    assert line.startswith("memory: rss ") and "pinned_host arrays" in line
    del arrays
