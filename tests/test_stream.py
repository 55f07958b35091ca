"""offload.mode=stream equals offload.mode=none (fp32 compute, same seed and data)."""

import gc

import jax
import numpy as np
import pytest
from equivalence import assert_gpt_training_equal, check_fp16_overflow_skips_then_trains

from hetjax.config import ConfigError
from hetjax.executor import StreamingRuntime, plan_device_memory
from hetjax.placement import live_bytes_by_kind
from hetjax.train import train
from models import build_model


def _check_tokens():
    return np.random.default_rng(7).integers(0, 256, (2, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import tiny_config

    return train(tiny_config(), tmp_path_factory.mktemp("ref"), verbose=False)


@pytest.mark.parametrize(
    "offload",
    [
        dict(mode="stream", prefetch_depth=2),
        dict(mode="stream", prefetch_depth=1),
        dict(mode="stream", prefetch_depth=3),
        dict(mode="stream", activations="host"),
        dict(mode="stream", keep_blocks=1),
        dict(mode="stream", keep_blocks=2, activations="host"),
    ],
    ids=["depth2", "depth1", "depth3", "activations_host", "keep1", "keep_all"],
)
def test_stream_equals_none(reference, tiny, tmp_path, offload):
    config = tiny(offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), _check_tokens())


def test_stream_equals_none_with_grad_accum(tiny, tmp_path):
    accum = dict(steps=5, batch_size=4, seq_len=16, grad_accum=2, eval_batches=0)
    ref = train(tiny(train=accum), tmp_path / "ref", verbose=False)
    config = tiny(train=accum, offload=dict(mode="stream", prefetch_depth=1))
    result = train(config, tmp_path / "stream", verbose=False)
    assert_gpt_training_equal(result, ref, build_model(config.model), _check_tokens())


@pytest.mark.parametrize("keep, fraction", [(0, 0.7), (1, 0.85)], ids=["recompute", "keep1"])
def test_streams_within_device_budget(tiny, tmp_path, keep, fraction):
    """An 8-layer model whose params exceed the device budget trains, and the device-kind
    live bytes, sampled after every dispatch, stay within the budget (also with two blocks
    keeping their in-block activations from forward to backward)."""
    model = dict(num_layers=8, d_model=192, num_heads=4, max_seq_len=32)
    probe_config = tiny(model=model, offload=dict(mode="stream"))
    params_bytes = build_model(probe_config.model).param_count() * 4
    budget = int(params_bytes * fraction)
    config = tiny(
        model=model,
        offload=dict(mode="stream", prefetch_depth=2, keep_blocks=keep),
        memory=dict(device_budget=budget, page_size="4KiB"),
        train=dict(steps=2, batch_size=2, seq_len=16, eval_batches=1),
    )
    # Garbage of earlier tests (reference cycles holding device arrays) must not be
    # freed while samples are taken: it would lower the census below the ledger.
    gc.collect()
    samples = []
    runtime = StreamingRuntime(
        config, probe=lambda rt: samples.append(live_bytes_by_kind().get("device", 0))
    )
    assert runtime.plan.resident_blocks < 8  # really streaming
    assert runtime.plan.required <= budget
    batch = np.random.default_rng(0).integers(0, 256, (1, 2, 17)).astype(np.int32)
    baseline = live_bytes_by_kind().get("device", 0) - sum(
        a.nbytes for a in jax.tree.leaves(runtime.resident)
    )
    losses = [runtime.train_step(batch).loss for _ in range(3)]
    assert losses[-1] < losses[0]
    peak = max(samples) - baseline
    assert len(samples) >= 3 * 16
    assert 0 < peak <= budget, (peak, budget)
    # The ledger saw the same holdings the live-array census saw (tokens aside).
    assert abs(runtime.ledger.peak["device"] - peak) <= 0.05 * peak, (
        runtime.ledger.peak["device"],
        peak,
    )
    assert params_bytes > budget


def test_budget_too_small_fails_at_start_up(tiny):
    config = tiny(offload=dict(mode="stream"), memory=dict(device_budget="64KiB"))
    with pytest.raises(
        ConfigError,
        match=r"device_budget 64.00 KiB cannot hold one stage "
        r"plus its activations in device memory.*short by",
    ):
        StreamingRuntime(config)


def test_planner_prefers_prefetch_then_residency():
    kw = dict(
        num_layers=10,
        requested_depth=3,
        embed_head=100,
        block_slab=50,
        grad_slab=10,
        checkpoints=40,
        working_set=30,
    )
    fixed = 100 + 40 + 20 + 30
    unlimited = plan_device_memory(budget=0, **kw)
    assert unlimited.prefetch_depth == 3 and unlimited.resident_blocks == 0
    tight = plan_device_memory(budget=fixed + 2 * 50, **kw)
    assert tight.prefetch_depth == 1 and tight.resident_blocks == 0
    roomy = plan_device_memory(budget=fixed + 7 * 50, **kw)
    assert roomy.prefetch_depth == 3 and roomy.resident_blocks == 3
    assert roomy.required <= fixed + 7 * 50
    everything = plan_device_memory(budget=10**9, **kw)
    assert everything.resident_blocks == 10


def test_stream_through_launch_reports_memory(tmp_path):
    import json

    from hetjax.launch import main

    workdir = tmp_path / "run"
    rc = main(
        [
            "--workdir",
            str(workdir),
            "--config.offload.mode=stream",
            "--config.memory.device_budget=64MiB",
            "--config.train.steps=2",
            "--config.train.batch_size=4",
            "--config.train.eval_batches=1",
            "--config.data.corpus_bytes=100000",
        ]
    )
    assert rc == 0
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert 0 < r["device_bytes_peak"] <= 64 * 2**20
        assert r["host_bytes"] > 3.2e6 * 4 * 3  # fp32 master + Adam m, v at least
        assert 0 < r["optimizer_s"] < r["step_time_s"]


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_stream_fp16_skips_overflow_then_trains(tiny, params):
    """A skipped step must leave every tier untouched: with params on NVMe, the forward
    after a skip must read the committed generation, not the dropped update's."""
    model = dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float16")
    config = tiny(
        model=model,
        offload=dict(mode="stream", params=params),
        memory=dict(page_size="16KiB"),
        train=dict(steps=5, batch_size=4, seq_len=16, loss_scale_init=2.0**60),
    )
    runtime = StreamingRuntime(config)
    batch = np.random.default_rng(0).integers(0, 256, (1, 4, 17)).astype(np.int32)
    check_fp16_overflow_skips_then_trains(runtime, batch)
