"""Llama: config checks, shapes, and offload.mode=stream equals offload.mode=none."""

import jax
import numpy as np
import pytest
from equivalence import assert_training_equal, check_tokens

from hetjax.config import Config, ConfigError
from hetjax.train import train
from models import Llama, build_model
from models.llama import apply_rotary, rotary_frequencies, rotary_tables

LLAMA = dict(family="llama", num_kv_heads=2, tie_embeddings=False, d_ff=48)
SHORT = dict(steps=4, eval_batches=1)  # the validation loss is compared too


def test_shapes_and_hf_names(tiny):
    model = build_model(tiny(model=LLAMA).model)
    assert isinstance(model, Llama)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    L, D, F, V = 2, 32, 48, 256
    assert shapes["embed"]["embed_tokens"].shape == (V, D)
    blocks = shapes["blocks"]
    assert blocks["q_proj"]["kernel"].shape == (L, D, D)
    assert blocks["k_proj"]["kernel"].shape == (L, D, D // 2)  # 2 of 4 heads, width 8
    assert blocks["v_proj"]["kernel"].shape == (L, D, D // 2)
    assert blocks["o_proj"]["kernel"].shape == (L, D, D)
    assert blocks["gate_proj"]["kernel"].shape == (L, D, F)
    assert blocks["down_proj"]["kernel"].shape == (L, F, D)
    assert blocks["input_layernorm"]["scale"].shape == (L, D)
    assert shapes["head"]["lm_head"]["kernel"].shape == (D, V)
    assert shapes["head"]["norm"]["scale"].shape == (D,)
    assert not any(
        "bias" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)
    )

    tied = build_model(tiny(model={**LLAMA, "tie_embeddings": True}).model)
    tied_shapes = jax.eval_shape(tied.init, jax.random.key(0))
    assert set(tied_shapes["head"]) == {"norm"}
    assert tied.param_count() == model.param_count() - D * V


def test_rotary_is_a_relative_position_rotation(tiny):
    """q(t) . k(s) after rotation depends on t - s only."""
    config = tiny(model=dict(LLAMA, num_heads=2, rope_scaling_factor=8.0)).model  # K = 16
    cos, sin = rotary_tables(8, rotary_frequencies(config))
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
    dot = lambda t, s: float(apply_rotary(q, cos[t], sin[t]) @ apply_rotary(k, cos[s], sin[s]))
    np.testing.assert_allclose(dot(5, 2), dot(4, 1), rtol=1e-5)
    np.testing.assert_allclose(dot(3, 3), float(q @ k), rtol=1e-5)


@pytest.mark.slow  # ~7 s of compile; causality is also covered by the HF logits tests
def test_causal(tiny):
    """Changing a later token leaves earlier logits unchanged."""
    model = build_model(tiny(model=LLAMA).model)
    params = model.init(jax.random.key(0))
    tokens = check_tokens()
    changed = tokens.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    both = np.asarray(jax.jit(model.logits)(params, np.concatenate([tokens, changed])))
    a, b = both[:2], both[2:]
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(num_kv_heads=3), "model.num_heads"),
        (dict(num_kv_heads=-1), "model.num_kv_heads"),
        (dict(rope_theta=0.0), "model.rope_theta"),
        (dict(rope_scaling_factor=0.5), "model.rope_scaling_factor"),
        (dict(rope_low_freq_factor=4.0), "model.rope_low_freq_factor"),
        (dict(family="gpt", num_kv_heads=2), "model.num_kv_heads"),
        (dict(family="gpt", num_kv_heads=0, tie_embeddings=False), "model.tie_embeddings"),
        (dict(family="lama"), "model.family"),
        (dict(family="gpt", num_kv_heads=0, qkv_bias=True), "model.qkv_bias"),
        (dict(family="t5", num_kv_heads=0, qk_norm=True), "model.qk_norm"),
        (dict(sliding_window=-1), "model.sliding_window"),
        (dict(init_from="/some/dir"), "model.init_from"),
        (dict(custom="x.y:z"), "model.custom"),
        (dict(family="custom", custom="not a factory"), "model.custom"),
    ],
)
def test_config_errors_name_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        Config().replace(model={**LLAMA, **changes})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(model=LLAMA, train=SHORT)
    return train(config, tmp_path_factory.mktemp("ref"), verbose=False)


# ~15-25 s each here; the default run covers Llama under stream (NVMe optimizer) against
# none in tests/test_hf.py::test_stream_nvme_import_and_training_equal_none.
@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [dict(mode="stream", prefetch_depth=2), dict(mode="stream", optimizer="nvme", params="nvme")],
    ids=["host", "nvme"],
)
def test_llama_stream_equals_none(reference, tiny, tmp_path, offload):
    config = tiny(model=LLAMA, train=SHORT, offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert reference.losses[-1] < reference.losses[0]
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


# Tied, the embedding's gradient is the sum of the head's part and the embed backward's,
# added in another order than the reference's (float32, ~1e-7); AdamW's first steps divide
# small gradients by their own size and amplify that beyond 1e-5 (measured: k_proj.kernel
# 1.15e-6 against a bound of 8.2e-7; tests/test_zero.py's docstring). SGD with momentum
# compares the sum itself at the same tolerance.
TIED_SGD = dict(name="sgd", lr=0.1)


@pytest.mark.slow
def test_tied_llama_stream_equals_none(tiny, tmp_path):
    model = {**LLAMA, "tie_embeddings": True}
    ref = train(tiny(model=model, train=SHORT, optimizer=TIED_SGD), tmp_path / "ref", verbose=False)
    config = tiny(model=model, train=SHORT, optimizer=TIED_SGD, offload=dict(mode="stream"))
    result = train(config, tmp_path / "stream", verbose=False)
    assert_training_equal(result, ref, build_model(config.model), check_tokens())


# Qwen2's q/k/v biases and Qwen3's q/k norms together (no HF model has both; each alone
# is checked against transformers in tests/test_hf_families.py)
QWEN = dict(LLAMA, qkv_bias=True, qk_norm=True)


def test_qkv_bias_and_qk_norm_leaves_and_their_axes(tiny):
    """The biases are split over the model axis as their kernels' columns (by heads), the
    per-head-dim norms whole on every device (tensor parallelism's rules)."""
    from hetjax.parallel.rules import MODEL_AXIS, RULES, mesh_axes
    from models.staged import LAYERS, logical_axes

    model = build_model(tiny(model=QWEN).model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))["blocks"]
    axes = logical_axes(model)["blocks"]
    L, D, K = 2, 32, 8
    expected = {
        ("q_proj", "bias"): ((L, D), (LAYERS, "heads"), (None, MODEL_AXIS)),
        ("k_proj", "bias"): ((L, D // 2), (LAYERS, "kv_heads"), (None, MODEL_AXIS)),
        ("v_proj", "bias"): ((L, D // 2), (LAYERS, "kv_heads"), (None, MODEL_AXIS)),
        ("q_norm", "scale"): ((L, K), (LAYERS, "head_dim"), (None, None)),
        ("k_norm", "scale"): ((L, K), (LAYERS, "head_dim"), (None, None)),
    }
    for (module, leaf), (shape, names, split) in expected.items():
        assert shapes[module][leaf].shape == shape
        assert axes[module][leaf] == names
        assert mesh_axes(names, RULES) == split
    assert "bias" not in shapes["o_proj"]  # Qwen2 has none on the output projection


@pytest.mark.slow  # two runs' compiles: ~110 s at 2 steps on 2 cores loaded by others
def test_qwen_options_tensor_parallel_equal_one_device(tiny, tmp_path):
    """At tensor parallelism 2 (in memory) the biases and norms train as on one device
    (SGD: the same sums in another order, 1e-5), the q bias held in halves."""
    from test_in_memory_tensor import _config

    from hetjax.runtime.in_memory import InMemoryRuntime

    model = dict(model=QWEN, train=dict(grad_accum=2, steps=2))
    one = train(_config(tiny, **model), tmp_path / "one", verbose=False)
    config = _config(tiny, distributed=dict(tensor_parallel=2), **model)
    result = train(config, tmp_path / "tp", verbose=False)
    assert_training_equal(result, one, build_model(config.model), check_tokens())
    bias = InMemoryRuntime(config).state.params["blocks"]["q_proj"]["bias"]
    assert {s.data.shape for s in bias.addressable_shards} == {(2, 16)}
