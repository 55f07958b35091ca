"""Checkpoints and resume (hetjax/checkpoint.py, the loop in hetjax/train.py).

Crash tests run training in a child process (``python -m hetjax.launch``) and kill it
with SIGKILL at a chosen point, or make its optimizer thread or an NVMe write fail
(``HETJAX_FAULTS``, see ``hetjax/faults.py``); the resumed run must end with exactly the
params of an uninterrupted run. Checkpoints are real orbax directories, the optimizer
state real TensorStore files."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import require, tiny_config
from equivalence import (
    assert_gpt_training_equal,
    assert_trees_close,
    training_batches,
    without_key_bias,
)

from hetjax.checkpoint import Checkpointer, export_params, load_params
from hetjax.checkpoint import main as checkpoint_main
from hetjax.config import ConfigError
from hetjax.optimizer.build import build_optimizer, optax_tree_slots
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.storage.params import NvmeParamStore
from hetjax.train import build_runtime, train
from hetjax.types import CheckpointError, TrainingError

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6

NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def config(offload=None, **sections):
    cfg = tiny_config(
        train=dict(steps=STEPS, eval_batches=1),
        checkpoint=dict(every_steps=2, at_end=True, keep=3),
    )
    cfg = cfg.replace(**sections) if sections else cfg
    return cfg.replace(offload=offload) if offload else cfg


def launch(cfg, workdir, faults="", devices=None, expect_rc=0, flags=()):
    """Runs ``python -m hetjax.launch`` with every key of ``cfg`` as an override."""
    args = [sys.executable, "-m", "hetjax.launch", "--workdir", str(workdir), *flags]
    for section, fields in cfg.to_dict().items():
        args += [f"--config.{section}.{k}={v}" for k, v in fields.items()]
    env = dict(os.environ, HETJAX_FAULTS=faults)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect_rc, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def files_of(path: Path, skip=()) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) by relative name, with its bytes;
    names in ``skip`` left out."""
    path = Path(path)
    if path.is_file():
        return {".": path.read_bytes()}
    return {
        str(f.relative_to(path)): f.read_bytes()
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name not in skip
    }


def saved_params(workdir, step=None):
    ckpt = Checkpointer(Path(workdir) / "checkpoints", writing=False)
    try:
        state, meta = ckpt.restore(step)
    finally:
        ckpt.close()
    return state, meta


def assert_no_nonfinite_files(workdir: Path) -> int:
    """Every complete checkpoint under ``workdir`` and every NVMe page array (both
    copies) holds only finite values. Returns the number of arrays checked."""
    import tensorstore as ts

    checked = 0
    ckpt = Checkpointer(Path(workdir) / "checkpoints", writing=False)
    try:
        for step in ckpt.steps():
            state, _ = ckpt.restore(step)
            for a in jax.tree.leaves(state.stages):
                assert np.all(np.isfinite(a)), f"checkpoint {step}"
                checked += 1
    finally:
        ckpt.close()
    for meta in (Path(workdir) / "nvme").rglob("zarr.json"):
        data = ts.open({"driver": "zarr3", "kvstore": f"file://{meta.parent}"}).result()
        data = data.read().result()
        if np.issubdtype(data.dtype, np.floating):
            assert np.all(np.isfinite(data)), meta.parent
            checked += 1
    return checked


@pytest.fixture(scope="module")
def uninterrupted_nvme(tmp_path_factory):
    """The reference: streaming with optimizer and params on NVMe, never stopped."""
    return train(config(NVME), tmp_path_factory.mktemp("ref"), verbose=False)


# -- crash and resume ---------------------------------------------------------------------


@pytest.mark.parametrize(  # mid-step in the default run (its 8 minutes), the others slow
    "fault",
    [
        "kill_mid_step@5",
        pytest.param("kill_saving@4", marks=pytest.mark.slow),
        pytest.param("kill_saved@4", marks=pytest.mark.slow),
    ],
    ids=["mid-step", "during-background-save", "right-after-save"],
)
def test_sigkill_then_resume_equals_uninterrupted(fault, uninterrupted_nvme, tmp_path):
    cfg = config(NVME)
    launch(cfg, tmp_path, faults=fault, expect_rc=-9)
    resumed = train(cfg, tmp_path, verbose=False)
    assert 0 < len(resumed.losses) < STEPS  # it did resume, not start over
    np.testing.assert_array_equal(resumed.losses, uninterrupted_nvme.losses[-len(resumed.losses) :])
    jax.tree.map(np.testing.assert_array_equal, resumed.params, uninterrupted_nvme.params)
    # the final checkpoint holds the same params
    state, meta = saved_params(tmp_path)
    assert meta["step"] == STEPS
    jax.tree.map(np.testing.assert_array_equal, state.params(), uninterrupted_nvme.params)


@pytest.mark.slow  # the SIGKILL tests resume in-memory runs bit for bit in the default run
def test_resume_in_memory_is_exact(tmp_path):
    cfg = config()
    reference = train(cfg, tmp_path / "ref", verbose=False)
    launch(cfg, tmp_path / "run", faults="kill_saved@2", expect_rc=-9)
    resumed = train(cfg, tmp_path / "run", verbose=False)
    assert len(resumed.losses) == STEPS - 2
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)


# -- failures inside the runtime ----------------------------------------------------------


# Default-run representative: the NVMe write (it reaches the training thread through the
# optimizer thread, which issues the write); the optimizer thread's own raise is -m slow.
@pytest.mark.parametrize(
    "fault, saved, error",
    [
        (
            "nvme_write_fail@4",
            2,
            r"OSError: .*NVMe write of optimizer master pages \d+\+\d+ failed "
            r"\(HETJAX_FAULTS nvme_write_fail\)",
        ),
        pytest.param(
            "optimizer_raise@5",
            4,
            r"updating head: InjectedFault: HETJAX_FAULTS optimizer_raise",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["nvme-write", "optimizer-thread"],
)
def test_runtime_failure_stops_with_its_cause_then_resume_equals_uninterrupted(
    fault, saved, error, uninterrupted_nvme, tmp_path
):
    """A failed NVMe write of the optimizer state, or an exception in the host optimizer
    loop's thread, during step N: the run stops with an error naming the optimizer loop
    and the cause (not a hang: ``launch`` runs it under a timeout; not a traceback), the
    failed step is not checkpointed (the newest checkpoint is the one before), and
    resuming from the workdir ends exactly as the uninterrupted run."""
    cfg = config(NVME)
    proc = launch(cfg, tmp_path, faults=fault, expect_rc=1)
    failed = re.search(r"hetjax: error: the host optimizer loop failed .*" + error, proc.stderr)
    assert failed, proc.stderr[-3000:]
    assert saved_params(tmp_path)[1]["step"] == saved
    resumed = train(cfg, tmp_path, verbose=False)
    assert len(resumed.losses) == STEPS - saved
    np.testing.assert_array_equal(resumed.losses, uninterrupted_nvme.losses[saved:])
    jax.tree.map(np.testing.assert_array_equal, resumed.params, uninterrupted_nvme.params)


def test_param_write_failing_before_the_commit_is_raised_not_dropped(tmp_path, monkeypatch):
    """A write of published params that fails after ``publish`` checked it, but before
    the commit: the commit raises its error. (It used to forget completed writes unread,
    and the next forward read the stage's stale copy.)"""
    store = NvmeParamStore(tmp_path, np.float32, {"head": (0, 1)}, page_elems=4)
    promise, write = ts.Promise.new()
    monkeypatch.setattr(store.disk[0], "write", lambda kind, first, data, **_: write)
    store.publish("head", [np.ones(4, np.float32)])
    promise.set_exception(OSError(errno.EIO, "disk failed"))
    with pytest.raises(OSError, match="disk failed"):
        store.commit()


# -- across placements and device counts --------------------------------------------------


@pytest.mark.slow  # 32 s cold; a ZeRO-3 resume in the default run: test_zero3_checkpoint_...
def test_restore_across_placements_and_device_counts(tmp_path):
    """One run through three placements and two device counts, each leg resuming the
    last one's checkpoint: optimizer and params on NVMe under ZeRO-3 on 4 CPU devices
    (distributed.data_parallel=4) to step 2, in memory on 1 device to step 4, NVMe on 4
    devices again to the end. It ends with the params of an in-memory run never stopped.

    Each leg's checkpoint (params and momentum trace: the ZeRO-3 one gathered from 4
    devices' shards, restored on 1) equals the reference's checkpoint of the same step.

    SGD with momentum (its trace is state every leg must restore): 4 devices sum the
    gradient in another order than 1 device, and AdamW turns that rounding into
    parameter differences above the default tolerance (tests/test_zero.py's docstring),
    which SGD does not. One chain covers both directions (NVMe on 4 devices to memory
    on 1, and back) with one reference run."""
    sgd = dict(name="sgd", lr=0.1, warmup_steps=2)
    zero = config(NVME, optimizer=sgd).replace(distributed=dict(data_parallel=4))
    one_device = config(optimizer=sgd)
    reference = train(one_device, tmp_path / "ref", verbose=False)  # checkpoints 2, 4, 6
    legs = [  # config, devices, fault, the step of the last checkpoint
        (zero, 4, "kill_saved@2", 2),
        (one_device, 1, "kill_saved@4", 4),
        (zero, 4, "", STEPS),
    ]
    previous = 0
    for cfg, devices, fault, step in legs:
        rc = -9 if fault else 0
        proc = launch(cfg, tmp_path, faults=fault, devices=devices, expect_rc=rc)
        if previous:  # it resumed, not started over
            assert f"resumed from checkpoint step {previous}" in proc.stdout + proc.stderr
        previous = step
        state, meta = saved_params(tmp_path)
        assert meta["step"] == step
        assert meta["config"]["distributed"]["data_parallel"] == (4 if devices == 4 else 1)
        expected, _ = saved_params(tmp_path / "ref", step)
        assert state.kinds == expected.kinds == ["master", "trace"]
        for kind in state.kinds:
            assert_trees_close(
                without_key_bias(state.kind_tree(kind)), without_key_bias(expected.kind_tree(kind))
            )
        assert [int(a) for a in state.scalars["embed"]] == [
            int(a) for a in expected.scalars["embed"]
        ]
    assert_trees_close(without_key_bias(state.params()), without_key_bias(reference.params))


# -- divergence guard ---------------------------------------------------------------------


@pytest.mark.parametrize("offload", [None, NVME], ids=["none", "stream-nvme"])
def test_injected_nan_is_skipped(offload, tmp_path, monkeypatch):
    monkeypatch.setenv("HETJAX_FAULTS", "nan@3")
    result = train(config(offload), tmp_path, verbose=False)
    bad = [r["step"] for r in result.records if r.get("nonfinite")]
    assert bad == [3] and len(result.records) == STEPS
    assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(result.params))
    assert np.isfinite(result.losses[-1]) and result.losses[-1] < result.losses[0]
    assert assert_no_nonfinite_files(tmp_path) > 0  # checkpoints and NVMe copies
    if offload is None:
        return
    # both runtimes skip the same way: equal to the in-memory run with the same fault
    reference = train(config(), tmp_path / "ref", verbose=False)
    assert_gpt_training_equal(result, reference)


def test_rollback_goes_back_and_skips_the_bad_batches(tmp_path, monkeypatch):
    """train.on_nonfinite=rollback (docs/guide/checkpoints.md): step 3's gradients are
    NaN, so the run restores the checkpoint of step 2 and goes on with the batch after
    the bad one. The reference, without checkpoints or the rollback code: a runtime
    trained on batches 1, 2 and then 4 to 7 (batch 3 skipped), equal bit for bit in
    losses and params; streaming from NVMe rolls back the same way."""
    monkeypatch.setenv("HETJAX_FAULTS", "nan@3")
    cfg = config(train=dict(steps=STEPS, eval_batches=1, on_nonfinite="rollback"))
    result = train(cfg, tmp_path / "a", verbose=False)
    steps = [r["step"] for r in result.records]
    assert steps == [1, 2, 3, 3, 4, 5, 6]  # step 3 failed, rolled back to 2, redone
    assert result.records[2]["nonfinite"] and not np.isfinite(result.records[2]["grad_norm"])
    batches = training_batches(cfg, STEPS + 1)
    runtime = build_runtime(cfg, tmp_path / "ref")
    try:
        expected = [runtime.train_step(b).loss for b in batches[:2] + batches[3:]]
        params = runtime.params()
    finally:
        runtime.close()
    np.testing.assert_array_equal(result.losses[:2] + result.losses[3:], expected)
    jax.tree.map(np.testing.assert_array_equal, result.params, params)
    assert saved_params(tmp_path / "a")[1]["data_offset"] == 1  # one batch skipped
    stream = train(cfg.replace(offload=NVME), tmp_path / "b", verbose=False)
    assert_gpt_training_equal(stream, result)


def test_rollback_before_the_first_checkpoint_stops_clearly(tmp_path, monkeypatch):
    """A non-finite step before any checkpoint exists has nothing to roll back to: the
    run stops, saying so and what to change, and writes no checkpoint."""
    monkeypatch.setenv("HETJAX_FAULTS", "nan@1")
    cfg = config(train=dict(steps=STEPS, eval_batches=1, on_nonfinite="rollback"))
    with pytest.raises(
        TrainingError,
        match=r"step 1: .*no checkpoint to roll back to yet .*first is written at step 2\)"
        r".*checkpoint.every_steps.*on_nonfinite=skip",
    ):
        train(cfg, tmp_path, verbose=False)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    try:
        assert ckpt.steps() == []
    finally:
        ckpt.close()


def test_stop_on_nonfinite_keeps_checkpoints_clean(tmp_path, monkeypatch):
    monkeypatch.setenv("HETJAX_FAULTS", "nan@3")
    cfg = config(train=dict(steps=STEPS, eval_batches=1, on_nonfinite="stop"))
    with pytest.raises(TrainingError, match=r"step 3: loss .*gradient norm nan.*on_nonfinite=stop"):
        train(cfg, tmp_path, verbose=False)
    state, meta = saved_params(tmp_path)
    assert meta["step"] == 2
    assert_no_nonfinite_files(tmp_path)


def test_consecutive_nonfinite_steps_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HETJAX_FAULTS", "nan@2,nan@3,nan@4")
    cfg = config(train=dict(steps=STEPS, eval_batches=1, max_nonfinite=2))
    with pytest.raises(TrainingError, match="3 non-finite steps in a row"):
        train(cfg, tmp_path, verbose=False)


# -- refusals and errors ------------------------------------------------------------------


def test_resume_never_refuses_then_overwrites(tmp_path, capsys):
    """``resume=never`` refuses a workdir with checkpoints; with ``overwrite`` and a
    start that fails (no data), or a resume that fails, nothing in the workdir changes;
    with ``overwrite`` and a good start the last run's checkpoints and outputs go. A run
    with nothing left to train names the three ways on and leaves summary.json."""
    cfg = config(train=dict(steps=2, eval_batches=1))
    train(cfg, tmp_path, verbose=False)
    for name in ("metrics.jsonl", "summary.json", "loss.png", "tensorboard/events", "trace/a"):
        (tmp_path / name).parent.mkdir(exist_ok=True)  # as a verbose run leaves them
        (tmp_path / name).write_text(f"the last run's {name}\n")
    before = files_of(tmp_path, skip=("hetjax.lock",))
    never = cfg.replace(checkpoint=dict(resume="never"))
    with pytest.raises(TrainingError, match=r"holds checkpoints \(steps \[2\]\).*--overwrite"):
        train(never, tmp_path, verbose=False)
    no_data = dict(path=str(tmp_path / "missing.bin"))
    overwrite = never.replace(checkpoint=dict(overwrite=True))
    for failing in (overwrite.replace(data=no_data), cfg.replace(data=no_data)):
        with pytest.raises(ConfigError, match="data.path.*missing.bin"):
            train(failing, tmp_path, verbose=False)
    assert files_of(tmp_path, skip=("hetjax.lock",)) == before  # untouched
    assert saved_params(tmp_path)[1]["step"] == 2
    fresh = train(overwrite.replace(train=dict(steps=1)), tmp_path, verbose=False)
    assert len(fresh.losses) == 1  # started over
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & {"metrics.jsonl", "loss.png", "tensorboard", "trace"}  # a quiet run's
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1  # the new run's
    summary = (tmp_path / "summary.json").read_bytes()
    capsys.readouterr()
    assert not train(cfg.replace(train=dict(steps=1)), tmp_path).losses
    said = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 1 of 1. To go on:" in said
    assert all(way in said for way in ("train.steps", "--resume=never --overwrite", "--workdir"))
    assert (tmp_path / "summary.json").read_bytes() == summary  # not replaced by a no-op
    assert saved_params(tmp_path)[1]["step"] == 1  # step 2 of the last run is gone
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 1


@pytest.mark.slow  # ~12 s; test_resume_never_refuses_then_overwrites in the default run
def test_launch_resume_flag_refuses(tmp_path):
    cfg = config(train=dict(steps=2, eval_batches=1))
    train(cfg, tmp_path, verbose=False)
    proc = launch(cfg, tmp_path, expect_rc=1, flags=["--resume=never"])
    assert "refusing to overwrite" in proc.stderr
    launch(cfg, tmp_path, flags=["--resume=never", "--overwrite"])
    assert saved_params(tmp_path)[1]["step"] == 2


def test_lockfree_checkpoints_and_resumes(tmp_path):
    """Lock-free mode applies its buffered gradients before a snapshot; a resumed run
    carries on from the checkpoint.

    Which steps each lock-free update averages depends on thread timing, so no two
    lock-free runs are equal bit for bit, not even uninterrupted ones: there is no
    reference run for the whole of it. What is exact: nothing is pending in a checkpoint,
    so the resumed run's first step runs forward on exactly the checkpoint's params and
    on step 5's batch. Its loss equals that of the in-memory runtime loaded with the
    checkpoint (to 1e-5: another runtime's rounding)."""
    lockfree = dict(NVME, optimizer="host")
    cfg = config(lockfree, optimizer=dict(mode="lockfree", warmup_steps=2, lr=3e-3))
    launch(cfg, tmp_path, faults="kill_saved@4", expect_rc=-9)
    state, meta = saved_params(tmp_path)
    assert meta["step"] == 4 and state.scalars["embed"][0] > 0  # updates were applied
    resumed = train(cfg, tmp_path, verbose=False)
    assert len(resumed.losses) == STEPS - 4 and np.isfinite(resumed.losses).all()
    assert saved_params(tmp_path)[1]["step"] == STEPS
    reference = InMemoryRuntime(config(optimizer=dict(warmup_steps=2, lr=3e-3)))
    try:
        reference.load_state(state)
        step5 = training_batches(cfg, 5)[4]  # (1, B, T + 1)
        expected = reference.eval_loss(step5[0])
    finally:
        reference.close()
    np.testing.assert_allclose(resumed.losses[0], expected, rtol=1e-5)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    train(config(train=dict(steps=2, eval_batches=1)), tmp_path, verbose=False)
    other = config(train=dict(steps=4, eval_batches=1), model=dict(d_model=64))
    with pytest.raises(ConfigError, match=r"model\.d_model: checkpoint 32, this run 64"):
        train(other, tmp_path, verbose=False)


@pytest.mark.parametrize(
    "saved, resumed, pattern",
    [
        (
            dict(name="adamw"),
            dict(name="sgd"),
            r"optimizer\.name: checkpoint 'adamw', this run 'sgd'",
        ),
        pytest.param(  # ~10 s, with -m slow
            dict(name="sgd", momentum=0.9),
            dict(name="sgd", momentum=0.0),
            r"optimizer\.momentum: checkpoint 0\.9, this run 0\.0 "
            r"\(state kinds \['master', 'trace'\]\)",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["optimizer-name", "state-kinds"],
)
def test_checkpoint_of_another_optimizer_is_refused(tmp_path, saved, resumed, pattern):
    """Another optimizer, or the same one with other state kinds (sgd with momentum has
    a trace, without none): refused at start-up naming the key, the checkpoint kept."""
    train(config(train=dict(steps=2, eval_batches=1), optimizer=saved), tmp_path, verbose=False)
    other = config(train=dict(steps=4, eval_batches=1), optimizer=resumed)
    with pytest.raises(ConfigError, match=pattern + r".*new --workdir"):
        train(other, tmp_path, verbose=False)
    assert saved_params(tmp_path)[1]["step"] == 2


@pytest.mark.parametrize("runtime_class", [InMemoryRuntime, StreamingRuntime])
def test_runtimes_refuse_state_of_other_kinds(tmp_path, runtime_class):
    """Behind the start-up check, each runtime refuses a state whose kinds are not its
    optimizer's, naming both, before changing anything."""
    momentum = InMemoryRuntime(config(optimizer=dict(name="sgd", momentum=0.9)))
    state = momentum.save_state()
    momentum.close()
    offload = dict(mode="stream" if runtime_class is StreamingRuntime else "none")
    runtime = runtime_class(config(offload, optimizer=dict(name="sgd", momentum=0.0)))
    try:
        before = runtime.params()
        with pytest.raises(
            ConfigError, match=r"state kinds \['master', 'trace'\].* needs \['master'\]"
        ):
            runtime.load_state(state)
        jax.tree.map(np.testing.assert_array_equal, runtime.params(), before)
    finally:
        runtime.close()


def _largest_page(checkpoint: Path) -> Path:
    """The checkpoint's largest page file (``proc<p>/<kind>/c/<page>/0``)."""
    pages = [p for p in (checkpoint / "state").rglob("*") if p.is_file() and "c" in p.parts]
    return max(pages, key=lambda p: p.stat().st_size)


def _damage(checkpoint: Path) -> None:
    """Flips a byte in the middle of the checkpoint's largest page file: stored raw, it
    decodes without error."""
    data = _largest_page(checkpoint)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    data.write_bytes(bytes(raw))


CONSTANT_LR = dict(schedule="constant", warmup_steps=2, lr=3e-3)


@pytest.fixture(scope="module")
def uninterrupted_constant_lr(tmp_path_factory):
    """In memory, a constant learning rate (the same schedule at any train.steps)."""
    cfg = config(train=dict(steps=STEPS, eval_batches=1), optimizer=CONSTANT_LR)
    return train(cfg, tmp_path_factory.mktemp("ref"), verbose=False)


@pytest.mark.parametrize(
    "fault",
    [  # the same fallback path, other causes: one in the default run
        "damaged",
        pytest.param("missing-file", marks=pytest.mark.slow),
    ],
)
def test_damaged_checkpoint_falls_back_to_the_older_one(
    tmp_path, fault, uninterrupted_constant_lr, capsys
):
    """The newest checkpoint damaged (bytes flipped in its data: caught by its CRC-32)
    or with a data file gone: the resuming run warns, naming the checkpoint and the
    damaged file, moves it to ``checkpoints/damaged/4`` and resumes from the older one,
    ending as a run never stopped. (A constant learning rate: the run to step 4 and the
    one to 6 follow the same schedule.)"""
    reference = uninterrupted_constant_lr
    longer = config(train=dict(steps=STEPS, eval_batches=1), optimizer=CONSTANT_LR)
    train(longer.replace(train=dict(steps=4)), tmp_path / "run", verbose=False)
    newest = tmp_path / "run" / "checkpoints" / "4"
    damaged = _largest_page(newest)
    if fault == "damaged":
        _damage(newest)
    else:  # a missing page reads as zeros: its CRC-32 tells
        damaged.unlink()
    capsys.readouterr()
    resumed = train(longer, tmp_path / "run", verbose=True)
    log = capsys.readouterr().out
    pattern = (
        r"warning: checkpoint .*/4 is damaged: 1 of \d+ pages read of stage .* \(CRC-32C of "
        rf"pages \[\d+\]; the first is {re.escape(str(damaged))}\)"
    )
    assert re.search(pattern, log), log
    moved = newest.parent / "damaged" / "4"
    assert f"checkpoint step 4 moved to {moved}; resuming from step 2" in log
    assert "resumed from checkpoint step 2" in log
    np.testing.assert_array_equal(resumed.losses, reference.losses[2:])  # steps 3 to 6
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)


@pytest.mark.slow  # ~5 s: a refusal, the damaged-checkpoint fallback's counterpart
def test_checkpoint_of_another_format_is_refused(tmp_path):
    cfg = config(train=dict(steps=4, eval_batches=1), optimizer=CONSTANT_LR)
    train(cfg.replace(train=dict(steps=2)), tmp_path / "run", verbose=False)
    meta = tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 99}))
    pattern = r"checkpoint .*/2 has format 99, this hetjax reads format 2: resume it with"
    with pytest.raises(CheckpointError, match=pattern):
        train(cfg, tmp_path / "run", verbose=False)


@pytest.mark.slow  # ~10 s: the fallback test is the default run's check of damage
def test_damaged_only_checkpoint_is_refused(tmp_path):
    """With no older checkpoint to fall back to, a damaged one is refused, naming it."""
    cfg = config(train=dict(steps=2, eval_batches=1))
    train(cfg, tmp_path / "run", verbose=False)
    _damage(tmp_path / "run" / "checkpoints" / "2")
    pattern = r"checkpoint .*/2 is damaged: .*Delete .*/2 to resume from the start"
    with pytest.raises(CheckpointError, match=pattern):
        train(cfg.replace(train=dict(steps=4)), tmp_path / "run", verbose=False)


@pytest.mark.slow  # ~15 s; the checkpoint tier stays covered by the restore chain and SIGKILL tests
def test_synchronous_saves_equal_background_ones_and_keep_deletes_old(tmp_path):
    """checkpoint.async_save=false writes the same checkpoints as the background writer;
    checkpoint.keep=2 leaves only the two newest on disk."""
    every = dict(every_steps=1, at_end=True)
    cfg = config(train=dict(steps=4, eval_batches=1), checkpoint=dict(every, keep=10))
    background = train(cfg, tmp_path / "async", verbose=False)
    sync = cfg.replace(checkpoint=dict(async_save=False, keep=2))
    waited = train(sync, tmp_path / "sync", verbose=False)
    assert sorted(p.name for p in (tmp_path / "sync" / "checkpoints").iterdir()) == ["3", "4"]
    assert len(list((tmp_path / "async" / "checkpoints").iterdir())) == 4
    for step in (3, 4):
        (a, a_meta), (b, b_meta) = (saved_params(tmp_path / d, step) for d in ("async", "sync"))
        assert a_meta["step"] == b_meta["step"] == step
        jax.tree.map(np.testing.assert_array_equal, a.stages, b.stages)
        jax.tree.map(np.testing.assert_array_equal, a.scalars, b.scalars)
    np.testing.assert_array_equal(waited.losses, background.losses)


def test_unwritable_checkpoint_dir(tmp_path):
    cfg = config(checkpoint=dict(dir="/proc/hetjax-checkpoints"))
    with pytest.raises(CheckpointError, match="not writable.*checkpoint.dir"):
        train(cfg, tmp_path, verbose=False)


def _private_tmpfs_works() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0
    )


def test_full_disk_leaves_earlier_checkpoints_loadable(tmp_path):
    """A real full disk: a small tmpfs in a private mount namespace (``unshare``). The
    first checkpoints fit, a later one does not: the run stops with a clear error, and the
    complete checkpoints (copied out before the namespace and its tmpfs go) restore to
    exactly the state of a run on a roomy disk at the same step."""
    require(
        _private_tmpfs_works(),
        "unshare -Urm (util-linux, with unprivileged user namespaces enabled: "
        "sysctl kernel.unprivileged_userns_clone=1) for a private tmpfs",
    )
    mnt, survived = tmp_path / "small", tmp_path / "survived"
    mnt.mkdir()
    cfg = config(train=dict(steps=STEPS, eval_batches=1), checkpoint=dict(dir=str(mnt), keep=10))
    args = " ".join(
        f"'--config.{s}.{k}={v}'" for s, f in cfg.to_dict().items() for k, v in f.items()
    )
    script = (
        f"mount -t tmpfs -o size=1200k tmpfs {mnt} && "
        f"{sys.executable} -m hetjax.launch --workdir {tmp_path / 'run'} {args}; "
        f"echo rc=$?; cp -a {mnt} {survived}"
    )
    proc = subprocess.run(
        ["unshare", "-Urm", "bash", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "rc=1" in out, out[-3000:]
    assert "checkpoints already" in out and "intact" in out, out[-3000:]
    roomy = cfg.replace(checkpoint=dict(dir=""))
    train(roomy, tmp_path / "roomy", verbose=False)
    ckpt = Checkpointer(survived)
    try:
        steps = ckpt.steps()
        assert steps and steps[0] == 2 and steps[-1] < STEPS, steps  # the later ones failed
        for step in steps:
            state, meta = ckpt.restore(step)
            expected, expected_meta = saved_params(tmp_path / "roomy", step)
            assert meta["step"] == expected_meta["step"] == step
            assert meta["data_offset"] == expected_meta["data_offset"]
            jax.tree.map(np.testing.assert_array_equal, state.stages, expected.stages)
            jax.tree.map(np.testing.assert_array_equal, state.scalars, expected.scalars)
    finally:
        ckpt.close()


# -- export and format --------------------------------------------------------------------


def test_export_params_for_inference(tmp_path, capsys):
    """Export, refusals, and the listing: a checkpoint whose metadata is gone is not
    listed complete but named with what is missing."""
    result = train(config(train=dict(steps=4, eval_batches=1)), tmp_path, verbose=False)
    assert checkpoint_main(["--workdir", str(tmp_path), "--export", str(tmp_path / "out")]) == 0
    exported = load_params(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, exported, result.params)
    with pytest.raises(CheckpointError, match="exists"):
        export_params(result.params, tmp_path / "out")
    assert checkpoint_main(["--workdir", str(tmp_path / "none")]) == 1
    shutil.rmtree(tmp_path / "checkpoints" / "4" / "meta")
    capsys.readouterr()
    assert checkpoint_main(["--workdir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == [
        f"{tmp_path}/checkpoints: complete checkpoints at steps [2]",
        f"{tmp_path}/checkpoints/4: not complete, its metadata (meta/metadata) is missing "
        "(the newest: a run resuming stops on it); delete it",
    ]


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_state_kinds_agree_between_runtimes(name):
    """The in-memory optax state and the slab optimizer name their state kinds alike,
    so a checkpoint of one restores into the other."""
    from hetjax.parallel.single import Shardings
    from hetjax.storage.pages import SlabLayout
    from models import build_model

    cfg = config(optimizer=dict(name=name))
    params = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    tx = build_optimizer(cfg.optimizer, STEPS, params)
    kinds = [k for k in optax_tree_slots(jax.eval_shape(tx.init, params), params) if k]
    layouts = {"head": SlabLayout.from_params(params["head"], 4096)}
    slab = SlabOptimizer(cfg.optimizer, STEPS, layouts, Shardings.single_device().host, "float32")
    assert ["master", *kinds] == slab.kinds
