"""Silent corruption of the NVMe tier's live pages (hetjax/storage/checksums.py): every
page a store reads back is checked against the CRC-32 of what it wrote, on each read
path (O_DIRECT page files, TensorStore, hard links); in training a damaged page stops
the run naming the file, the page and the newest checkpoint with a good copy, or rolls
back to it. Bits are flipped in the files on disk, as the SSD would."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from hetjax import faults
from hetjax.checkpoint import Checkpointer
from hetjax.storage.nvme import PageStore
from hetjax.storage.pages import DIRECT_ALIGN, aligned_empty
from hetjax.train import train
from hetjax.types import CheckpointDamaged, DamagedPageError, TrainingError

P = 1024  # page elements: 4 KiB of fp32, whole O_DIRECT blocks
NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def pages(n: int, seed: int) -> np.ndarray:
    out = aligned_empty(n * P, np.float32, DIRECT_ALIGN)
    out[:] = np.random.default_rng(seed).standard_normal(n * P)
    return out


def flip(path: Path) -> None:
    """One bit of the file's middle byte flipped, as written here (not by the code
    under test)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_every_read_path_checks_each_page(tmp_path):
    store = PageStore(tmp_path / "a", ["master"], num_pages=4, page_elems=P, label="a")
    assert store.links  # raw page files: the O_DIRECT path exists
    data = pages(4, 0)
    store.write("master", 0, data[: 2 * P], borrowed=True).result()  # O_DIRECT writes
    store.write("master", 2, data[2 * P :].copy()).result()  # through TensorStore
    for page in (1, 2):  # one page of each writer
        flip(tmp_path / "a" / "master" / "c" / str(page) / "0")
    named = r"NVMe page damaged: {}/c/{}/0 \(page {} of a master\) reads with CRC-32"

    def damaged(page):
        return pytest.raises(DamagedPageError, match=named.format(".*/a/master", page, page))

    out = aligned_empty(4 * P, np.float32, DIRECT_ALIGN)
    store.read_into("master", 0, out[:P]).result()  # an undamaged page reads as written
    np.testing.assert_array_equal(out[:P], data[:P])
    store.read_into("master", 3, out[:P]).result()
    np.testing.assert_array_equal(out[:P], data[3 * P :])
    with damaged(1):
        store.read_into("master", 0, out[: 2 * P]).result()  # O_DIRECT into aligned memory
    unaligned = np.empty(P + 1, np.float32)[1:]
    assert unaligned.ctypes.data % DIRECT_ALIGN
    with damaged(2):
        store.read_into("master", 2, unaligned).result()  # through TensorStore
    with damaged(1):
        store.read("master", 1, 1).result()  # TensorStore's own buffer
    # a hard link stands in for a write: the sum goes with the file
    linked = PageStore(tmp_path / "b", ["master"], num_pages=4, page_elems=P, label="b")
    linked.link_from(store, "master", [0, 1]).result()
    linked.read_into("master", 0, out[:P]).result()
    with pytest.raises(DamagedPageError, match=r"/b/master/c/1/0 \(page 1 of b master\)"):
        linked.read_into("master", 1, out[:P]).result()


def config(on_nonfinite: str):
    return tiny_config(
        train=dict(steps=6, eval_batches=1, on_nonfinite=on_nonfinite),
        checkpoint=dict(every_steps=2, at_end=True, keep=3),
        offload=NVME,
    )


def holding(workdir: Path, path: Path) -> list[int]:
    """The complete checkpoints under ``workdir`` with a file that is ``path``'s inode
    (a save in flight when the page was damaged may have refused it: the checkpoint
    then stays a temporary directory, ``<step>.orbax-checkpoint-tmp...``)."""
    ino = path.stat().st_ino
    steps = []
    names = [p.name for p in (workdir / "checkpoints").iterdir()]
    for step in sorted(int(name) for name in names if name.isdigit()):
        files = (workdir / "checkpoints" / str(step)).rglob("*")
        if any(f.stat().st_ino == ino for f in files):
            steps.append(step)
    return steps


@pytest.mark.slow  # ~15 s; test_every_read_path_checks_each_page is the default run's check
def test_damaged_live_page_stops_naming_file_page_and_good_checkpoint(tmp_path, monkeypatch):
    """A bit flipped in the first NVMe page file read from step 5 on: the run stops with
    the file, its page and the newest checkpoint whose files are not that file."""
    monkeypatch.setenv("HETJAX_FAULTS", "nvme_bitflip@5")
    faults.flipped.clear()
    with pytest.raises(TrainingError) as raised:
        train(config("stop"), tmp_path, verbose=False)
    (path,) = map(Path, faults.flipped)
    assert path.is_relative_to(tmp_path / "nvme")
    page = int(path.parent.name)  # <array>/c/<page>/0
    message = str(raised.value)
    assert message.startswith(f"step 5: NVMe page damaged: {path} (page {page} of ")
    good = int(re.search(r"newest checkpoint with a good copy is step (\d+)", message)[1])
    sharing = holding(tmp_path, path)
    assert good not in sharing and all(s > good for s in sharing)  # the newest without it
    if sharing:  # hard-linked into the newer ones: named, with what to delete
        assert f"checkpoints {sharing} hold the damaged file itself" in message


@pytest.mark.slow  # ~25 s
def test_damaged_live_page_rolls_back_to_the_good_copy(tmp_path, monkeypatch):
    """train.on_nonfinite=rollback: the run restores the newest good checkpoint into a new
    runtime and trains on, ending bit for bit as a run never damaged (no batch is
    skipped: the data was not at fault); the checkpoints holding the damaged file are
    set aside under checkpoints/damaged/."""
    reference = train(config("rollback"), tmp_path / "ref", verbose=False)
    monkeypatch.setenv("HETJAX_FAULTS", "nvme_bitflip@5")
    faults.flipped.clear()
    result = train(config("rollback"), tmp_path / "run", verbose=False)
    assert len(faults.flipped) == 1
    steps = [r["step"] for r in result.records]
    assert steps[:4] == [1, 2, 3, 4] and steps[-2:] == [5, 6] and len(steps) > 6
    redone = steps[4] - 1  # the checkpoint rolled back to
    np.testing.assert_array_equal(result.losses[4:], reference.losses[redone:])
    jax.tree.map(np.testing.assert_array_equal, result.params, reference.params)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", writing=False)
    try:
        assert ckpt.steps() == [2, 4, 6]
        state, _ = ckpt.restore(6)
        jax.tree.map(np.testing.assert_array_equal, state.params(), reference.params)
    finally:
        ckpt.close()


# -- a real second copy (checkpoint.copy_every) ---------------------------------------------


def live_files(workdir: Path) -> list[Path]:
    return [f for f in (workdir / "nvme").rglob("*") if f.is_file() and f.parent.parent.name == "c"]


@pytest.mark.parametrize("copy_every", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_copied_checkpoint_survives_damage_to_the_live_files(tmp_path, copy_every):
    """Every live NVMe page file damaged after a 2-step run: a checkpoint that copied the
    state (checkpoint.copy_every=1) shares none of their blocks and restores the run's
    params; one that hard-linked them (the default) is the same files, and is damaged."""
    cfg = tiny_config(
        train=dict(steps=2, eval_batches=1),
        checkpoint=dict(every_steps=2, at_end=True, copy_every=copy_every),
        offload=NVME,
    )
    result = train(cfg, tmp_path, verbose=False)
    files = live_files(tmp_path)
    assert files
    saved = {f.stat().st_ino for f in (tmp_path / "checkpoints" / "2").rglob("*")}
    shared = [f for f in files if f.stat().st_ino in saved]
    for f in files:
        flip(f)
    ckpt = Checkpointer(tmp_path / "checkpoints", writing=False)
    try:
        state, _ = ckpt.restore(2)
        if copy_every:
            assert shared == []
            jax.tree.map(np.testing.assert_array_equal, state.params(), result.params)
        else:
            assert shared
            with pytest.raises(CheckpointDamaged, match=r"checkpoint .*/2 is damaged"):
                state.params()
    finally:
        ckpt.close()


@pytest.mark.slow  # ~10 s
def test_copy_every_copies_the_first_and_every_kth_checkpoint(tmp_path, capsys):
    cfg = tiny_config(
        train=dict(steps=6, eval_batches=1),
        checkpoint=dict(every_steps=2, at_end=True, copy_every=2),
        offload=NVME,
    )
    train(cfg, tmp_path, verbose=True)
    log = capsys.readouterr().out
    done = dict(re.findall(r"checkpoint: step (\d) complete: (\S+ \S+) hard-linked", log))
    assert done["2"] == "0 B" and done["6"] == "0 B", log  # copies
    assert done["4"] != "0 B", log  # hard links
    assert re.search(r"checkpoint: step 2 complete: .*copied", log)


@pytest.mark.parametrize("copy", [False, True], ids=["linked", "copied"])
@pytest.mark.slow  # ~5 s each
def test_checkpoint_refuses_a_damaged_live_page(tmp_path, copy):
    """Every live optimizer page file damaged after a step: the checkpoint's background
    writer, linking or copying them, finds them unlike the tier's sums and fails the
    save naming a file; no checkpoint is complete."""
    from equivalence import training_batches

    from hetjax.train import build_runtime
    from hetjax.types import CheckpointError

    cfg = tiny_config(offload=NVME)
    runtime = build_runtime(cfg, tmp_path)
    ckpt = Checkpointer(tmp_path / "checkpoints", link_nvme=not copy)
    try:
        runtime.train_step(training_batches(cfg, 1)[0])
        runtime.settle()
        files = [f for f in live_files(tmp_path) if "optimizer" in f.parts]
        for f in files:
            flip(f)
        ckpt.save(1, runtime.save_state(), {"step": 1})
        with pytest.raises(CheckpointError, match=r"NVMe page damaged: .*/optimizer/.*/c/\d+/0"):
            ckpt.wait()
        assert ckpt.steps() == []
    finally:
        runtime.close()
        ckpt.close_manager(quiet=True)


# -- the sum itself (storage/checksums.py) and checkpoints written before it ------------------


def test_page_checksum_is_crc32c_of_the_bytes():
    """CRC-32C's check value (RFC 3720 B.4: "123456789" -> 0xE3069283), and an array's
    sum is that of its bytes whatever its dtype (bfloat16 has no buffer format)."""
    from hetjax.storage.checksums import page_checksum

    assert page_checksum(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283
    x = np.arange(12, dtype=np.float32).astype(jax.numpy.bfloat16)
    assert page_checksum(x) == page_checksum(np.frombuffer(x.tobytes(), np.uint8))


def test_software_crc32c_says_so_once(monkeypatch):
    import crc32c

    from hetjax.storage import checksums

    monkeypatch.setattr(crc32c, "hardware_based", False)
    monkeypatch.setattr(checksums, "_warned", False)
    row = np.ones(8, np.float32)
    with pytest.warns(UserWarning, match="no CRC-32C instructions") as warned:
        checksums.page_checksum(row)
        checksums.page_checksum(row)
    assert len(warned) == 1


def test_checkpoint_with_zlib_crc32_sums_restores_and_is_checked(tmp_path):
    """A checkpoint written before CRC-32C (its index's sums under ``crc32``, zlib's)
    restores equal, and a flipped bit in it is still found (named CRC-32)."""
    import json
    import zlib

    import tensorstore as ts

    cfg = tiny_config(
        train=dict(steps=2, eval_batches=1),
        checkpoint=dict(every_steps=2, at_end=True, copy_every=1),
        offload=NVME,
    )
    result = train(cfg, tmp_path, verbose=False)
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    indexes = sorted(state_dir.glob("proc*/index.json"))
    assert indexes
    for path in indexes:  # rewritten as the code of 2026-11-28 wrote it
        index = json.loads(path.read_text())
        for stage in index["stages"].values():
            sums = stage.pop("crc32c")
            for kind in sums:
                spec = {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": str(path.parent / kind)},
                }
                arr = ts.open(spec).result()
                first, n = stage["first_page"], stage["num_pages"]
                pages = arr[first : first + n].read().result()
                sums[kind] = [zlib.crc32(p.tobytes()) for p in pages]
            stage["crc32"] = sums
        path.write_text(json.dumps(index))
    ckpt = Checkpointer(tmp_path / "checkpoints", writing=False)
    try:
        state, _ = ckpt.restore(2)
        jax.tree.map(np.testing.assert_array_equal, state.params(), result.params)
    finally:
        ckpt.close()
    page_files = [f for f in state_dir.rglob("*") if f.is_file() and f.parent.parent.name == "c"]
    for f in page_files:
        flip(f)
    ckpt = Checkpointer(tmp_path / "checkpoints", writing=False)
    try:
        state, _ = ckpt.restore(2)
        with pytest.raises(CheckpointDamaged, match=r"is damaged: .*\(CRC-32 of pages"):
            state.params()
    finally:
        ckpt.close()
