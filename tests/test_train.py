import importlib.util
import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from equivalence import (
    assert_losses_close,
    assert_trees_close,
    check_fp16_overflow_skips_then_trains,
)

from hetjax.launch import main
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.train import train
from hetjax.types import LossScale

PNG = b"\x89PNG\r\n\x1a\n"


# what the default output leaves to --verbose (docs/guide/running.md#the-runs-output)
TERMS = ("prefetch depth", "resident", "boundar", "working set", "copies", "ledger")


def _check_default_run(workdir, out, verbose=False):
    """The default run's outputs: it streamed, kept the optimizer state on NVMe, said so
    in a line (the plan and the summary in full with --verbose, their terms explained in
    the guide), said what takes time, and wrote the timeline PNG, loss.png and the run
    summary."""
    assert "offload.mode=stream" in out and "stream from host RAM" in out, out
    assert "measuring this machine" in out and "step 1 compiles" in out, out
    assert "NVMe tier: " in out and "any directory, best on an NVMe SSD" in out, out
    full = ("plan for gpt", "summary: where the state lived", "lanes (s/step)", *TERMS)
    assert all((term in out) == verbose for term in full), out
    assert "SSD wear" not in out and "TB a day" not in out or verbose, out
    run = json.loads((workdir / "summary.json").read_text())["run"]
    assert run["tiers"]["optimizer"] == "nvme" and run["tiers"]["params"] == "host"
    assert run["moved_bytes"]["nvme_read"] > 0 and run["moved_bytes"]["host_to_device"] > 0
    assert run["in_memory_step_s"] > 0
    # the plan's batch cost repeated (planning/batch.py)
    assert "summary: batch cost:" in out and "of the compute bound" in run["batch_cost"][0]
    assert Path(run["paths"]["timeline"]).read_bytes()[:8] == PNG
    assert (workdir / "loss.png").read_bytes()[:8] == PNG
    assert any((workdir / "nvme").iterdir())
    return run


def test_default_config_streams_with_nvme(tmp_path, capsys):
    # The default run (configs/gpt_tiny.py) cut to a few steps: auto picks streaming and
    # NVMe from its budgets; the trace and the in-memory reference cut with it.
    workdir = tmp_path / "run"
    args = ["--workdir", str(workdir), "--config.train.steps=4", "--config.train.trace_every=4"]
    rc = main([*args, "--config.train.in_memory_steps=1", "--config.train.eval_batches=1"])
    assert rc == 0
    _check_default_run(workdir, capsys.readouterr().out)


@pytest.mark.slow  # the whole default run: ~3 min on 2 CPU cores
def test_default_run_loss_falls_clearly(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert main(["--workdir", str(workdir), "--verbose"]) == 0
    run = _check_default_run(workdir, capsys.readouterr().out, verbose=True)
    loss = run["losses"]
    assert loss["first"] > 5.0  # untrained byte model: ~log(256) = 5.55
    assert loss["last_tenth_mean"] < 0.6 * loss["first"], loss
    assert loss["val"] < 0.55 * loss["first"], loss


def test_grad_accum_equals_full_batch(tmp_path, tiny):
    # SGD, because the property is "accumulated gradient == full-batch gradient" and SGD
    # is linear in it. Adam would also normalise the key-projection bias, whose gradient
    # is exactly zero in exact arithmetic (softmax is shift-invariant), turning rounding
    # noise of different summation orders into lr-sized steps.
    sgd = dict(name="sgd", lr=0.3, warmup_steps=0)
    full = train(tiny(optimizer=sgd), tmp_path / "a", verbose=False)
    accum = train(
        tiny(
            optimizer=sgd,
            train=dict(steps=5, batch_size=4, seq_len=16, grad_accum=2, eval_batches=0),
        ),
        tmp_path / "b",
        verbose=False,
    )
    assert full.losses[-1] < full.losses[0] - 0.1  # the steps did something
    assert_losses_close(accum.losses, full.losses)
    assert_trees_close(accum.params, full.params)


def test_metrics_jsonl_and_launch(tmp_path, capsys):
    workdir = tmp_path / "run"
    rc = main(
        [
            "--config",
            "gpt_tiny",
            "--workdir",
            str(workdir),
            "--config.train.steps=3",
            "--config.train.batch_size=4",
            "--config.train.eval_batches=1",
            "--config.data.corpus_bytes=100000",
            "--config.train.log_every=1",
            "--config.train.eval_every=2",
        ]
    )
    assert rc == 0
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    # validation every 2 steps (the last step's is the final one, in summary.json)
    assert ["val_loss" in r for r in records] == [False, True, False]
    assert 0 < records[1]["val_loss"] < 10
    assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for r in records:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "tflops"} <= r.keys()
        assert r["step_time_s"] > 0 and r["tflops"] > 0
        assert abs(r["tokens_per_s"] * r["step_time_s"] - 4 * 128) < 1e-6
    out = capsys.readouterr().out
    assert "step      3  loss" in out and "final validation loss" in out
    assert "step      2  validation loss" in out and f"loss curves: {workdir / 'loss.png'}" in out
    board = tensorboard_scalars(workdir / "tensorboard")
    assert [s for s, _ in board["loss"]] == [1, 2, 3]
    assert [v for _, v in board["loss"]] == pytest.approx([r["loss"] for r in records])
    assert board["val_loss"] == [(2, pytest.approx(records[1]["val_loss"]))]
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 3


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in ``logdir``: tag -> [(step, value)]
    (the files are TFRecords of Event protos, read with tensorboardX's own proto)."""
    require(importlib.util.find_spec("tensorboardX") is not None, "tensorboardX (.[test])")
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its CRC, the record, its CRC
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_loss_scale_dynamics():
    s = LossScale.create(8.0, period=2)
    s = s.update(jnp.bool_(True))
    assert float(s.scale) == 8.0 and int(s.good_steps) == 1
    s = s.update(jnp.bool_(True))
    assert float(s.scale) == 16.0 and int(s.good_steps) == 0  # doubled after 2 good steps
    s = s.update(jnp.bool_(False))
    assert float(s.scale) == 8.0 and int(s.good_steps) == 0  # halved on overflow


def test_fp16_skips_overflowing_step(tiny):
    config = tiny(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float16"),
        train=dict(steps=5, batch_size=4, seq_len=16, loss_scale_init=2.0**60),
    )
    runtime = InMemoryRuntime(config)  # 2^60 overflows fp16 gradients
    batch = np.random.default_rng(0).integers(0, 256, (1, 4, 17)).astype(np.int32)
    check_fp16_overflow_skips_then_trains(runtime, batch)


def test_learning_rate_schedule():
    from hetjax.config import OptimizerConfig
    from hetjax.optimizer.build import learning_rate_schedule

    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    lr = [float(learning_rate_schedule(cfg, 14)(n)) for n in range(16)]
    np.testing.assert_allclose(lr[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)  # first step > 0
    assert lr[4] == 1.0 and abs(lr[9] - 0.55) < 1e-6 and abs(lr[14] - 0.1) < 1e-6
    assert all(a >= b for a, b in zip(lr[4:], lr[5:], strict=False))
    const = OptimizerConfig(lr=2.0, warmup_steps=0, schedule="constant")
    assert float(learning_rate_schedule(const, 10)(7)) == 2.0


@pytest.mark.slow  # ~13 s (the default run's time, 2026-11-27)
def test_remat_does_not_change_training(tmp_path, tiny):
    from equivalence import assert_gpt_training_equal

    plain = train(tiny(), tmp_path / "a", verbose=False)
    remat = train(
        tiny(model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, remat=True)),
        tmp_path / "b",
        verbose=False,
    )
    assert_gpt_training_equal(remat, plain)
