"""The NVMe tier's pooled I/O buffers (hetjax/storage/iopool.py): reads into them, writes
from them without a copy, the native kernel's update in place on them, and a streaming
run holding no more of them than the host plan counts."""

import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import require
from equivalence import training_batches

from hetjax import memory
from hetjax.config import OptimizerConfig
from hetjax.optimizer import native
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.storage.iopool import IoPool
from hetjax.storage.nvme import PageStore
from hetjax.storage.pages import SlabLayout, pages_slab


def _done():
    promise, future = ts.Promise.new()
    promise.set_result(None)
    return future


def test_a_slot_comes_back_only_when_its_io_is_done():
    pool = IoPool(["master", "mu"], 1024, slots=2)
    a, b = pool.take("s0"), pool.take("s1")
    assert pool.nbytes == 2 * 2 * 1024 * 4
    promise, writing = ts.Promise.new()
    pool.give(a, [writing])
    pool.give(b, [_done()])
    assert pool.take("s2") is b  # the one whose write is done
    promise.set_result(None)
    assert pool.take("s3") is a  # waited for
    assert pool.nbytes == 2 * 2 * 1024 * 4  # never more than its slots


def test_a_pool_all_held_names_the_stages():
    pool = IoPool(["master"], 16, slots=2)
    pool.take("block0")
    pool.take("block1")
    with pytest.raises(RuntimeError, match=r"all 2 optimizer I/O buffers are held.*block0, block1"):
        pool.take("block2")


def test_read_into_and_a_borrowed_write_leave_no_stale_data(tmp_path):
    """A write that references its source (no copy) lands what the buffer held; changing
    the buffer after the write is done changes nothing on disk (no cached reference)."""
    store = PageStore(tmp_path / "s", ["master"], num_pages=8, page_elems=256)
    data = np.arange(8 * 256, dtype=np.float32)
    store.write("master", 0, data).result()
    buf = np.full(4 * 256, -1, np.float32)
    store.read_into("master", 2, buf).result()
    np.testing.assert_array_equal(buf, data[512:1536])
    buf *= 3
    store.write("master", 2, buf, borrowed=True).result()
    expected = buf.copy()
    buf[:] = 7  # the pool reuses the buffer
    again = np.empty_like(buf)
    store.read_into("master", 2, again).result()
    np.testing.assert_array_equal(again, expected)
    np.testing.assert_array_equal(store.read("master", 0, 2).result().reshape(-1), data[:512])


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_update_host_equals_the_jitted_kernel_bit_for_bit(compute):
    require(native.use_native("auto", "adamw", "cpu"), "the native kernel (a C++ compiler)")
    params = {"w": np.zeros((300, 70), np.float32), "b": np.zeros((70,), np.float32)}
    layout = SlabLayout.from_params(params, page_bytes=4096)
    cfg = OptimizerConfig(name="adamw", weight_decay=0.1, host_kernel="native")
    device = jax.devices()[0]
    opt = SlabOptimizer(cfg, 10, {"s": layout}, jax.sharding.SingleDeviceSharding(device), compute)
    rng = np.random.default_rng(0)
    n = layout.padded_size
    master = rng.standard_normal(n).astype(np.float32)
    slabs, scalars = opt.init("s", master)
    for step in range(3):  # a few steps: the bias corrections and the schedule move
        grad = rng.standard_normal(n).astype(np.float32)
        clip = (2.0, 1.0) if step == 1 else (0.0, 0.0)  # one step clipped
        ref, ref_scalars, ref_pages = opt.update("s", slabs, scalars, grad, clip)
        host = {k: np.array(np.concatenate([np.asarray(c) for c in v])) for k, v in slabs.items()}
        new, new_scalars, pages = opt.update("s", host, scalars, grad, clip, in_place=True)
        for k in opt.kinds:
            assert new[k] is host[k]  # in place
            np.testing.assert_array_equal(new[k], np.concatenate([np.asarray(c) for c in ref[k]]))
        np.testing.assert_array_equal(
            np.concatenate([np.asarray(p) for p in pages]).view(np.uint8),
            np.concatenate([np.asarray(p) for p in ref_pages]).view(np.uint8),
        )
        for a, b in zip(new_scalars, ref_scalars, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        slabs, scalars = ref, ref_scalars


def test_a_streaming_run_holds_the_pool_the_plan_counts(tiny, tmp_path):
    """Optimizer state on NVMe: after steps, the pool holds at most ``IO_SLOTS`` stages'
    state (the plan's optimizer I/O buffers) and the store counts it as host memory."""
    config = tiny(
        model=dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32),
        offload=dict(mode="stream", optimizer="nvme", params="nvme"),
        memory=dict(nvme_path=str(tmp_path / "nvme"), page_size="4KiB"),
    )
    runtime = StreamingRuntime(config)
    try:
        for batch in training_batches(config, 3):
            runtime.train_step(batch)
        pool = runtime.states._pool
        plan = runtime.host_plan.optimizer_io
        assert plan == memory.IO_SLOTS * pool.elems * 4 * len(pool.kinds)
        assert 0 < pool.nbytes <= plan
        assert runtime.states.host_bytes() >= pool.nbytes
    finally:
        runtime.close()


def test_pages_slab_is_the_slab_the_pages_view():
    slab = np.arange(12, dtype=np.float32)
    pages = list(slab.reshape(-1, 4))
    assert np.shares_memory(pages_slab(pages), slab)
    np.testing.assert_array_equal(pages_slab(pages), slab)
    shuffled = [pages[1], pages[0], pages[2]]  # not in order: a copy, in the pages' order
    got = pages_slab(shuffled)
    assert not np.shares_memory(got, slab)
    np.testing.assert_array_equal(got, np.concatenate(shuffled))
