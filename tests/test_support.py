"""The support matrix (hetjax/support.py) and the one placement description
(hetjax/placement.py): every (feature, parallelism) is decided in one place, and config
validation, the planner's candidates and the runtime all agree with it."""

import dataclasses

import pytest

from hetjax import support
from hetjax.config import Config, ConfigError, all_keys, load_config
from hetjax.placement import Placement
from hetjax.planning.cost import Candidate
from hetjax.planning.in_memory import mesh_share
from hetjax.planning.search import _cache_variants, _candidates, _routing
from hetjax.planning.workload import Workload

# a tiny Mixtral-style Llama (tests/test_moe.py's), whose experts route
MOE = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
    num_experts=4, experts_per_token=2, tie_embeddings=False, vocab_size=256,
    max_seq_len=32,
)  # fmt: skip
DISTRIBUTED = {
    support.SINGLE: dict(data_parallel=1, expert_parallel=1),
    support.DATA: dict(data_parallel=2, expert_parallel=1),
    support.EXPERT: dict(data_parallel=1, expert_parallel=2),
    support.TENSOR: dict(data_parallel=1, expert_parallel=1, tensor_parallel=2),
    support.TENSOR_EXPERT: dict(data_parallel=1, expert_parallel=2, tensor_parallel=2),
}
STREAM = dict(mode="stream")
# what asks for each feature (a whole offload section, or other sections too)
ASKS = {
    "in_memory": dict(offload=dict(mode="none")),
    "device_cache": dict(offload=dict(STREAM, optimizer_device_stages=1)),
    "keep_blocks": dict(offload=dict(STREAM, keep_blocks=1)),
    "swap_blocks": dict(offload=dict(STREAM, swap_blocks=1)),
    "swap_to_nvme": dict(offload=dict(STREAM, swap_blocks=1, swap_tier="nvme")),
    "nvme_boundaries": dict(offload=dict(STREAM, activations="nvme")),
    "lockfree": dict(offload=STREAM, optimizer=dict(mode="lockfree")),
    "routed_experts": dict(offload=dict(STREAM, expert_fetch="routed", expert_updates="all")),
    "deferred_updates": dict(offload=dict(STREAM, expert_fetch="routed")),
    "batch_chunks": dict(offload=dict(STREAM, batch_chunks=2)),
    "optimizer_on_device": dict(offload=dict(STREAM, optimizer="device")),
}


def _config(tiny, parallelism: str, moe: bool = True, **sections) -> Config:
    """The tiny model (a mixture of experts: expert parallelism needs one) under
    ``parallelism``."""
    model = MOE if moe or parallelism in (support.EXPERT, support.TENSOR_EXPERT) else {}
    base = tiny(model=model, distributed=DISTRIBUTED[parallelism])
    return base.replace(**sections)


def test_the_matrix_names_every_feature_and_parallelism():
    assert set(ASKS) == set(support.FEATURES)
    for feature in support.FEATURES:
        for p in support.PARALLELISMS:
            reason = support.supports(feature, p)
            assert reason is None or (reason and "\n" not in reason), (feature, p)
        assert support.supports(feature, support.SINGLE) is None  # one device runs all
    with pytest.raises(ValueError, match="unknown parallelism"):
        support.supports("keep_blocks", "pipeline")


@pytest.mark.parametrize("parallelism", support.PARALLELISMS)
@pytest.mark.parametrize("feature", list(ASKS))
def test_config_validation_agrees_with_the_matrix(tiny, feature, parallelism):
    """A config asking for a feature builds where the matrix supports it; where it does
    not, it fails with the matrix's reason (naming the key and the fix), or, for a
    feature the defaults ask for, builds and says what the run does instead."""
    moe = feature in ("routed_experts", "deferred_updates")
    if feature == "batch_chunks" and parallelism in (support.EXPERT, support.TENSOR_EXPERT):
        # expert parallelism needs a mixture of experts, whose rows the matrix's model
        # axis does not chunk (test_the_model_axis_refuses_in_one_place)
        with pytest.raises(ConfigError) as refused:
            _config(tiny, parallelism, **ASKS[feature])
        assert support.supports_model(feature, frozenset({support.POOLED})) in str(refused.value)
        return
    reason = support.supports(feature, parallelism)
    f = support.FEATURES[feature]
    if reason is None or f.fallback:
        config = _config(tiny, parallelism, moe, **ASKS[feature])
        assert feature in support.asked(config)
        said = support.fallbacks(config)
        if reason is None:
            assert not any(line.startswith(f"{f.key}:") for line in said), said
        else:  # openly: the key, why, and what the run does instead
            assert f"{f.key}: {reason}: {f.fallback}" in said, said
        return
    with pytest.raises(ConfigError) as refused:
        _config(tiny, parallelism, moe, **ASKS[feature])
    message = str(refused.value)
    # the first refused feature the config asks for (swapping to NVMe asks for swapped
    # blocks, refused first)
    ask = Config().replace(**ASKS[feature])
    first = next(a for a in support.asked(ask) if support.supports(a, parallelism))
    assert support.supports(first, parallelism) in message
    key = support.FEATURES[first].key or "distributed."
    assert f"config key '{key}" in message and support.FEATURES[first].fix in message


# a model of each kind of the matrix's model axis (hetjax/support.py MODEL_KINDS)
KINDS = {
    "gpt_tiny": frozenset(),
    "mixtral_tiny": frozenset({support.POOLED}),
    "t5_tiny": frozenset({support.CONTEXT}),
    "t5_moe_tiny": frozenset({support.POOLED, support.CONTEXT}),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_the_model_axis_refuses_in_one_place(name):
    """The model kinds read off the config are the built model's, and the config refuses
    a feature, or a parallelism, for a model exactly where the matrix's model axis does,
    with its line (the runtime's own checks, for a custom model, read the same rows:
    tests/test_chunks.py, tests/test_t5.py::test_swapped_activations_refused)."""
    from models import build_model

    config = load_config(name)
    kinds = support.model_kinds(config.model)
    assert kinds == KINDS[name] == support.model_kinds_of(build_model(config.model))
    for feature, f in support.FEATURES.items():
        if not f.models:
            continue
        value = {"swap_blocks": 1, "batch_chunks": 2}[feature]
        asks = dict(offload=dict(STREAM, **{f.key.split(".")[1]: value}))
        why = support.model_refusal(feature, kinds, value)
        assert (why is None) == (not kinds & f.models), (feature, kinds)
        if why is None:
            config.replace(**asks)
        else:
            with pytest.raises(ConfigError) as refused:
                config.replace(**asks)
            assert str(refused.value) == why
    for parallelism, cells in support.PARALLEL_MODELS.items():
        split = dict(DISTRIBUTED[parallelism])
        why = support.parallel_refusal(parallelism, kinds)
        assert (why is None) == (not kinds & set(cells)), (parallelism, kinds)
        if why and config.model.num_experts:  # (a dense model has no experts to split)
            with pytest.raises(ConfigError) as refused:
                config.replace(distributed=split)
            assert why in str(refused.value)
        elif config.model.num_experts and config.model.num_experts % 2 == 0:
            config.replace(distributed=split, train=dict(batch_size=4))


def test_what_was_refused_builds_now():
    """Features the matrix once refused under a parallelism build there now."""
    config = lambda **sections: Config().replace(**sections)
    dp = dict(distributed=dict(data_parallel=2))
    # supported under data parallelism since 2026-11-26 (tests/test_zero.py), the device
    # cache and the in-memory runtime since 2026-11-27 (tests/test_in_memory_dp.py), the
    # in-memory runtime under tensor parallelism since the tenth session
    # (tests/test_in_memory_tensor.py)
    config(offload=dict(mode="stream", keep_blocks=1), optimizer=dict(mode="lockfree"), **dp)
    config(offload=dict(mode="stream", optimizer_device_stages=1), **dp)
    config(offload=dict(mode="none"), **dp)
    config(offload=dict(mode="none"), distributed=dict(tensor_parallel=2))


def _every_candidate(w: Workload, parallelism: str, share=None):
    """Every candidate the planner would evaluate under ``parallelism``, its device
    caches and routed experts included (``search._fastest_per_placement``'s variants);
    ``share``: a device's share of the in-memory state (``search._plan_split``'s)."""
    for chunked in (False, True):
        for c in _candidates(w, parallelism, chunked, share=share):
            yield c
            yield from _cache_variants(w, parallelism, c)
            if _routing(w, parallelism) and c.mode == "stream":
                yield c.replace(expert_fetch="routed")


@pytest.mark.parametrize("parallelism", support.PARALLELISMS)
def test_the_planner_offers_only_what_the_matrix_allows(tiny, parallelism):
    """Every candidate of the planner builds a valid config under its parallelism (the
    config refuses nothing it offers) and uses only features ``support.planned``
    allows; on one device it offers every feature it plans, and offload.mode=none
    wherever the matrix plans it (on a mesh: each device's share of the state)."""
    offered = set()
    for moe in (False, True):
        config = _config(tiny, parallelism, moe, offload=STREAM)
        d = DISTRIBUTED[parallelism]
        tensor = d.get("tensor_parallel", 1)
        devices = d["data_parallel"] * d["expert_parallel"] * tensor
        w = Workload.from_config(config, devices=devices)
        in_memory = support.planned("in_memory", parallelism) is None
        share = mesh_share(config, devices, tensor) if in_memory else None
        for c in _every_candidate(w, parallelism, share):
            planned = config.replace(**c.config_overrides())  # raises if refused
            used = support.asked(planned)
            refused = {f: support.planned(f, parallelism) for f in used}
            assert not any(refused.values()), (c, refused)
            offered |= set(used)
    # the update policy is the config's, never the planner's choice
    chosen = set(support.FEATURES) - {"lockfree", "deferred_updates"}
    if parallelism == support.SINGLE:
        assert offered >= chosen, chosen - offered
    assert ("in_memory" in offered) == (support.planned("in_memory", parallelism) is None)
    assert "optimizer_on_device" in offered  # each device its own pages (sharded_slab.py)


@pytest.mark.parametrize("parallelism", [support.SINGLE, support.DATA])
def test_the_runtime_reads_the_matrix(tiny, parallelism):
    """The streaming runtime measures kept blocks and routes experts where the matrix
    supports them; where it does not, the start-up plan says what it does instead."""
    from hetjax.parallel.zero import Zero3
    from hetjax.runtime.experts.routed import routed_blocks
    from hetjax.runtime.streaming import StreamingRuntime

    config = _config(
        tiny, parallelism, offload=STREAM, memory=dict(page_size="16KiB"),
        optimizer=dict(name="sgd", lr=0.1),
    )  # fmt: skip
    sharded = parallelism != support.SINGLE
    runtime = StreamingRuntime(config, parallel=Zero3(config) if sharded else None)
    try:
        keeps = support.supports("keep_blocks", parallelism) is None
        assert runtime.fns.kept_blocks == keeps
        routes = support.supports("routed_experts", parallelism) is None
        assert bool(runtime.routed) == routes
        fallback = [line for line in support.fallbacks(config) if "expert_fetch" in line]
        assert bool(fallback) == (not routes)
        assert all(line in runtime.plan_lines() for line in fallback), runtime.plan_lines()
        # the decision is the matrix's, whatever else the caller passes
        args = (config.offload, runtime.model, runtime.layouts, runtime.block_names, 0, ())
        for p in support.PARALLELISMS:
            if support.supports("routed_experts", p) is not None:
                assert not routed_blocks(*args, parallelism=p)
    finally:
        runtime.close()


@pytest.mark.slow  # ~24 s (plans: measures the machine, traces); the fallback lines
# themselves: test_config_validation_agrees_with_the_matrix (default run)
def test_auto_says_what_falls_back(tiny, monkeypatch):
    from hetjax.planning.auto import plan_auto

    # every parallelism routes experts now (tensor parallelism since the ninth session:
    # runtime/experts/routed_zero.py), so auto says nothing of them; a fallback made here is said
    config = _config(tiny, support.TENSOR, offload=dict(mode="auto"))
    # the tiny model's share fits a device whole, where auto trains offload.mode=none
    # (tests/test_in_memory_plan.py), which routes nothing: this is the streamed plan's
    row = support.FEATURES["in_memory"]
    streamed = dataclasses.replace(row, unplanned=support.SHARDED)
    monkeypatch.setitem(support.FEATURES, "in_memory", streamed)
    quiet = []
    plan_auto(config, log=quiet.append)
    assert not any("offload.expert_fetch: " in x for x in quiet), quiet
    row = support.FEATURES["routed_experts"]
    refused = dataclasses.replace(row, refused=frozenset({support.TENSOR}))
    monkeypatch.setitem(support.FEATURES, "routed_experts", refused)
    lines = []
    planned, plan = plan_auto(config, log=lines.append)  # planned for the tensor-parallel devices
    assert planned.offload.mode == "stream" and plan is not None and plan.num_devices > 1
    assert any("offload.expert_fetch: routed experts are not supported" in x for x in lines)


# -- the placement ------------------------------------------------------------------------


def test_one_placement_from_the_config_to_the_planner_and_back(tiny):
    """The config's placement, the memory model's and the planner's are one class; its
    config keys round-trip, and each is a config key."""
    assert Placement is Placement
    assert Placement.from_config(Config()) == Placement()
    overrides = Placement().config_overrides()
    assert {f"{s}.{name}" for s, names in overrides.items() for name in names} <= set(all_keys())
    changed = Placement(
        params="nvme", optimizer="nvme", activations="host", prefetch_depth=1, keep_blocks=1,
        keep_level="matmuls", swap_blocks=1, swap_level="probs", swap_tier="nvme",
        device_stages=2, expert_fetch="all", batch_chunks=1, update_mode="lockfree",
    )  # fmt: skip
    # every knob that is a config key differs from its default
    for f in dataclasses.fields(Placement):
        if "key" in f.metadata:
            assert getattr(changed, f.name) != f.default or f.name == "batch_chunks", f.name
    config = tiny().replace(**changed.config_overrides())
    assert config.offload.mode == "stream" and config.optimizer.mode == "lockfree"
    assert Placement.from_config(config) == changed
    # the planner's candidate: a placement plus mode none's remat
    c = Candidate(placement=changed)
    assert c.config_overrides() == changed.config_overrides()
    assert Candidate(mode="none", remat=True).config_overrides() == dict(
        offload=dict(mode="none"), model=dict(remat=True)
    )
    assert c.replace(prefetch_depth=3).placement.prefetch_depth == 3


def test_placements_are_built_by_keyword():
    with pytest.raises(TypeError):
        Placement("nvme")  # no positional fields
    with pytest.raises(TypeError):
        Candidate("stream")
