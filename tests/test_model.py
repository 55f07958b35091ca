import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import build_model


def _model_and_params(config):
    model = build_model(config.model)
    return model, model.init(jax.random.key(0))


def test_forward_shapes(tiny):
    config = tiny()
    model, params = _model_and_params(config)
    tokens = jnp.zeros((3, 16), jnp.int32)
    assert model.logits(params, tokens).shape == (3, 16, 256)
    x = model.embed(params["embed"], tokens)
    assert x.shape == (3, 16, 32)
    layer0 = jax.tree.map(lambda a: a[0], params["blocks"])
    assert model.block(layer0, x).shape == (3, 16, 32)
    assert params["blocks"]["c_attn"]["kernel"].shape == (2, 32, 96)  # (L, D, 3D)


def test_causal_masking(tiny):
    model, params = _model_and_params(tiny())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 16)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 9:] = (changed[:, 9:] + 17) % 256  # change only future tokens
    a = np.asarray(model.logits(params, tokens))
    b = np.asarray(model.logits(params, changed))
    np.testing.assert_array_equal(a[:, :9], b[:, :9])  # earlier positions: bit-identical
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3  # later ones do change


def test_stages_compose_to_the_whole_model(tiny):
    model, params = _model_and_params(tiny())
    tokens = np.random.default_rng(1).integers(0, 256, (2, 17)).astype(np.int32)
    x = model.embed(params["embed"], tokens[:, :-1])
    for i in range(2):
        x = model.block(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), x)
    staged = model.head_loss(params["head"], params["embed"], x, tokens[:, 1:])
    whole = model.loss(params, tokens[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(staged, whole, rtol=1e-6)
    # An untrained byte model predicts roughly uniformly: loss near log(256).
    assert abs(float(whole) - np.log(256)) < 0.5


def test_param_count_formula(tiny):
    m = tiny().model
    D, F, V, S, L = m.d_model, m.ff_dim, m.vocab_size, m.max_seq_len, m.num_layers
    per_block = 4 * D * D + 4 * D + 2 * D * F + F + D + 4 * D
    assert build_model(m).param_count() == V * D + S * D + L * per_block + 2 * D


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compute_dtype_keeps_fp32_params(tiny, dtype):
    config = tiny(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype=dtype)
    )
    model, params = _model_and_params(config)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    tokens = jnp.zeros((1, 8), jnp.int32)
    assert model.embed(params["embed"], tokens).dtype == jnp.dtype(dtype)
    loss = model.loss(params, tokens, tokens)
    assert loss.dtype == jnp.float32 and jnp.isfinite(loss)
