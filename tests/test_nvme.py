"""The NVMe page store: real TensorStore zarr3 files on disk."""

import numpy as np
import pytest

from hetjax.config import ConfigError
from hetjax.storage.nvme import PageStore, check_nvme_path


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
