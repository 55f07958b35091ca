"""The device cache of optimizer state (offload.optimizer_device_stages, Angel-PTM 4.2):
sync training with the first stages' state and update on the device equals
offload.mode=none (clipping redo, accumulation, lock-free, a skipped step), checkpoints
move between cache settings, the plans and the ledger count the cache on the device,
config errors, and the planner's choice."""

import gc

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import (
    assert_gpt_training_equal,
    assert_losses_close,
    assert_trees_close,
    check_tokens,
    training_batches,
    without_key_bias,
)
from jax.sharding import SingleDeviceSharding

from hetjax.checkpoint import Checkpointer
from hetjax.config import Config, ConfigError, load_config
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.single import Shardings, live_bytes_by_kind
from hetjax.planning.cost import lanes
from hetjax.planning.hardware import PROFILES
from hetjax.planning.search import make_plan
from hetjax.planning.workload import Workload
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from models import build_model

# Clipping binds in steps 1-3 of the tiny runs and not in 4-5 (grad norms ~2.2, 2.3,
# 3.0, 1.5, 1.5): both the committed speculative update and the redo run.
CLIP = dict(grad_clip=2.0)
PAGES = dict(page_size="16KiB")


def _cached(tiny, stages, tier="host", **sections):
    """The tiny config with ``stages`` device-cached stages, the rest in ``tier``."""
    offload = dict(mode="stream", optimizer=tier, optimizer_device_stages=stages)
    return tiny(**{"optimizer": CLIP, "memory": PAGES, **sections, "offload": offload})


def _state_bytes(runtime, stages) -> int:
    """Bytes of the fp32 master and optimizer state of ``stages``."""
    return sum(runtime.optimizer.state_bytes(runtime.layout_name(n)) for n in stages)


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run(tiny_config(optimizer=CLIP))


# Default-run tier representative (keep out of -m slow): [host] for the device cache of
# optimizer state, offloaded vs in memory.
@pytest.mark.parametrize(
    "optimizer, params, stages",
    [("host", "host", 2), ("nvme", "nvme", 2), ("nvme", "host", 4)],
    ids=["host", "nvme", "nvme-every-stage"],
)
def test_device_cache_equals_none(reference, tiny, tmp_path, optimizer, params, stages):
    config = _cached(tiny, stages, optimizer)
    config = config.replace(offload=dict(params=params))
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    redo = [r["optimizer_redo"] for r in result.records]
    assert 0 < redo[-1] < len(redo), redo  # the redo re-runs the device stages too
    # The last step (no redo): exactly the cached stages were updated on the device.
    layouts = stage_layouts(build_model(config.model), config.memory.page_size)
    sizes = [layouts[n].padded_size for n in ("embed", "block", "block", "head")]
    last = result.records[-1]
    assert last["optimizer_device_params"] == sum(sizes[:stages])
    assert last["optimizer_params"] == sum(sizes[stages:])


@pytest.mark.slow  # ~12 s; test_device_cache_equals_none covers the device cache in the default run
def test_device_cache_with_grad_accum_equals_none(tiny, tmp_path):
    # Summed over micro-batches, gradients round differently from the reference's
    # (float32, ~1e-7); AdamW divides the small ones by their own size and turns that
    # into parameter differences beyond 1e-5 of a tensor's max (tests/equivalence.py).
    # SGD with momentum compares the summation itself at the same tolerance.
    accum = dict(steps=5, batch_size=4, seq_len=16, grad_accum=2, eval_batches=1)
    sgd = dict(name="sgd", lr=0.1, **CLIP)
    expected = train(tiny(train=accum, optimizer=sgd), tmp_path / "ref", verbose=False)
    config = _cached(tiny, 3, "nvme", train=accum, optimizer=sgd)  # summed on the device
    result = train(config, tmp_path / "cache", verbose=False)
    assert_gpt_training_equal(result, expected, build_model(config.model), check_tokens())


def test_lockfree_device_cache_without_staleness_equals_none(reference, tiny, tmp_path):
    """Lock-free mode: the cached stages' gradients reach the host with the others' and
    only their update runs on the device. With max_staleness=0 each step's update is
    applied before the next, so training equals ordinary training."""
    config = _cached(tiny, 2, optimizer=dict(mode="lockfree", max_staleness=0, **CLIP))
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    assert result.records[-1]["optimizer_device_params"] > 0


def test_nonfinite_step_leaves_the_device_cache_untouched(tiny):
    """A step with NaN gradients drops the device stages' speculative updates and
    republishes their params from the committed masters; the next step equals the
    in-memory runtime's first."""
    config = _cached(tiny, 2, "nvme")
    runtime = StreamingRuntime(config)
    try:
        (batch,) = training_batches(config, 1)
        before = runtime.params()
        embed_pages = [np.array(p) for p in runtime.resident["embed"]]
        assert runtime.train_step(batch, poison=True).nonfinite
        jax.tree.map(np.testing.assert_array_equal, runtime.params(), before)
        for page, old in zip(runtime.resident["embed"], embed_pages, strict=True):
            np.testing.assert_array_equal(np.asarray(page), old)
        stats = runtime.train_step(batch)
        expected = InMemoryRuntime(tiny(optimizer=CLIP))
        np.testing.assert_allclose(stats.loss, expected.train_step(batch).loss, rtol=1e-5)
        assert_trees_close(without_key_bias(runtime.params()), without_key_bias(expected.params()))
    finally:
        runtime.close()


def test_gpu_layout_host_optimizer_on_another_device(reference, tiny, monkeypatch):
    """A GPU machine's layout, emulated with two CPU devices: the device (and the cache)
    on one, the host optimizer on the other (on a GPU it runs on the CPU backend, whose
    memory kind also reads ``device``). The host optimizer's state is counted on the
    host, the cache's on the device; state crosses between the devices at start-up and
    after a NaN step; training equals offload.mode=none."""
    accelerator, cpu = jax.devices()[:2]

    def gpu_like(cls, device=None):
        on = lambda kind: SingleDeviceSharding(accelerator, memory_kind=kind)
        return cls(on("device"), on("pinned_host"), SingleDeviceSharding(cpu))

    monkeypatch.setattr(Shardings, "single_device", classmethod(gpu_like))
    runtime = StreamingRuntime(_cached(tiny, 2, "host"))
    try:
        assert runtime.states.host_bytes() == _state_bytes(runtime, runtime.host_stages)
        assert runtime.states.device_bytes() == _state_bytes(runtime, runtime.device_stages)
        batches = training_batches(runtime.config, 5)
        assert runtime.train_step(batches[0], poison=True).nonfinite  # republished across
        losses = [runtime.train_step(batch).loss for batch in batches]
        assert_losses_close(losses, reference.losses)
        assert_trees_close(without_key_bias(runtime.params()), without_key_bias(reference.params))
    finally:
        runtime.close()


def test_checkpoints_move_between_device_cache_settings(reference, tiny, tmp_path):
    """A checkpoint saved with two device-cached stages restores into a run without a
    cache (optimizer on NVMe), whose checkpoint restores into one with every stage
    cached: the same placement-free state, and step for step the losses and the final
    params equal the in-memory run's."""
    batches = training_batches(tiny(), 5)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    losses, saved, step = [], [], 0
    for config, steps in [
        (_cached(tiny, 2, "host"), 2),
        (_cached(tiny, 0, "nvme"), 2),
        (_cached(tiny, 4, "host"), 1),
    ]:
        runtime = StreamingRuntime(config)
        if step:
            runtime.load_state(ckpt.restore(step)[0])
        for batch in batches[step : step + steps]:
            losses.append(runtime.train_step(batch).loss)
        step += steps
        ckpt.save(step, runtime.save_state(), {})
        ckpt.wait()
        saved.append(ckpt.restore(step)[0])
        runtime.close()
    ckpt.close()
    assert_losses_close(losses, reference.losses)
    final = saved[-1].params()
    assert_trees_close(without_key_bias(final), without_key_bias(reference.params))
    for state in saved:
        assert jax.tree.structure(state.stages) == jax.tree.structure(saved[0].stages)
        assert jax.tree.structure(state.scalars) == jax.tree.structure(saved[0].scalars)


@pytest.mark.slow  # the default run checks the device ledger in tests/test_stream.py
def test_device_cache_is_counted_on_the_device(tiny):
    """The device plan and the ledger count the cached stages' state (twice during a
    step: committed and speculative), gradients and new params on the device; the ledger
    agrees with a census of live device arrays, within the budget. The host holds only
    the other stages' state and params."""
    model = dict(num_layers=4, d_model=64, num_heads=4, max_seq_len=32)
    budget = 8 * 2**20
    config = _cached(
        tiny,
        3,
        model=model,
        memory=dict(page_size="4KiB", device_budget=budget),
        train=dict(steps=2, batch_size=2, seq_len=16, eval_batches=1),
    )
    gc.collect()  # earlier tests' garbage must not be freed while samples are taken
    samples = []
    runtime = StreamingRuntime(
        config, probe=lambda rt: samples.append(live_bytes_by_kind().get("device", 0))
    )
    try:
        assert runtime.device_stages == ("embed", "block0", "block1")
        assert runtime.plan.parts["optimizer"] >= 2 * _state_bytes(runtime, runtime.device_stages)
        assert runtime.plan.resident_blocks >= 2  # the cached blocks are resident
        assert runtime.plan.required <= budget
        assert runtime.host_plan.optimizer_state == 2 * _state_bytes(runtime, runtime.host_stages)
        batch = np.random.default_rng(0).integers(0, 256, (1, 2, 17)).astype(np.int32)
        resident = sum(a.nbytes for a in jax.tree.leaves(runtime.resident))
        baseline = live_bytes_by_kind().get("device", 0) - resident - runtime.states.device_bytes()
        losses, deferred = [], []
        for _ in range(3):  # step 1 speculates; clipping binds, so steps 2, 3 defer
            start = len(samples)
            report = runtime.train_step(batch)
            losses.append(report.loss)
            peak = max(samples[start:]) - baseline
            ledger = runtime.ledger.peak["device"]  # this step's
            assert ledger >= 2 * _state_bytes(runtime, runtime.device_stages)
            assert abs(ledger - peak) <= 0.05 * peak, (ledger, peak)
            assert ledger <= runtime.plan.required and peak <= budget
            # what metrics.jsonl reports, against the live arrays sampled by the probe
            reported = report.metrics["device_bytes_peak"]
            assert abs(reported - peak) <= 0.05 * peak, (reported, peak)
            deferred.append(report.metrics["optimizer_deferred"])
        assert losses[-1] < losses[0]
        assert deferred == [0, 1, 2]
        # committed, and the copy it replaced (the next update's output buffers)
        assert runtime.states.host_bytes() == 2 * _state_bytes(runtime, runtime.host_stages)
        # their params as the device takes them: leaf buffers, without the slab's padding
        layout = lambda n: runtime.layouts[runtime.layout_name(n)]
        compute = lambda n: layout(n).size * runtime.compute_dtype.itemsize
        assert runtime.param_store.host_bytes() == sum(compute(n) for n in runtime.host_stages)
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            {"offload.optimizer_device_stages": "-1"},
            r"'offload.optimizer_device_stages' must be >= 0",
        ),
        ({"offload.mode": "none"}, r"offload.mode=none keeps all optimizer state"),
        ({"offload.mode": "auto"}, r"offload.mode=auto the planner chooses it"),
        ({"offload.optimizer": "device"}, r"offload.optimizer=device keeps every stage's"),
        ({"offload.optimizer_device_stages": "7"}, r"exceeds the number of stages, 6"),
    ],
    # (supported under data, tensor and expert parallelism: tests/test_zero.py,
    # tests/test_tensor.py, tests/test_moe.py)
    ids=["negative", "none", "auto", "optimizer-device", "too-many"],
)
def test_config_errors_name_the_key_and_the_fix(overrides, pattern):
    base = {
        "offload.mode": "stream",
        "offload.optimizer_device_stages": "2",
        "model.num_layers": "4",
        "train.batch_size": "16",
    }
    with pytest.raises(ConfigError, match=pattern):
        Config().override({**base, **overrides})
    every = Config().override({**base, "offload.optimizer_device_stages": "6"})
    assert every.offload.optimizer_device_stages == 6  # embed, 4 blocks, head


def _fits(plan):
    for tier in ("device", "host", "nvme"):
        assert sum(getattr(plan, tier).values()) <= plan.budgets[tier], (tier, plan.table())


@pytest.mark.slow  # 15 s: the default run stayed over 10 minutes from a cold cache
def test_planner_caches_what_fits_and_more_with_more_budget():
    """While the plan streams with the optimizer on the host: every plan fits every
    budget, the cache counted on the device as the runtime holds it; more device budget
    never caches fewer stages; a chosen cache is predicted faster than the same
    placement without it (device-speed updates, no gradient copies); the table and the
    config say how many stages."""
    hw = PROFILES["a100-80g"]
    config = load_config(
        "gpt1p3b",
        {"train.batch_size": "1", "train.seq_len": "1024", "model.compute_dtype": "bfloat16"},
    )
    w = Workload.from_config(config)
    # gpt1p3b's stages' fp32 elements from its shapes, by hand, in whole pages: at most
    # 4 MiB (memory.page_size's default), fitted to the block (a block needs 49 pages
    # of 2^20 elements; 49 pages of the fewest whole 4 KiB that hold it, 1,028,096):
    # embed wte (V, D) + wpe (S, D); a block ln_1, c_attn, c_proj, ln_2, c_fc,
    # c_proj_mlp: 12 D^2 + 13 D; the head ln_f (its matmul is wte).
    V, S, D, L = 50257, 2048, 2048, 24
    page = 2**20
    assert -(-(12 * D * D + 13 * D) // page) == 49
    page = -(-(12 * D * D + 13 * D) // 49 // 1024) * 1024
    padded = lambda n: -(-n // page) * page
    stage = [padded(V * D + S * D), *[padded(12 * D * D + 13 * D)] * L, padded(2 * D)]
    # A cached element on the device: fp32 master, mu and nu twice (committed and
    # speculative), its bf16 params, and its fp32 gradient (sync with clipping keeps
    # every cached stage's for a redo): 2 * 12 + 2 + 4 bytes.
    cached_bytes = lambda k: 30 * sum(stage[:k])
    counts = []
    for gib in (4, 6, 8, 10, 12, 14, 16):  # offload.mode=none fits from about 24 GiB
        plan = make_plan(config.replace(memory=dict(device_budget=f"{gib}GiB")), hw, w)
        _fits(plan)
        c, p = plan.candidate, plan.placement
        assert c.mode == "stream" and p.optimizer == "host", plan.table()
        assert plan.device["optimizer"] == cached_bytes(p.device_stages), plan.table()
        assert p.resident_blocks >= min(max(p.device_stages - 1, 0), L)  # cached blocks
        counts.append(p.device_stages)
        if p.device_stages:
            without = c.replace(device_stages=0)
            assert lanes(w, hw, c, 0.0)[0] < lanes(w, hw, without, 0.0)[0]
            assert f"optimizer state of {p.device_stages} stage" in plan.table()
            overrides = plan.config_overrides()
            assert config.replace(**overrides).offload.optimizer_device_stages == p.device_stages
    assert counts == sorted(counts) and counts[-1] > 0, counts


def test_device_update_in_one_chunk_per_stage_equals_none(reference, tiny, tmp_path, monkeypatch):
    """On an accelerator the device-cached stages update in one dispatch per stage
    (slab.chunk_elems), while the host optimizer keeps cache-sized chunks. Emulated on
    CPU: the device memory kind's optimizer gets whole stages, the host's 2-page chunks;
    training equals offload.mode=none (clipping redo included)."""
    import hetjax.optimizer.slab as slab

    page = 4096  # PAGES' 16 KiB of fp32
    monkeypatch.setattr(slab, "CHUNK_ELEMS", 2 * page)
    cpu_policy = slab.chunk_elems
    monkeypatch.setattr(
        slab, "chunk_elems", lambda s: 0 if s.memory_kind == "device" else cpu_policy(s)
    )
    config = _cached(tiny, 2, "host")
    runtime = StreamingRuntime(config)
    try:
        device, host = runtime.device_optimizer, runtime.optimizer
        for name in runtime.device_stages:
            assert len(device.chunk_bounds(runtime.layout_name(name))) == 1
        chunks = [len(host.chunk_bounds(runtime.layout_name(n))) for n in runtime.host_stages]
        assert max(chunks) > 1, chunks  # the blocks' are
    finally:
        runtime.close()
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    assert result.records[-1]["optimizer_redo"] > 0
