"""Declared layouts (hetjax/types.py's Parallelism): every param leaf of every zoo model
names its logical axes, the placement's rules map them to mesh axes, a stage's page
layout is built per shard of each leaf, and every stage function (kept and swapped
blocks' included) is compiled by the parallelism from its declared signature."""

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_gpt_training_equal, assert_trees_close, check_tokens
from jax.sharding import PartitionSpec

from hetjax.parallel.grouped import GroupedSlabLayout
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.rules import (
    DATA_AXIS,
    EXPERT_AXIS,
    MODEL_AXIS,
    RULES,
    leaf_specs,
    mesh_axes,
    param_specs,
    rules_for,
)
from hetjax.parallel.single import SingleDevice
from hetjax.parallel.zero import Zero3
from hetjax.runtime.stages import functions as stages
from hetjax.runtime.stages.signatures import SIGNATURES
from hetjax.storage.pages import SlabLayout
from hetjax.train import train
from hetjax.types import Kind, Parallelism, StageSignature
from models import build_model
from models.staged import LAYERS, logical_axes

PREFIX = dict(objective="prefix_lm")
T5 = dict(family="t5", num_layers=2, num_decoder_layers=2, d_model=32, num_heads=4, d_ff=64)
MODELS = {
    "gpt": (dict(), {}),
    "llama": (dict(family="llama", num_kv_heads=2, tie_embeddings=False, d_ff=48), {}),
    "llama_moe": (
        dict(family="llama", num_kv_heads=2, num_experts=4, experts_per_token=2, d_ff=48),
        {},
    ),
    "t5": (dict(T5, tie_embeddings=False), PREFIX),
    "t5_switch": (
        dict(T5, num_experts=4, experts_per_token=1, feed_forward_proj="relu"),
        PREFIX,
    ),
}
is_axes = lambda x: isinstance(x, tuple)
is_spec = lambda x: isinstance(x, PartitionSpec)


def model_of(name: str):
    model, data = MODELS[name]
    return build_model(tiny_config(model=model, data=data).model)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_param_leaf_of_every_model_names_its_axes(name):
    """Each leaf: one logical name per dimension, every name one the rules know, a
    group's leaves stacked on ``layers``; the experts (a MoE's) on ``expert``."""
    model = model_of(name)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    axes = logical_axes(model, shapes)
    known = dict(RULES)
    group_keys = {g.key for g in model.groups}
    pairs = jax.tree_util.tree_leaves_with_path(axes, is_leaf=is_axes)
    assert len(pairs) == len(jax.tree.leaves(shapes))
    for (path, names), leaf in zip(pairs, jax.tree.leaves(shapes), strict=True):
        where = jax.tree_util.keystr(path)
        assert len(names) == len(leaf.shape), (where, names, leaf.shape)
        assert all(n in known for n in names), (where, names)
        assert (names[0] == LAYERS) == (path[0].key in group_keys), where
        if "moe" in where and names[-1] != "router":
            assert names[1] == "expert", where
    assert (name.endswith(("moe", "switch"))) == any(
        "expert" in n for n in jax.tree.leaves(axes, is_leaf=is_axes)
    )


def test_a_table_that_misses_a_leaf_or_its_rank_is_an_error():
    model = model_of("gpt")
    model.logical_axes_table = model.logical_axes_table[1:]  # no "wte"
    with pytest.raises(ValueError, match="no pattern matching param embed/wte"):
        logical_axes(model)
    model.logical_axes_table = (("wte", ("vocab",)), *model.logical_axes_table)
    with pytest.raises(ValueError, match=r"names \('vocab',\) for param embed/wte"):
        logical_axes(model)


def test_rules_map_logical_axes_to_mesh_axes():
    """One table: the batch over data x expert, the experts over ``expert``, heads, MLP
    units and the vocabulary over ``model``; a model axis of size 1 splits nothing."""
    names = (LAYERS, "expert", "embed", "mlp")
    assert mesh_axes(names) == (None, EXPERT_AXIS, None, MODEL_AXIS)
    assert mesh_axes(names, rules_for(2)) == (None, EXPERT_AXIS, None, MODEL_AXIS)
    assert mesh_axes(names, rules_for(1)) == (None, EXPERT_AXIS, None, None)
    assert mesh_axes(("batch", None), rules_for(1)) == ((DATA_AXIS, EXPERT_AXIS), None)
    with pytest.raises(KeyError, match="'hidden'"):
        mesh_axes(("hidden",))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_axis_of_size_1_is_a_no_op(name):
    """With ``tensor_parallel`` 1 no leaf names the model axis, the stage functions get
    no split to constrain, and every stage is the plain layout (its pages are whole
    leaves', as checkpoints have them); with 2 some leaf of every model is split and a
    block is laid out in parts."""
    model, page = model_of(name), 16 * 1024
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    specs = jax.tree.leaves(leaf_specs(model, shapes, 1), is_leaf=is_spec)
    assert not any(MODEL_AXIS in tuple(spec) for spec in specs)
    assert param_specs(model, 1) == {}
    for multiple in (1, 4):
        layouts = stage_layouts(model, page, multiple)
        assert all(type(lay) is SlabLayout for lay in layouts.values()), layouts
    split = jax.tree.leaves(leaf_specs(model, shapes, 2), is_leaf=is_spec)
    assert any(MODEL_AXIS in tuple(spec) for spec in split)
    layouts = stage_layouts(model, page, 2, tensor_parallel=2)
    assert isinstance(layouts[model.groups[0].name], GroupedSlabLayout)


@pytest.mark.parametrize("name", ["llama_moe", "t5_switch"])
def test_the_expert_split_reads_the_models_expert_params(name):
    """Expert parallelism's split (``models.staged.split_experts``, the groupings'
    ``names``) takes the leaves the model itself calls experts (``expert_params``, what
    ``is_expert`` and expert-aware streaming read), for any family: the grouped part
    of a block's layout holds exactly those leaves, and splitting joins back whole."""
    from hetjax.parallel.groupings import ExpertGrouping
    from models.staged import join_experts, split_experts

    model = model_of(name)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    paths = lambda tree: {
        tuple(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    checked = 0
    for group in model.groups:
        block = shapes[group.key]  # (the stacked blocks: the paths are the same)
        expected = {p for p in paths(block) if model.is_expert(p)}
        if not expected:  # (a group without a mixture of experts)
            continue
        rest, experts = split_experts(block, model.expert_params)
        assert paths(experts) == expected, (group.name, paths(experts))
        assert not any(model.is_expert(p) for p in paths(rest))
        assert paths(join_experts(rest, experts)) == paths(block)
        assert paths(ExpertGrouping(2, model.expert_params).split(block)[1]) == expected
        checked += 1
    assert checked, "no group of the model has experts"


class RecordingLayout(SingleDevice):
    """One device, recording the signature of every function compiled."""

    def __init__(self):
        super().__init__()
        self.compiled: list[StageSignature] = []

    def jit(self, fn, signature: StageSignature):
        assert isinstance(signature, StageSignature), fn
        self.compiled.append(signature)
        return super().jit(fn, signature)


def test_every_stage_function_compiles_through_the_compute_layout():
    """The stage functions, a kept block's forward and backward, a swapped block's and
    a routed block's: each compiled by the layout's jit, with a declared signature."""
    config = tiny_config(model=MODELS["llama_moe"][0])
    model = build_model(config.model)
    compute = RecordingLayout()
    assert isinstance(compute, Parallelism)
    layouts = compute.stage_layouts(model, config.memory.page_size)
    fns = stages.StageFunctions(model, layouts, compute)
    names = ["head_loss", "head_fwd_bwd", "aux_fwd_bwd", "embed_fwd", "embed_bwd"]
    names += ["input_fwd", "input_bwd", "block_fwd", "block_bwd", "block_bwd_kept"]
    names += ["zero_context", "kept_forward"]  # the keep level's, made at construction
    assert sorted(compute.compiled, key=repr) == sorted((SIGNATURES[n] for n in names), key=repr)
    before = len(compute.compiled)
    fns.kept_forward("matmuls")
    fns.swapped("all")
    fns.groups[0].routed()
    assert compute.compiled[before:] == [
        SIGNATURES[n]
        for n in ("kept_forward", "swapped_forward", "swapped_backward")
        + ("routed_route", "routed_mlp", "routed_backward")
    ]


def test_kept_and_swapped_blocks_run_under_zero3(tiny):
    """A kept block's vjp and a swapped block's residuals are each device's own
    (Kind.LOCAL) under ZeRO-3 as on one device: their backward equals the recomputing
    block backward's, gradient shares and dx."""
    config = tiny(offload=dict(mode="stream"), distributed=dict(data_parallel=2))
    zero = Zero3(config)
    assert isinstance(zero, Parallelism)
    model = build_model(config.model)
    layouts = zero.stage_layouts(model, config.memory.page_size)
    fns = stages.StageFunctions(model, layouts, zero)
    block = jax.tree.map(lambda a: np.asarray(a[0]), model.init(jax.random.key(0))["blocks"])
    b = [np.asarray(p) for p in layouts["block"].to_pages(layouts["block"].flatten_np(block))]
    rng = np.random.default_rng(0)
    x, dy = (rng.normal(size=(4, 16, 32)).astype(np.float32) for _ in range(2))
    expected = fns.block_bwd(b, x, dy)
    y, vjp = fns.block_fwd_keep(b, x)
    np.testing.assert_allclose(y[0], fns.block_fwd(b, x)[0], rtol=1e-6, atol=1e-6)
    assert_trees_close(fns.block_bwd_kept(vjp, dy), expected)
    swapped = fns.swapped("all")
    y, residuals = swapped.forward(b, x)
    assert all(r.shape[0] == 2 for r in jax.tree.leaves(residuals))  # one set a device
    assert_trees_close(swapped.backward(b, residuals, dy), expected)


@pytest.mark.slow  # 13 s; ZeRO-3 == one device in the default run: test_zero's
def test_zero3_on_a_data_by_model_mesh_equals_single_device(tiny, tmp_path):
    """ZeRO-3 on 2 devices goes through a mesh with a model axis of size 1 (no tensor
    parallelism yet: the same path a model axis would take) and trains as one device
    does (SGD, as tests/test_zero.py's plain reference)."""
    opt = dict(name="sgd", lr=0.1, grad_clip=2.0)
    config = tiny(
        optimizer=opt,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=2),
    )
    assert dict(Zero3(config).mesh.shape) == {DATA_AXIS: 2, EXPERT_AXIS: 1, MODEL_AXIS: 1}
    ref = train(tiny(optimizer=opt), tmp_path / "ref", verbose=False)
    result = train(config, tmp_path / "zero", verbose=False)
    assert_gpt_training_equal(result, ref, build_model(config.model), check_tokens())


def test_zero3_signature_kinds_place_arguments_and_results(tiny):
    """Zero3.jit by kind: a WHOLE argument is the same on every device, a LOCAL result
    is stacked one per device and handed back to its own device as an argument."""
    zero = Zero3(tiny(offload=dict(mode="stream"), distributed=dict(data_parallel=2)))
    x = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)  # 2 rows a device
    own = zero.jit(lambda x, s: x.sum() * s, StageSignature((Kind.BATCH, Kind.WHOLE), Kind.LOCAL))
    local = own(x, np.float32(2.0))
    np.testing.assert_array_equal(local, [2 * x[:2].sum(), 2 * x[2:].sum()])
    back = zero.jit(lambda v: v + 1, StageSignature((Kind.LOCAL,), Kind.LOCAL))(local)
    np.testing.assert_array_equal(back, np.asarray(local) + 1)
