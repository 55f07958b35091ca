"""The NVMe tier's pooled I/O buffers (hetjax/storage/iopool.py): reads into them, writes
from them without a copy, the native kernel's update in place on them, and a streaming
run holding no more of them than the host plan counts."""

import os

import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import require
from equivalence import training_batches
from test_queue_full import InstantStore

from hetjax import memory
from hetjax.config import OptimizerConfig
from hetjax.optimizer import native
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import StateFormat
from hetjax.storage.iopool import IoPool, SlabPool
from hetjax.storage.nvme import PageStore
from hetjax.storage.pages import DIRECT_ALIGN, SlabLayout, aligned_empty, pages_slab


def _done():
    promise, future = ts.Promise.new()
    promise.set_result(None)
    return future


def test_a_slot_comes_back_only_when_its_io_is_done():
    pool = IoPool(StateFormat.fp32(["mu"]).dtypes, 1024, slots=2)
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
    pool = IoPool(StateFormat.fp32([]).dtypes, 16, slots=2)
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


def test_a_read_landing_late_delays_no_use_before_it(monkeypatch):
    """Depth 2: after use j is dispatched the window copies j + 1 in (waiting for its
    read) and j + 2 only if its read has landed, so a slow read of b2 never holds up
    the dispatch of b1; b2 is copied when it has landed or is next."""
    from hetjax.runtime.loop import window as window_module

    monkeypatch.setattr(window_module.jax, "block_until_ready", lambda x: x)
    events, landed = [], {"b0", "b1", "b3"}

    class Store:
        def prefetch(self, stage):
            pass

        def ready(self, stage):
            return stage in landed

        def get(self, stage, keep=False):
            events.append(("read", stage))  # (waits for it, if it is landing)
            return stage

    uses = ["b0", "b1", "b2", "b3"]
    win = window_module.PrefetchWindow(uses, 2, {}, Store(), lambda name, slab: slab)
    for j in range(len(uses)):
        win.get(j)
        events.append(("dispatch", uses[j]))
        win.done(j, after=j)
    assert events == [
        ("read", "b0"), ("dispatch", "b0"),
        ("read", "b1"),  # b2's read still landing: not waited for here
        ("dispatch", "b1"),
        ("read", "b2"), ("read", "b3"),  # b2 is next
        ("dispatch", "b2"), ("dispatch", "b3"),
    ]  # fmt: skip


def test_param_slabs_are_reused_from_the_second_step(tiny, tmp_path):
    """Params on NVMe: the reads land in the param pool's slabs and the host optimizer's
    refreshed params come from it; from the second step on no slab is allocated, and the
    pool keeps no more than the host plan counts as param slabs."""
    config = tiny(
        model=dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32),
        offload=dict(mode="stream", optimizer="nvme", params="nvme"),
        memory=dict(nvme_path=str(tmp_path / "nvme"), page_size="4KiB"),
    )
    runtime = StreamingRuntime(config)
    try:
        slabs = runtime.param_store.slabs
        assert runtime.optimizer.param_buffers is slabs
        batches = training_batches(config, 4)
        runtime.train_step(batches[0])
        allocated, reused = slabs.allocated, slabs.reused
        for batch in batches[1:]:
            runtime.train_step(batch)
        # a step takes 10 slabs: 4 block reads (b3 | b2 b1 b0: the forward's first
        # 1 + prefetch depth blocks get their update's params, memory_host.kept_published,
        # and b3 stays on the device between its two uses), 6 stages updated. Most come
        # back: how
        # many are still held when the next is taken depends on how far the device and
        # the writes are behind (a loaded machine: the pool is full, the rest are new).
        taken = slabs.reused - reused + slabs.allocated - allocated
        assert taken >= 3 * 10
        assert slabs.reused - reused >= taken // 2
        assert slabs.nbytes <= runtime.host_plan.param_slabs
        assert runtime.states.disk[0]._direct  # and read straight into them
    finally:
        runtime.close()


def test_a_slab_is_not_handed_out_while_anything_refers_to_it(tmp_path):
    """A view, a JAX array put from the slab (on the CPU backend it aliases an aligned
    array), a TensorStore transfer: each keeps the slab from being handed out again."""
    pool = SlabPool(max_bytes=4 * 1024 * 4)
    take = lambda: pool.take(1024, np.float32)
    a = take()
    a_id = id(a)
    del a
    a = take()
    assert id(a) == a_id and pool.reused == 1  # nothing referred to it
    view = a.reshape(-1, 256)[1:]
    del a
    b = take()
    assert id(b) != a_id  # the view holds the first
    put = jax.device_put(view[0], jax.devices("cpu")[0])
    del view
    c = take()
    assert id(c) not in (a_id, id(b))  # the JAX array holds it
    del put
    d = take()
    assert id(d) == a_id
    held = ts.array(d, copy=False, write=True)
    del d
    assert id(take()) not in (a_id,)
    del held
    assert id(take()) == a_id
    assert pool.nbytes == 4 * 1024 * 4  # only as many as were held at once
    # past its limit the pool hands out slabs it does not keep
    more = [take() for _ in range(4)]
    assert pool.nbytes == 4 * 1024 * 4 and len(more) == 4
    assert all(x.ctypes.data % DIRECT_ALIGN == 0 for x in more)


@pytest.mark.parametrize("aligned", [True, False])
def test_direct_reads_equal_tensorstore_s(tmp_path, aligned):
    """Pages read straight from their chunk files (an aligned buffer: O_DIRECT) or
    through TensorStore (unaligned) are the pages written; a page never written (no
    file) reads as zeros; a chunk file shorter than a page is an error naming it."""
    P = 1024  # 4 KiB pages
    store = PageStore(tmp_path / "s", ["master"], num_pages=6, page_elems=P)
    assert store._direct
    data = np.random.default_rng(0).standard_normal(4 * P).astype(np.float32)
    store.write("master", 1, data).result()  # pages 1-4; 0 and 5 never written
    raw = aligned_empty(6 * P + 1, np.float32, DIRECT_ALIGN)
    out = raw[:-1] if aligned else raw[1:]
    out[:] = np.nan
    store.read_into("master", 0, out).result()
    np.testing.assert_array_equal(out[P : 5 * P], data)
    np.testing.assert_array_equal(out[:P], 0)
    np.testing.assert_array_equal(out[5 * P :], 0)
    if aligned:
        chunk = store._chunk_file("master", 2)
        chunk.write_bytes(chunk.read_bytes()[:100])
        with pytest.raises(OSError, match="a page is 4096"):
            store.read_into("master", 2, out[:P]).result()


def test_tensorstore_io_modes_read_through_tensorstore(tmp_path):
    store = PageStore(tmp_path / "s", ["master"], 2, 1024, io_mode="default")
    assert not store._direct
    odd = PageStore(tmp_path / "t", ["master"], 2, 1000)  # pages not O_DIRECT blocks
    assert not odd._direct
    odd.write("master", 0, np.arange(2000, dtype=np.float32)).result()
    out = aligned_empty(2000, np.float32, DIRECT_ALIGN)
    odd.read_into("master", 0, out).result()
    np.testing.assert_array_equal(out, np.arange(2000, dtype=np.float32))


def test_pages_slab_is_the_slab_the_pages_view():
    slab = np.arange(12, dtype=np.float32)
    pages = list(slab.reshape(-1, 4))
    assert np.shares_memory(pages_slab(pages), slab)
    np.testing.assert_array_equal(pages_slab(pages), slab)
    # an aligned slab's pages (their base: the raw bytes around it), or a run of them
    aligned = aligned_empty(12, np.float32)
    aligned[:] = slab
    pages = list(aligned.reshape(-1, 4))
    got = pages_slab(pages)
    assert got.ctypes.data == aligned.ctypes.data and got.size == 12
    np.testing.assert_array_equal(got, slab)
    got = pages_slab(pages[1:])
    assert got.ctypes.data == pages[1].ctypes.data
    np.testing.assert_array_equal(got, slab[4:])
    shuffled = [pages[1], pages[0], pages[2]]  # not in order: a copy, in the pages' order
    got = pages_slab(shuffled)
    assert not np.shares_memory(got, slab)
    np.testing.assert_array_equal(got, np.concatenate(shuffled))


def test_direct_writes_are_tensorstore_s_pages_and_keep_linked_ones(tmp_path):
    """A borrowed write from an aligned buffer goes straight to the chunk files, which
    TensorStore then reads as the pages written; each page is a new file renamed over
    the old one, so a hard link to the old file (a checkpoint's) keeps the old page. A
    write that is not borrowed (the caller may change its buffer) goes through
    TensorStore."""
    P = 1024
    store = PageStore(tmp_path / "s", ["master"], num_pages=4, page_elems=P)
    first = aligned_empty(4 * P, np.float32, DIRECT_ALIGN)
    first[:] = np.arange(4 * P)
    store.write("master", 0, first, borrowed=True).result()
    np.testing.assert_array_equal(store.read("master", 0, 4).result().reshape(-1), first)
    linked = tmp_path / "linked"
    os.link(store._chunk_file("master", 1), linked)
    second = aligned_empty(2 * P, np.float32, DIRECT_ALIGN)
    second[:] = -1
    store.write("master", 1, second, borrowed=True).result()
    np.testing.assert_array_equal(np.fromfile(linked, np.float32), first[P : 2 * P])
    got = store.read("master", 0, 4).result().reshape(-1)
    np.testing.assert_array_equal(got, np.concatenate([first[:P], second, first[3 * P :]]))
    assert not list((tmp_path / "s" / "master").rglob("*.tmp"))  # no temporary left
    # not borrowed: through TensorStore, to the same files
    third = aligned_empty(P, np.float32, DIRECT_ALIGN)
    third[:] = 5
    store.write("master", 3, third).result()
    np.testing.assert_array_equal(store.read("master", 3, 1).result().reshape(-1), 5)
    out = aligned_empty(4 * P, np.float32, DIRECT_ALIGN)
    store.read_into("master", 0, out).result()
    np.testing.assert_array_equal(out[3 * P :], 5)


def test_the_device_runs_at_most_one_use_behind(monkeypatch):
    """The window waits for the previous use's result before it copies anything more in:
    a dropped slab lives on until the computations queued on it ran, so a dispatching
    thread running ahead would hold every block of the pass."""
    from hetjax.runtime.loop import window as window_module

    events = []
    monkeypatch.setattr(
        window_module.jax, "block_until_ready", lambda x: events.append(("wait", x)) or x
    )

    uses = ["b0", "b1", "b2", "b2", "b1", "b0"]
    win = window_module.PrefetchWindow(
        uses, 1, {}, InstantStore(), lambda name, slab: events.append(("copy", name)) or slab
    )
    for j in range(len(uses)):
        win.get(j)
        win.done(j, after=f"out{j}")
    # depth 1: each get copies the next use in, after the previous use's result
    assert events == [
        ("copy", "b0"), ("copy", "b1"),
        ("wait", "out0"), ("copy", "b2"),
        ("wait", "out1"),
        ("wait", "out2"), ("copy", "b1"),  # b2 was kept between its two uses
        ("wait", "out3"), ("copy", "b0"),
        ("wait", "out4"),
    ]  # fmt: skip
