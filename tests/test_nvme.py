"""The NVMe page store: real TensorStore zarr3 files on disk."""

import concurrent.futures
import gc
import time
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.config import ConfigError
from hetjax.storage.nvme import PageFutures, PageStore, check_nvme_path


def test_pages_round_trip_and_reopen(tmp_path):
    store = PageStore(tmp_path / "state", ["master", "mu", "nu"], num_pages=6, page_elems=1024)
    rng = np.random.default_rng(0)
    slab = rng.normal(size=3 * 1024).astype(np.float32)
    store.write("mu", 2, slab).result()
    np.testing.assert_array_equal(store.read("mu", 2, 3).result().reshape(-1), slab)
    np.testing.assert_array_equal(store.read("mu", 0, 2).result(), 0)  # untouched pages
    # Real files, readable by plain TensorStore without hetjax's objects.
    assert (tmp_path / "state" / "mu" / "zarr.json").is_file()
    reopened = PageStore.open_existing(tmp_path / "state", "mu")
    assert reopened.shape == (6, 1024)
    np.testing.assert_array_equal(reopened[2:5].read().result().reshape(-1), slab)
    assert store.nbytes == 3 * 6 * 1024 * 4


def test_concurrent_writes_then_reads(tmp_path):
    store = PageStore(tmp_path / "s", ["master"], num_pages=16, page_elems=256)
    slabs = [np.full(2 * 256, i, np.float32) for i in range(8)]
    futures = [store.write("master", 2 * i, s) for i, s in enumerate(slabs)]
    for f in futures:
        f.result()
    reads = [store.read("master", 2 * i, 2) for i in range(8)]
    for i, r in enumerate(reads):
        np.testing.assert_array_equal(r.result(), i)


def test_missing_parent_is_created_and_checked(tmp_path):
    path = check_nvme_path(tmp_path / "a" / "b", needed_bytes=1024)
    assert path.is_dir()


def test_unwritable_path_is_a_clear_error():
    # /proc refuses new directories even to root (CI runs as root, so chmod cannot test this).
    with pytest.raises(ConfigError, match=r"memory.nvme_path '/proc/hetjax-nvme' cannot be "):
        check_nvme_path("/proc/hetjax-nvme", 1024)


def test_path_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="memory.nvme_path .* cannot be created|not a directory"):
        check_nvme_path(f / "sub", 1024)
    assert f.read_text() == "x"


def test_not_enough_disk_names_needed_and_free_and_leaves_nothing(tmp_path):
    target = tmp_path / "state"
    with pytest.raises(ConfigError, match=r"needs .* on disk but only .* is free \(short by"):
        check_nvme_path(target, needed_bytes=10**18)  # 1 EB: more than any disk
    assert not target.exists()  # nothing half-written


@pytest.mark.parametrize(
    "dtype, io_mode",
    [("bfloat16", "direct"), ("float32", "default")],  # (pages of 2000 bytes: not O_DIRECT)
)
def test_io_through_tensorstore_frees_its_buffer_without_the_cyclic_collector(
    tmp_path, dtype, io_mode
):
    """A read into a buffer, or a write from one, done and dropped: nothing holds the
    buffer but its owner, so it is freed when the owner lets go. (Held in a reference
    cycle, as bf16 stores' reads and writes left them, it waits for a full collection,
    and the NVMe param store's slab pool, which reuses only unreferenced slabs,
    allocated a fresh slab for every stage read meanwhile: RAM grew every step.)"""
    np_dtype = np.dtype(jnp.dtype(dtype))
    page_elems = 2000 // np_dtype.itemsize
    store = PageStore(tmp_path / "s", {"k": dtype}, 4, page_elems, io_mode=io_mode)
    assert not store.links  # through TensorStore, the path under test
    gc.disable()  # (the cyclic collector would free a cycle at some unknown time)
    try:
        data = np.ones(2 * page_elems, np_dtype)
        written = weakref.ref(data)
        future = store.write("k", 1, data, borrowed=True)
        future.result()
        del future, data
        assert _freed(written), "the written buffer outlived its write"
        out = np.zeros(2 * page_elems, np_dtype)
        read = weakref.ref(out)
        future = store.read_into("k", 1, out)
        future.result()
        np.testing.assert_array_equal(out.astype(np.float32), 1)
        del future, out
        assert _freed(read), "the buffer read into outlived its read"
    finally:
        gc.enable()


def test_page_futures_let_go_of_a_done_callback_once_it_ran():
    """A callback naming a buffer (as the param store's reads have, ``params._ReadInto``)
    is let go once called: the futures keep their callbacks, and a callback holding
    the page futures (which hold them) was a cycle keeping the buffer alive."""
    page = concurrent.futures.Future()  # (not done yet: the callback waits in it)
    futures = PageFutures([page])
    buf = np.zeros(1024, np.float32)
    held, called = weakref.ref(buf), []
    futures.add_done_callback(lambda done, buf=buf: called.append(id(done)))
    gc.disable()
    try:
        page.set_result(None)
        assert called == [id(futures)]
        del futures, buf
        assert held() is None, "the buffer a done callback named outlived the callback"
    finally:
        gc.enable()


def _freed(ref: weakref.ref, seconds: float = 2.0) -> bool:
    """Whether ``ref``'s object is freed within ``seconds`` (the I/O thread that completed
    a future may still be returning from its callbacks when ``result`` returns)."""
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None
