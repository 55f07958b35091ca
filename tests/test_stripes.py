"""Several NVMe drives (``memory.nvme_path`` with several directories,
``hetjax/storage/stripes.py``): pages stripe over them, training is bit for bit that of
one directory, and the planner sums the distinct drives' bandwidth."""

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from hetjax.config import ConfigError
from hetjax.planning.hardware import drives_bandwidth
from hetjax.storage.nvme import PageStore
from hetjax.storage.pages import aligned_empty
from hetjax.storage.stripes import Stripes
from hetjax.storage.swap import BoundarySwap
from hetjax.train import train

NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def test_striped_page_store_reads_back_what_it_wrote_on_both_drives(tmp_path):
    """A page array striped over two directories: pages written through both paths
    (O_DIRECT from pooled buffers, and TensorStore's) read back bit for bit, through
    both paths, and the odd pages' files are on the second directory."""
    P, n = 1024, 6
    stripes = Stripes(tmp_path / "a", (tmp_path / "b",))
    store = PageStore(tmp_path / "a" / "state", ["mu"], n, P, stripes=stripes)
    data = np.random.default_rng(0).random(n * P, dtype=np.float32)
    pooled = aligned_empty(n * P, np.float32)
    pooled[:] = data
    store.write("mu", 0, pooled[: 3 * P], borrowed=True).result()  # O_DIRECT, in place
    store.write("mu", 3, data[3 * P :]).result()  # a copy, through TensorStore
    back = aligned_empty(n * P, np.float32)
    store.read_into("mu", 0, back).result()
    np.testing.assert_array_equal(back, data)
    np.testing.assert_array_equal(store.read("mu", 0, n).result().reshape(-1), data)
    on_b = sorted(int(p.parent.name) for p in (tmp_path / "b" / "state" / "mu").glob("c/*/0"))
    assert on_b == [1, 3, 5]
    on_a = sorted(int(p.name) for p in (tmp_path / "a" / "state" / "mu" / "c").iterdir())
    assert on_a == list(range(n))  # (the odd ones links to b)


@pytest.mark.slow  # ~15 s: two runs; the page store above in the default run
def test_striping_over_two_directories_equals_one_bit_for_bit(tmp_path):
    # small pages: each stage's state spans several pages, so each stripes
    memory = dict(page_size="4KiB")
    one = tiny_config(
        offload=NVME,
        memory=dict(memory, nvme_path=str(tmp_path / "one")),
        train=dict(steps=3, eval_batches=0),
    )
    drives = [tmp_path / "a", tmp_path / "b"]
    two = one.replace(memory=dict(nvme_path=",".join(map(str, drives))))
    a = train(one, tmp_path / "run1", verbose=False)
    b = train(two, tmp_path / "run2", verbose=False)
    np.testing.assert_array_equal(a.losses, b.losses)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    # page p of each array on drive p % 2: the odd pages' files are on drive b
    master = drives[0] / "optimizer" / "gen0" / "master" / "c"
    pages = sorted(int(p.name) for p in master.iterdir())
    assert len(pages) > 4
    for p in pages:
        assert (master / str(p)).is_symlink() == (p % 2 == 1)
    on_b = drives[1] / "optimizer" / "gen0" / "master" / "c"
    assert sorted(int(p.name) for p in on_b.iterdir()) == [p for p in pages if p % 2]
    assert all((on_b / str(p) / "0").is_file() for p in pages if p % 2)


def test_striped_swap_returns_each_boundary_and_keeps_odd_rows_on_the_second_drive(tmp_path):
    """An activation swap over two directories, rows of four chunks each: every
    boundary comes back bit for bit, and the rows written with an odd slot (1 and 3:
    slot 4, the last, stays in RAM) have their four chunk files on the second drive."""
    stripes = Stripes(tmp_path / "a", (tmp_path / "b",))
    swap = BoundarySwap(
        tmp_path / "a" / "activations", 5, (4, 8), np.float32, chunk_elems=8, depth=1,
        stripes=stripes,
    )  # fmt: skip
    rows = np.random.default_rng(0).random((5, 4, 8), dtype=np.float32)
    swap.begin()
    for slot in range(5):
        swap.put(slot, rows[slot].copy())
    for slot in reversed(range(5)):
        np.testing.assert_array_equal(swap.get(slot), rows[slot])
    swap.close()
    assert swap.write_bytes == 4 * rows[0].nbytes
    on_b = tmp_path / "b" / "activations" / "boundaries" / "c"
    assert sorted(int(p.parent.name) for p in on_b.glob("*/*") if p.is_file()) == [1] * 4 + [3] * 4
    on_a = tmp_path / "a" / "activations" / "boundaries" / "c"
    assert sorted(p.name for p in (on_a / "0").iterdir()) == ["0", "1", "2", "3"]
    assert (on_a / "1").is_symlink() and not (on_a / "0").is_symlink()


def test_striped_pages_in_relative_directories_reach_their_drive(tmp_path, monkeypatch):
    """Drives named relative to the working directory (``memory.nvme_path=d0,d1``):
    the odd page's link still reaches d1, and the page reads back."""
    monkeypatch.chdir(tmp_path)
    store = PageStore(
        Path("d0") / "state", ["mu"], 2, 1024, stripes=Stripes(Path("d0"), (Path("d1"),))
    )
    data = np.arange(2 * 1024, dtype=np.float32)
    store.write("mu", 0, data).result()
    np.testing.assert_array_equal(store.read("mu", 0, 2).result().reshape(-1), data)
    assert (tmp_path / "d1" / "state" / "mu" / "c" / "1" / "0").is_file()


def test_a_drive_is_checked_for_its_rows_of_a_swap():
    """Three rows of 100 bytes over two drives: drive 0 holds rows 0 and 2."""
    assert Stripes(Path("a"), (Path("b"),)).rows_share(300, 3) == 200
    assert Stripes(Path("a"), (Path("b"), Path("c"))).rows_share(300, 3) == 100


@pytest.mark.slow  # ~5 s alone, ~40 s at load 14 (two runs); the swap above in the default run
def test_swapping_activations_to_two_directories_equals_one_bit_for_bit(tmp_path, monkeypatch):
    """Boundary activations and swapped blocks' activations on NVMe, over one directory
    and over two: the same losses and params bit for bit; the second directory holds
    both swaps' odd rows (read ahead 1: slots 0 and 1 of each are written, slot 2 kept
    in RAM), each row of several chunks (4 KiB pages)."""
    from hetjax import memory as memory_model

    monkeypatch.setattr(memory_model, "IO_READAHEAD", 1)
    offload = dict(mode="stream", activations="nvme", swap_blocks=3, swap_tier="nvme")
    one = tiny_config(
        model=dict(num_layers=6),
        offload=offload,
        memory=dict(page_size="4KiB", nvme_path=str(tmp_path / "one")),
        train=dict(steps=2, eval_batches=0),
    )
    drives = [tmp_path / "a", tmp_path / "b"]
    two = one.replace(memory=dict(nvme_path=",".join(map(str, drives))))
    a = train(one, tmp_path / "run1", verbose=False)
    b = train(two, tmp_path / "run2", verbose=False)
    np.testing.assert_array_equal(a.losses, b.losses)
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    for swap in ("activations", "swapped"):  # (both stores' arrays are named boundaries)
        rows = drives[1] / swap / "boundaries" / "c"
        chunks = sorted(p.relative_to(rows).parts for p in rows.glob("*/*") if p.is_file())
        assert {row for row, _ in chunks} == {"1"}, (swap, chunks)
        assert len(chunks) > 1, (swap, chunks)  # a row of several chunks
        assert (drives[0] / swap / "boundaries" / "c" / "1").is_symlink()


def test_nvme_path_names_distinct_directories():
    with pytest.raises(ConfigError, match="memory.nvme_path"):
        tiny_config(memory=dict(nvme_path="/tmp/x,/tmp/x"))
    with pytest.raises(ConfigError, match="memory.nvme_path"):
        tiny_config(memory=dict(nvme_path="/tmp/x,"))


def test_planner_sums_the_bandwidth_of_distinct_drives(tmp_path, monkeypatch):
    import os

    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in dirs:
        d.mkdir()
    # a and b on one device, c on another (stat faked): two drives measured, summed
    devices = {"a": 1, "b": 1, "c": 2}
    real_stat = os.stat

    class Stat:
        def __init__(self, st_dev):
            self.st_dev = st_dev

    monkeypatch.setattr(
        os,
        "stat",
        lambda p, *a, **k: (
            Stat(devices[Path(p).name]) if Path(p) in dirs else real_stat(p, *a, **k)
        ),
    )
    measured = []

    def measure(d):
        measured.append(d.name)
        return (1e9, 5e8) if d.name == "a" else (2e9, 1e9)

    read, write, free = drives_bandwidth(dirs, measure)
    assert measured == ["a", "c"]
    assert (read, write) == (3e9, 1.5e9)
    import shutil

    assert free == 3 * min(shutil.disk_usage(d).free for d in dirs)
