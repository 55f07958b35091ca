"""offload.mode=stream equals offload.mode=none (fp32 compute, same seed and data)."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    assert_evaluation_equal,
    assert_gpt_training_equal,
    assert_logits_close,
    assert_losses_close,
    assert_trees_close,
    check_fp16_overflow_skips_then_trains,
    check_tokens,
    without_key_bias,
)

from hetjax import memory, timeline
from hetjax.config import ConfigError
from hetjax.memory import Sizes, plan_device
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.single import SingleDevice, live_bytes_by_kind
from hetjax.placement import Placement
from hetjax.runtime.stages import functions as stages
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import StateFormat
from hetjax.storage.nvme import PageStore
from hetjax.train import train
from models import build_model

ADAM = StateFormat.fp32(["mu", "nu"])  # AdamW's state: fp32 master, mu and nu


@pytest.fixture(scope="module")
def reference(reference_run):
    from conftest import tiny_config

    return reference_run(tiny_config())


# Default-run tier representatives (keep out of -m slow): [depth2] for params on host,
# [activations_host] for activations on host, each offloaded vs in memory.
@pytest.mark.parametrize(
    "offload",
    [
        dict(mode="stream", prefetch_depth=2),
        pytest.param(dict(mode="stream", prefetch_depth=1), marks=pytest.mark.slow),
        pytest.param(dict(mode="stream", prefetch_depth=3), marks=pytest.mark.slow),
        dict(mode="stream", activations="host"),
        dict(mode="stream", keep_blocks=1),
        dict(mode="stream", keep_blocks=2, activations="host"),
        dict(mode="stream", keep_blocks=1, keep_level="matmuls"),
        dict(mode="stream", keep_blocks=1, swap_blocks=1),
        dict(mode="stream", swap_blocks=1, activations="host", prefetch_depth=1),
    ],
    ids=[
        "depth2",
        "depth1",
        "depth3",
        "activations_host",
        "keep1",
        "keep_all",
        "keep1_matmuls",
        "keep1_swap1",
        "swap1_recompute1",
    ],
)
@pytest.mark.guards(tier="host", parallel="single")
def test_stream_equals_none(reference, tiny, tmp_path, offload):
    config = tiny(offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())


def _nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "attention, levels",
    [("blockwise", ["matmuls", "all"]), ("reference", ["matmuls", "probs", "all"])],
)
def test_keep_levels_hold_less_and_change_nothing(tiny, attention, levels):
    """offload.keep_level: a kept GPT block's vjp holds in-block activations beyond its
    inputs (what a recomputing block holds) at every level, strictly fewer at each level
    than at the next (``probs`` only with the reference attention, which has the
    probabilities as a tensor), and exactly the bytes the device plan counts; backward
    from each level's vjp equals backward from all of them."""
    config = tiny(
        model=dict(max_seq_len=64, attention=attention, attention_block=16),
        train=dict(seq_len=64),
    )
    model = build_model(config.model)
    layouts = stage_layouts(model, 4096)
    fns = stages.StageFunctions(model, layouts, SingleDevice())
    block = layouts["block"]
    pages = block.to_pages(block.flatten(model.init_stage("block", jax.random.key(0))))
    x = jax.random.normal(jax.random.key(1), (2, 64, 32))  # (B, T, D)
    kept = fns.kept_bytes(2, 64, x.dtype)
    assert list(kept) == levels
    sizes = [_nbytes((pages, x))] + [kept[level] for level in levels]
    assert sizes == sorted(set(sizes)), kept
    (y_all, _), vjp_all = fns.kept_forward("all")(pages, x)
    assert _nbytes(vjp_all) == kept["all"]
    expected = fns.block_bwd_kept(vjp_all, x)
    for level in levels[:-1]:
        (y, _), vjp = fns.kept_forward(level)(pages, x)
        assert _nbytes(vjp) == kept[level]
        np.testing.assert_array_equal(y, y_all)
        assert_trees_close(fns.block_bwd_kept(vjp, x), expected)


@pytest.mark.parametrize(
    "offload",
    [
        dict(keep_blocks=2, keep_level="probs"),
        # ~10 s; keep1_swap1 and swap1_recompute1 cover swapping in the default run
        pytest.param(dict(swap_blocks=2, swap_level="probs"), marks=pytest.mark.slow),
    ],
    ids=["keep_probs", "swap_probs"],
)
def test_reference_attention_keeps_or_swaps_probs_and_equals_none(tiny, tmp_path, offload):
    """offload.keep_level=probs and offload.swap_level=probs (the attention
    probabilities kept, or moved too), which the reference attention supports, train as
    offload.mode=none with the reference attention."""
    none, stream = (
        train(tiny(model=dict(attention="reference"), offload=o), tmp_path / m, verbose=False)
        for m, o in [("none", dict(mode="none")), ("stream", dict(mode="stream", **offload))]
    )
    model = build_model(tiny(model=dict(attention="reference")).model)
    assert_gpt_training_equal(stream, none, model, check_tokens())


def test_blockwise_attention_cannot_keep_probs(tiny, tmp_path):
    config = tiny(offload=dict(mode="stream", keep_blocks=1, keep_level="probs"))
    with pytest.raises(ConfigError, match=r"supports only matmuls, all.*model.attention="):
        train(config, tmp_path, verbose=False)


# Default-run tier representative (keep out of -m slow): activations on NVMe.
def test_nvme_boundaries_equal_none(reference, tiny, tmp_path, monkeypatch):
    """offload.activations=nvme, read ahead one block: block 1's checkpoint is held in
    RAM for backward (never written), block 0's comes back from the TensorStore file."""
    monkeypatch.setattr(memory, "IO_READAHEAD", 1)
    config = tiny(offload=dict(mode="stream", activations="nvme"))
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    checkpoint = 4 * 16 * 32 * 4  # (B, T, D) fp32
    for r in result.records:
        assert r["nvme_write_bytes"] == checkpoint and r["nvme_read_bytes"] == checkpoint
    assert (tmp_path / "nvme" / "activations" / "boundaries" / "zarr.json").is_file()


ACCUM = dict(steps=5, batch_size=4, seq_len=16, grad_accum=2, eval_batches=1)
# Summed over micro-batches, gradients round differently from the reference's (float32,
# ~1e-7); AdamW divides the small ones by their own size and turns that into parameter
# differences beyond 1e-5 of a tensor's max (tests/equivalence.py, tests/test_zero.py).
# SGD with momentum compares the accumulation itself at the same tolerance.
ACCUM_SGD = dict(name="sgd", lr=0.1)


@pytest.fixture(scope="module")
def accum_reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(train=ACCUM, optimizer=ACCUM_SGD)
    return train(config, tmp_path_factory.mktemp("accum"), verbose=False)


@pytest.mark.parametrize("activations", ["device", "nvme"])
def test_stream_equals_none_with_grad_accum(
    accum_reference, tiny, tmp_path, monkeypatch, activations
):
    monkeypatch.setattr(memory, "IO_READAHEAD", 1)  # nvme: block 0's checkpoint from disk
    config = tiny(
        train=ACCUM,
        optimizer=ACCUM_SGD,
        offload=dict(mode="stream", prefetch_depth=1, activations=activations),
    )
    result = train(config, tmp_path / "stream", verbose=False)
    assert_gpt_training_equal(result, accum_reference, build_model(config.model), check_tokens())


@pytest.fixture(scope="module")
def sgd_reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(optimizer=ACCUM_SGD)
    return train(config, tmp_path_factory.mktemp("sgd"), verbose=False)


# Default-run representative: [2] (chunks of the micro-batch's rows, params on the host).
@pytest.mark.parametrize(
    "offload",
    [
        dict(batch_chunks=2),
        pytest.param(
            dict(batch_chunks=4, activations="host", params="nvme", optimizer="nvme"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["2", "4_host_nvme"],
)
def test_batch_chunks_equal_none(sgd_reference, tiny, tmp_path, offload):
    """offload.batch_chunks: the recomputed blocks and the head run the micro-batch in
    chunks of rows, their gradients summed over the chunks (ACCUM_SGD: the sums round
    differently from the whole batch's dots, which SGD compares at 1e-5; AdamW would
    amplify them, as for train.grad_accum)."""
    config = tiny(optimizer=ACCUM_SGD, offload=dict(mode="stream", **offload))
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, sgd_reference, build_model(config.model), check_tokens())


# -- bf16 and fp16 compute (the GPU fast path) -------------------------------------------
#
# Offloaded vs in memory in the same compute dtype, the host tier (optimizer state and
# params in host RAM) and the NVMe tier (both on NVMe). The tolerance, derived: both runs
# start from the same fp32 masters and compute with the same compute-dtype casts of them
# (each stage casting its own params: models/staged.py), through the same stage functions;
# fp16 skips, halves and grows its loss scale by the same rule. So the first step's loss
# is bit-identical (measured: a step's gradients are too, in bf16 and fp16), and a
# difference there means the two compute different functions, as they did before the
# reference cast every param (it kept LayerNorm and embedding params in fp32, and added
# the tied embedding's two fp16 gradients in fp16). After that the runs differ only in
# how their fp32 optimizers round (optax's jitted update vs the slab update), as in fp32
# compute, where the tolerance is 1e-5 of a tensor; SGD with momentum passes those
# differences on linearly (AdamW amplifies them: tests/test_zero.py's docstring). The
# compute dtype widens them only where a master that differs in its last fp32 bits flips
# its rounding to the compute dtype: about 1 in 2^16 such masters in bf16 (8 of fp32's 24
# significand bits kept), 1 in 2^13 in fp16 (11 kept), each moving one parameter by one
# ulp of the compute dtype (2^-8, 2^-11 relative) in the next forward, far below 1e-5 of a
# loss or a tensor. Measured (tiny model, 5-6 steps, both tiers alike): losses
# bit-identical; final params within 1.5e-7 (bf16) and 1.4e-7 (fp16) of a tensor's max;
# validation loss bit-identical in bf16, 5.6e-7 apart in fp16; final logits equal in bf16,
# one fp16 ulp apart in fp16 (tests/equivalence.py allows one); the same loss scales and
# skipped steps.
SGD = dict(name="sgd", lr=0.1)
# From 2^18 the fp16 gradients overflow: step 1 is skipped and the scale halved, step 3
# again, and with a growth period of 2 it doubles once at the end.
FP16_SCALE = dict(loss_scale_init=2.0**18, loss_scale_period=2, steps=6)
TIERS = {
    "host": dict(mode="stream", optimizer="host", params="host"),
    "nvme": dict(mode="stream", optimizer="nvme", params="nvme"),
}


def _dtype_config(dtype: str, offload: dict, attention: str = "reference"):
    from conftest import tiny_config

    # The reference attention by default (the blockwise one: test_blockwise_fp16_...).
    train_overrides = FP16_SCALE if dtype == "float16" else {}
    model = dict(
        num_layers=2,
        d_model=32,
        num_heads=4,
        max_seq_len=32,
        compute_dtype=dtype,
        attention=attention,
    )
    return tiny_config(
        model=model,
        optimizer=SGD,
        offload=offload,
        memory=dict(page_size="16KiB"),  # several pages a stage
        train=dict(batch_size=4, seq_len=16, log_every=1, eval_batches=2, **train_overrides),
    )


@pytest.fixture(scope="module")
def dtype_reference(tmp_path_factory):
    """offload.mode=none in a compute dtype, run once per dtype."""
    runs = {}

    def reference(dtype: str):
        if dtype not in runs:
            config = _dtype_config(dtype, dict(mode="none"))
            runs[dtype] = train(config, tmp_path_factory.mktemp(dtype), verbose=False)
        return runs[dtype]

    return reference


# The params' tolerance per compute dtype, in its ulps (eps: fp16 2^-10, bf16 2^-7) where
# one is needed. fp16: the stage functions' and the whole model's fp16 gradients differ in
# their last fp32 bits from the first update (1.5e-6 of a bias), and once a master param's
# cast to fp16 rounds the other way the two runs compute with params one fp16 ulp apart:
# after 6 steps the params differ by at most 0.93 eps of a tensor's largest magnitude
# (0.91 eps in norm), 1.01 eps (0.93) with the blockwise attention, on both tiers
# (2026-11-26, 2-core AMD EPYC; before, 1 ulp on Intel and AMD machines too, and 1e-5 on
# some). The tolerance is twice the largest: 2 eps. The losses, the validation loss and
# the loss-scale trajectory stay strict (1e-5; measured at most 4.2e-6), the logits
# within one fp16 rounding (equivalence.assert_logits_close; measured 0.51 eps). bf16
# and fp32 runs agree at 1e-5 (bf16 measured 1.6e-7): no ulps needed.
PARAM_ULPS = {"float16": 2}


def rounding_rtol(dtype: str) -> float:
    """The dtype's rounding: its unit roundoff, eps / 2 (bf16 2^-8, fp16 2^-11)."""
    return float(jnp.finfo(jnp.dtype(dtype)).eps) / 2


def assert_dtype_training_equal(result, reference, dtype: str, model) -> None:
    """Streamed vs in-memory training in compute dtype ``dtype``: losses, validation
    loss, summary and logits at 1e-5 (the logits within one rounding of the dtype), the
    params at ``PARAM_ULPS`` of the dtype's eps where it has an entry, else 1e-5.

    On an accelerator the two runs are differently fused programs, whose compute-dtype
    values may round differently: every step's loss, the validation loss and the params
    within the dtype's rounding (:func:`rounding_rtol`) instead. A skipped update still
    fails that (a 2-6% loss gap: test_a_skipped_update_fails_the_rounding_criterion)."""
    if jax.default_backend() != "cpu":
        assert_within_rounding(result, reference, dtype)
        return
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    params_rtol = PARAM_ULPS[dtype] * eps if dtype in PARAM_ULPS else 1e-5
    assert_losses_close(result.losses, reference.losses, 1e-5)
    assert_evaluation_equal(result, reference, 1e-5)
    assert_trees_close(
        without_key_bias(result.params), without_key_bias(reference.params), params_rtol
    )
    assert_logits_close(model, result.params, reference.params, check_tokens(), 1e-5)


def assert_within_rounding(result, reference, dtype: str) -> None:
    """Each step's loss, the validation loss and the params within ``dtype``'s rounding
    of the reference's (relative)."""
    rtol = rounding_rtol(dtype)
    assert_losses_close(result.losses, reference.losses, rtol)
    assert_evaluation_equal(result, reference, rtol)
    assert_trees_close(without_key_bias(result.params), without_key_bias(reference.params), rtol)


# Default-run representatives (keep out of -m slow): [bfloat16-nvme] and [float16-nvme],
# both NVMe tiers (fp16 with loss scaling); the host tier's run with -m slow (the default
# run took over 10 minutes with them too).
@pytest.mark.parametrize(
    "dtype, tier",
    [
        pytest.param("bfloat16", "host", marks=pytest.mark.slow),
        ("bfloat16", "nvme"),
        pytest.param("float16", "host", marks=pytest.mark.slow),
        ("float16", "nvme"),
    ],
)
@pytest.mark.guards(tier="host", parallel="single", dtype="bfloat16", ids="bfloat16-host")
@pytest.mark.guards(tier="nvme", parallel="single", dtype="bfloat16", ids="bfloat16-nvme")
@pytest.mark.guards(tier="host", parallel="single", dtype="float16", ids="float16-host")
@pytest.mark.guards(tier="nvme", parallel="single", dtype="float16", ids="float16-nvme")
def test_stream_equals_none_in_compute_dtype(dtype_reference, tmp_path, dtype, tier):
    reference = dtype_reference(dtype)
    config = _dtype_config(dtype, TIERS[tier])
    result = train(config, tmp_path, verbose=False)
    if jax.default_backend() == "cpu":  # (differently fused on an accelerator)
        assert result.losses[0] == reference.losses[0]  # the same function of the same params
    if dtype == "float16":
        trajectory = lambda r: [(x["loss_scale"], x["skipped"]) for x in r.records]
        assert trajectory(result) == trajectory(reference)
        scales, skipped = zip(*trajectory(reference), strict=True)
        assert any(skipped) and not all(skipped), skipped  # overflow skipped, and trained
        assert any(b > a for a, b in zip(scales, scales[1:], strict=False)), scales  # grown
    assert_dtype_training_equal(result, reference, dtype, build_model(config.model))


@pytest.mark.slow  # ~15 s: a streamed run beside the cached in-memory one
def test_a_skipped_update_fails_the_rounding_criterion(dtype_reference, tmp_path, monkeypatch):
    """The accelerator's criterion (:func:`assert_within_rounding`) keeps its teeth: a
    bf16 streamed run through the two-client emulation whose step-2 update is skipped
    (the host optimizer's own skip, as on an fp16 overflow) fails it."""
    from hetjax.optimizer.update_loop import UpdateLoop
    from hetjax.parallel.single import HOST_CLIENT_ENV

    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    finish, calls = UpdateLoop.finish, []

    def skipping(self, global_norm, apply):
        calls.append(apply)
        return finish(self, global_norm, apply and len(calls) != 2)

    reference = dtype_reference("bfloat16")
    config = _dtype_config("bfloat16", TIERS["nvme"])
    # the criterion passes the emulated streamed run as it is ...
    assert_within_rounding(train(config, tmp_path / "as_is", verbose=False), reference, "bfloat16")
    monkeypatch.setattr(UpdateLoop, "finish", skipping)
    skipped = train(config, tmp_path / "skipped", verbose=False)
    # ... and fails it with step 2's update skipped
    assert len(calls) == len(reference.losses) and skipped.losses[:2] == reference.losses[:2]
    gap = max(abs(a / b - 1) for a, b in zip(skipped.losses, reference.losses, strict=True))
    assert gap > 4 * rounding_rtol("bfloat16"), gap  # the gap, well beyond the rounding
    with pytest.raises(AssertionError):
        assert_within_rounding(skipped, reference, "bfloat16")


@pytest.mark.slow  # ~20 s: two runs
def test_blockwise_fp16_stream_equals_none(tmp_path):
    """test_stream_equals_none_in_compute_dtype[float16-nvme] with the blockwise attention
    (two tiles), at the same tolerances (``PARAM_ULPS``: its params measured 1.01 eps
    apart)."""
    none, stream = (
        train(_dtype_config("float16", offload, "blockwise"), tmp_path / name, verbose=False)
        for name, offload in (("none", dict(mode="none")), ("stream", TIERS["nvme"]))
    )
    model = build_model(_dtype_config("float16", {}, "blockwise").model)
    assert_dtype_training_equal(stream, none, "float16", model)


@pytest.mark.slow  # activations on NVMe: test_nvme_boundaries_equal_none in the default run
def test_nvme_boundaries_are_files_and_change_nothing(tiny, tmp_path):
    """Each micro-batch's boundary activations are written to a real TensorStore
    array (reopened here without hetjax's objects) and read back for backward: training
    is bitwise the same as with them on the device (keep_blocks and grad_accum too).
    Host staging stays within the host plan; the traffic is in the step's NVMe metrics
    and on the timeline's NVMe lanes."""
    common = dict(
        model=dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32),
        train=dict(steps=2, batch_size=4, seq_len=16, grad_accum=2),
        memory=dict(page_size="4KiB", nvme_path=str(tmp_path / "ssd")),
    )
    nvme = StreamingRuntime(
        tiny(offload=dict(mode="stream", activations="nvme", keep_blocks=1), **common)
    )
    device = StreamingRuntime(tiny(offload=dict(mode="stream", keep_blocks=1), **common))
    batch = np.random.default_rng(0).integers(0, 256, (2, 2, 17)).astype(np.int32)
    # Inputs of blocks 0-2 (block 3 keeps its activations) for the last micro-batch.
    x = nvme.fns.embed_fwd(nvme.resident["embed"], nvme.parallel.put_batch(batch[-1, :, :-1]))
    inputs = []
    for i in range(3):
        inputs.append(np.asarray(x).reshape(-1))
        x, _ = nvme.fns.block_fwd(nvme.parallel.to_device(nvme.param_store.get(f"block{i}")), x)

    recorder = timeline.Recorder()
    with timeline.recording(recorder):
        stats = nvme.train_step(batch)
    spans = recorder.finish().spans
    metrics = stats.metrics
    store = PageStore.open_existing(tmp_path / "ssd" / "activations", "boundaries")
    assert store.shape == (3, 2 * 16 * 32)
    np.testing.assert_array_equal(store[0].read().result(), inputs[0])
    for i in (1, 2):  # the last 2 stay in RAM for backward: never written (fill value)
        assert not store[i].read().result().any()

    checkpoint = 2 * 16 * 32 * 4
    # Per micro-batch: 1 written and read back; the last 2 are held in RAM.
    assert metrics["nvme_write_bytes"] == 2 * 1 * checkpoint
    assert metrics["nvme_read_bytes"] == 2 * 1 * checkpoint
    assert metrics["nvme_bytes"] == 3 * checkpoint
    assert 0 < nvme.swap.peak_host_bytes <= nvme.host_plan.boundaries == 3 * checkpoint
    for lane in ("nvme_write", "nvme_read"):
        assert any("activations boundaries" in name for _, _, name in spans[lane]), spans[lane]

    expected = device.train_step(batch)
    assert (stats.loss, stats.grad_norm) == (expected.loss, expected.grad_norm)
    for _ in range(2):
        a, b = nvme.train_step(batch), device.train_step(batch)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
    jax.tree.map(np.testing.assert_array_equal, nvme.params(), device.params())
    nvme.close()
    device.close()


def test_nvme_boundaries_without_disk_space_fail_at_start_up(tiny, tmp_path):
    config = tiny(
        model=dict(max_seq_len=2**20),
        train=dict(batch_size=2**14, seq_len=2**20),  # (B, T, D) fp32: 2 PiB a checkpoint
        offload=dict(mode="stream", activations="nvme"),
        memory=dict(nvme_path=str(tmp_path / "ssd")),
    )
    with pytest.raises(
        ConfigError,
        match=r"memory.nvme_path '.*ssd' for 2 boundary activations needs .* \(\d+ bytes\) "
        r"on disk but only .* is free \(short by",
    ):
        StreamingRuntime(config)
    assert not (tmp_path / "ssd").exists()


@pytest.mark.parametrize(
    "keep, fraction",
    [(0, 0.7), pytest.param(1, 0.85, marks=pytest.mark.slow)],  # keep1: keep levels' own tests
    ids=["recompute", "keep1"],
)
def test_streams_within_device_budget(tiny, tmp_path, keep, fraction):
    """An 8-layer model whose params exceed the device budget trains, and the device-kind
    live bytes, sampled after every dispatch, stay within the budget (also with two blocks
    keeping their in-block activations from forward to backward)."""
    model = dict(num_layers=8, d_model=96, num_heads=4, max_seq_len=32)
    probe_config = tiny(model=model, offload=dict(mode="stream"))
    params_bytes = build_model(probe_config.model).param_count() * 4
    budget = int(params_bytes * fraction)
    config = tiny(
        model=model,
        offload=dict(mode="stream", prefetch_depth=2, keep_blocks=keep),
        memory=dict(device_budget=budget, page_size="16KiB"),
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
    # 2-byte compute: embed+head 100 bytes, a block slab 50; gradients 2 x 4 x 30,
    # two boundaries of 20 in flight (activations on the host), working set 30.
    s = Sizes(
        num_layers=10,
        embed=30,
        block=25,
        head=20,
        own_embed=30,
        own_block=25,
        own_head=20,
        compute_bytes=2,
        block_grad_bytes=2,
        state_format=ADAM,
        boundary=20,
        working_set=30,
        kept={"all": 0},
        grad_policy="release",
    )
    o = Placement(params="host", optimizer="host", activations="host", prefetch_depth=3)
    plan = lambda budget: plan_device(s, o, budget)
    fixed = 100 + 240 + 40 + 30
    unlimited = plan(0)
    assert unlimited.prefetch_depth == 3 and unlimited.resident_blocks == 0
    tight = plan(fixed + 2 * 50)
    assert tight.prefetch_depth == 1 and tight.resident_blocks == 0
    roomy = plan(fixed + 7 * 50)
    assert roomy.prefetch_depth == 3 and roomy.resident_blocks == 3
    assert roomy.required <= fixed + 7 * 50
    everything = plan(10**9)
    assert everything.resident_blocks == 10
    # short by less than the working set: the error suggests chunks of rows, not when
    # short by more, nor with kept blocks (which run whole micro-batches)
    least = fixed + 50
    with pytest.raises(ConfigError, match=r"short by 20 B.*offload.batch_chunks"):
        plan(least - 20)
    with pytest.raises(ConfigError, match=r"short by 40 B") as short:
        plan(least - 40)
    assert "batch_chunks" not in str(short.value)
    keep = dataclasses.replace(o, keep_blocks=1)
    with pytest.raises(ConfigError, match=r"short by") as kept:
        plan_device(s, keep, sum(memory.device_parts(s, keep, 0, 0).values()) - 20)
    assert "batch_chunks" not in str(kept.value)


@pytest.mark.slow  # 11 s; the launcher streams in the default run: test_default_config_...
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
            "--config.memory.host_budget=1GiB",  # the default's 80 MiB is for NVMe state
            "--config.train.steps=2",
            "--config.train.batch_size=4",
            "--config.train.eval_batches=1",
            "--config.data.corpus_bytes=100000",
        ]
    )
    assert rc == 0
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    # the device peak: the first step's, accounted (the second is not: runtime/loop/ledger.py)
    assert 0 < records[0]["device_bytes_peak"] <= 64 * 2**20
    assert "device_bytes_peak" not in records[1]
    for r in records:
        assert r["host_bytes"] > 3.2e6 * 4 * 3  # fp32 master + Adam m, v at least
        assert 0 < r["optimizer_s"] < r["step_time_s"]


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_stream_fp16_skips_overflow_then_trains(tiny, params):
    """A skipped step must leave every tier untouched: with params on NVMe, the forward
    after a skip must read the committed copy, not the dropped update's."""
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


def test_swapped_block_moves_activations_not_params(tiny):
    """A swapped block's residuals (stages.SwappedBlock) are its level's kept residuals
    without the param pages (what memory.Sizes.swap_bytes counts), and its backward from
    them, pages given again, equals a kept block's at that level."""
    config = tiny(model=dict(attention="reference"))
    model = build_model(config.model)
    layouts = stage_layouts(model, 4096)
    fns = stages.StageFunctions(model, layouts, SingleDevice())
    block = layouts["block"]
    pages = block.to_pages(block.flatten(model.init_stage("block", jax.random.key(0))))
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))
    kept = fns.kept_bytes(4, 16, x.dtype)
    sizes = Sizes(
        num_layers=2,
        embed=0,
        block=block.padded_size,
        head=0,
        own_embed=0,
        own_block=0,
        own_head=0,
        compute_bytes=4,
        block_grad_bytes=4,
        state_format=ADAM,
        boundary=_nbytes(x),
        working_set=0,
        kept=kept,
        grad_policy="keep",
    )
    for level in ("matmuls", "probs"):
        swap = fns.swapped(level)
        (y, _), residuals = swap.forward(pages, x)
        assert not any(r.shape == pages[0].shape for r in residuals)  # no param page
        assert _nbytes(residuals) == swap.residual_bytes(pages, x) == sizes.swap_bytes(level)
        assert _nbytes(residuals) > _nbytes(x)  # the input and what the level saves
        (y_kept, _), vjp = fns.kept_forward(level)(pages, x)
        np.testing.assert_array_equal(y, y_kept)
        dy = jax.random.normal(jax.random.key(2), x.shape)
        (db, sq), dx, _ = swap.backward(pages, residuals, dy)
        (db_kept, sq_kept), dx_kept, _ = fns.block_bwd_kept(vjp, dy)
        assert_trees_close((db, dx), (db_kept, dx_kept))


def test_swap_traffic_on_the_copy_lanes_and_in_the_host_ledger(tiny):
    """Each swapped block's activations leave on the device->host lane in forward and
    come back on host->device in backward; host RAM holds them in between (the ledger's
    pinned_host peak counts them, within the host plan's swapped part)."""
    config = tiny(
        model=dict(num_layers=3),
        offload=dict(mode="stream", swap_blocks=2, keep_blocks=1, swap_level="matmuls"),
    )
    runtime = StreamingRuntime(config)
    try:
        batch = np.random.default_rng(0).integers(0, 256, (1, 4, 17)).astype(np.int32)
        recorder = timeline.Recorder()
        with timeline.recording(recorder):
            runtime.train_step(batch)
        spans = recorder.finish().spans
        out = [name for _, _, name in spans["device_to_host"] if "swap out" in name]
        back = [name for _, _, name in spans["host_to_device"] if "swap in" in name]
        assert sorted(out) == ["block0 swap out", "block1 swap out"], out
        assert sorted(back) == ["block0 swap in", "block1 swap in"], back
        swapped = runtime.host_plan.swapped
        assert swapped == 2 * runtime.sizes.swap_bytes("matmuls") > 0
        assert runtime.ledger.peak["pinned_host"] >= swapped // 2  # at least one block's
        assert runtime.plan.parts["swapped"] == 2 * runtime.sizes.swap_bytes("matmuls")
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"offload.swap_blocks": "-1"}, r"'offload.swap_blocks' must be >= 0"),
        ({"offload.swap_level": "all"}, r"'offload.swap_level'.*matmuls, probs"),
        (
            {"offload.swap_blocks": "2", "offload.keep_blocks": "1"},
            r"'offload.keep_blocks' \+ 'offload.swap_blocks' \(3\) exceed 'model.num_layers' \(2\)",
        ),
    ],
)
def test_swap_config_errors(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny().override({"offload.mode": "stream", **overrides})


def test_blockwise_attention_cannot_swap_probs(tiny, tmp_path):
    config = tiny(offload=dict(mode="stream", swap_blocks=1, swap_level="probs"))
    with pytest.raises(ConfigError, match=r"'offload.swap_level' is 'probs'.*supports only"):
        train(config, tmp_path, verbose=False)


# Default-run representative of the NVMe tier of swapped activations.
def test_swapped_activations_through_nvme_equal_none(reference, tiny, tmp_path, monkeypatch):
    """offload.swap_tier=nvme, read ahead one block: the last swapped block's
    activations wait in RAM for backward (never written), the one before goes to its
    TensorStore row and comes back; training equals offload.mode=none, and the step's
    NVMe metrics count the row both ways."""
    monkeypatch.setattr(memory, "IO_READAHEAD", 1)
    config = tiny(
        offload=dict(mode="stream", swap_blocks=2, swap_tier="nvme"),
        memory=dict(nvme_path=str(tmp_path / "ssd")),
    )
    result = train(config, tmp_path / "run", verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    runtime = StreamingRuntime(config)
    try:
        row = runtime.sizes.swap_bytes("matmuls")
        assert runtime.residual_swap.disk.nbytes >= 2 * row  # a row per swapped block
        assert runtime.host_plan.swapped == 2 * row  # staging: depth 1 + the one taken
        assert runtime.plan.parts["swapped"] == 2 * row
    finally:
        runtime.close()
    for r in result.records:  # one of the two written and read back per step
        assert r["nvme_write_bytes"] == r["nvme_read_bytes"] == row, r


def test_start_up_measurement_compiles_what_the_first_step_runs(tiny, tmp_path):
    """The start-up measurement of the backward functions' temporaries (XLA's, by
    compiling them: ``stages/measure.py``) compiles them as the steps call them, on the
    device with the cotangents they pass: the block's, the head's and the embedding's
    backward are each compiled once in a run, not once to measure and again to run
    (issue #59 item 13: on a GPU the block's backward at d 4096 compiles for a minute)."""
    import collections

    from jax._src import monitoring

    compiles = collections.Counter()

    def listen(event: str, duration: float, fun_name: str = "", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[fun_name] += 1

    monitoring.register_event_duration_secs_listener(listen)
    try:
        train(tiny(offload=dict(mode="stream"), train=dict(steps=2)), tmp_path, verbose=False)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    backward = ("jit(block_bwd)", "jit(head_fwd_bwd)", "jit(embed_bwd)")
    assert {name: compiles[name] for name in backward} == dict.fromkeys(backward, 1), compiles
