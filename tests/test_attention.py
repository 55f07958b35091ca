"""model.attention: the blockwise attention equals the reference one (fp32, 1e-5) in
outputs, gradients and training, and its compiled stage functions hold no T x T tensor."""

import re

import jax
import jax.numpy as jnp
import pytest
from equivalence import assert_gpt_training_equal, assert_trees_close, check_tokens

from hetjax.config import Config, ConfigError
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.single import SingleDevice
from hetjax.runtime.stages import functions as stages
from hetjax.train import train
from models import attention, build_model


def _qkv(B, T, N, G, K, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, N, G, K))
    return q, jax.random.normal(kk, (B, T, N, K)), jax.random.normal(kv, (B, T, N, K))


@pytest.mark.parametrize(
    "B, T, N, G, K, block",
    [
        (2, 40, 2, 3, 8, 16),  # GQA, T not a multiple of the block
        pytest.param(1, 64, 4, 1, 16, 16, marks=pytest.mark.slow),  # multi-head, 4 x 4 tiles
        pytest.param(2, 17, 1, 2, 8, 32, marks=pytest.mark.slow),  # one tile: block > T
        (1, 33, 2, 2, 8, 8),  # a last tile holding one real row
    ],
)
def test_blockwise_equals_reference(B, T, N, G, K, block):
    """Output, and the gradients of q, k, v under a random cotangent, within 1e-5."""
    q, k, v = _qkv(B, T, N, G, K)
    cotangent = jax.random.normal(jax.random.key(1), (B, T, N * G * K))

    def outputs_and_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cotangent)

    blockwise = jax.jit(lambda q, k, v: attention.blockwise_attention(q, k, v, block))
    assert_trees_close(
        outputs_and_grads(blockwise), outputs_and_grads(attention.reference_attention)
    )


def _config(family: str, impl: str, seq_len: int = 40, block: int = 16) -> Config:
    model = dict(
        family=family,
        num_layers=2,
        d_model=32,
        num_heads=4,
        max_seq_len=max(64, seq_len),
        attention=impl,
        attention_block=block,
    )
    if family == "llama":
        model.update(num_kv_heads=2, tie_embeddings=False)
    return Config().replace(model=model, train=dict(seq_len=seq_len, batch_size=2))


# default run: llama (GQA, rotary); gpt with -m slow
@pytest.mark.parametrize("family", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_model_logits_and_gradients_equal_reference(family):
    """GPT and Llama (GQA: 4 query heads on 2 key/value heads), causal, T = 40 in tiles
    of 16: logits and the loss's gradient of every param within 1e-5."""
    tokens = jax.random.randint(jax.random.key(2), (2, 41), 0, 256)
    results = []
    for impl in ("blockwise", "reference"):
        model = build_model(_config(family, impl).model)
        params = model.init(jax.random.key(0))
        logits = jax.jit(model.logits)(params, tokens[:, :-1])
        grads = jax.jit(jax.grad(model.loss))(params, tokens[:, :-1], tokens[:, 1:])
        results.append((logits, grads))
    assert_trees_close(*results)


def test_auto_resolves_by_backend_and_dtype():
    assert attention.resolve("auto", "cpu", jnp.bfloat16, 64) == "blockwise"
    assert attention.resolve("auto", "gpu", jnp.float32, 64) == "blockwise"
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 64) == "fused"
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 160) == "blockwise"
    assert attention.resolve("reference", "gpu", jnp.bfloat16, 64) == "reference"
    assert attention.block_size(0, 4096) == attention.DEFAULT_BLOCK
    assert attention.block_size(0, 100) == 100 and attention.block_size(64, 100) == 64


def test_fused_without_cudnn_names_the_key():
    model = build_model(_config("gpt", "fused").model)
    with pytest.raises(ConfigError, match=r"'model.attention' is 'fused' \(cuDNN\), which needs"):
        model.init(jax.random.key(0))


def test_config_keys_are_validated():
    with pytest.raises(ConfigError, match=r"'model.attention' must be one of"):
        Config().override({"model.attention": "flash"})
    with pytest.raises(ConfigError, match=r"'model.attention_block' must be >= 0"):
        Config().override({"model.attention_block": "-1"})


def _score_shapes(hlo: str, T: int) -> list[str]:
    """Array shapes in an HLO text whose two last dimensions are (T, T)."""
    return sorted(set(re.findall(rf"\w+\[[\d,]*\b{T},{T}\]", hlo)))


# both with -m slow (~5 s each): the blockwise attention's equality runs in the default run
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.slow
def test_compiled_stages_hold_no_score_matrix(family):
    """The compiled block stage functions (forward, backward with recompute, kept
    forward at each level and backward from it): with blockwise attention at T = 112 in
    tiles of 32 (the last padded), no array ends in (T, T) (with the reference attention
    the same search finds the (B, H, T, T) scores), and XLA's temporaries are smaller."""
    T, B = 112, 2
    temps = {}
    for impl in ("blockwise", "reference"):
        model = build_model(_config(family, impl, seq_len=T, block=32).model)
        layouts = stage_layouts(model, 4096)
        fns = stages.StageFunctions(model, layouts, SingleDevice())
        args = fns.abstract_args(B, T, jnp.float32)
        compiled = {
            "block_fwd": fns.block_fwd.lower(*args["block_fwd"]).compile(),
            "block_bwd": fns.block_bwd.lower(*args["block_bwd"]).compile(),
        }
        x = args["block_fwd"][1]
        for level in fns.keep_levels(B, T, jnp.float32):
            fwd = fns.kept_forward(level)
            compiled[f"kept_fwd_{level}"] = fwd.lower(*args["block_fwd"]).compile()
            _, vjp = jax.eval_shape(fwd, *args["block_fwd"])
            compiled[f"kept_bwd_{level}"] = fns.block_bwd_kept.lower(vjp, x).compile()
        found = {name: _score_shapes(c.as_text(), T) for name, c in compiled.items()}
        if impl == "blockwise":
            assert not any(found.values()), found
        else:
            assert found["block_bwd"], "the search finds the reference's score matrix"
        temps[impl] = compiled["block_bwd"].memory_analysis().temp_size_in_bytes
    assert temps["blockwise"] < temps["reference"], temps


def _loops(jaxpr) -> int:
    """Loops (scan and while) in a jaxpr, nested ones included."""
    from jax.extend.core import subjaxprs

    own = sum(eqn.primitive.name in ("scan", "while") for eqn in jaxpr.eqns)
    return own + sum(_loops(sub) for sub in subjaxprs(jaxpr))


def test_kept_matmuls_level_does_not_recompute_the_attention_forward():
    """Keep level matmuls keeps the blockwise attention's output and logsumexp: the
    kept block's backward runs the attention backward's two loops (key tiles, and query
    tiles in each) and not the forward's two; recomputing the block (no keep) runs all
    four."""
    config = _config("gpt", "blockwise", seq_len=64)
    model = build_model(config.model)
    layouts = stage_layouts(model, 4096)
    fns = stages.StageFunctions(model, layouts, SingleDevice())
    args = fns.abstract_args(2, 64, jnp.float32)
    x = args["block_fwd"][1]
    _, vjp = jax.eval_shape(fns.kept_forward("matmuls"), *args["block_fwd"])
    kept = jax.make_jaxpr(lambda v, dy: fns.block_bwd_kept(v, dy))(vjp, x).jaxpr
    recomputed = jax.make_jaxpr(fns.block_bwd)(*args["block_bwd"]).jaxpr
    assert (_loops(kept), _loops(recomputed)) == (2, 4)


# -- training ----------------------------------------------------------------------------

# T = 16 in tiles of 6: three tiles, the last padded.
BLOCKWISE = dict(attention="blockwise", attention_block=6)


@pytest.fixture(scope="module")
def blockwise_reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, **BLOCKWISE)
    )
    return train(config, tmp_path_factory.mktemp("ref"), verbose=False)


@pytest.mark.parametrize(
    "offload",
    [
        dict(mode="stream", prefetch_depth=1),
        dict(mode="stream", keep_blocks=1, keep_level="matmuls"),
        dict(mode="stream", keep_blocks=2, keep_level="all", activations="host"),
    ],
    ids=["recompute", "keep_matmuls", "keep_all"],
)
def test_streamed_training_equals_none(blockwise_reference, tiny, tmp_path, offload):
    """offload.mode=stream (recomputing blocks, and kept blocks at each level) trains as
    offload.mode=none does, both with the blockwise attention, within 1e-5."""
    config = tiny(
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, **BLOCKWISE),
        offload=offload,
    )
    result = train(config, tmp_path, verbose=False)
    model = build_model(config.model)
    assert_gpt_training_equal(result, blockwise_reference, model, check_tokens())


@pytest.mark.slow  # the streamed equivalence tests above compare blockwise with none
def test_blockwise_training_equals_reference_attention(tiny, tmp_path):
    """offload.mode=none trains the same with either attention, within 1e-5. With SGD:
    AdamW divides near-zero gradients by their own size and turns the two attentions'
    last-bit differences into parameter differences beyond 1e-5 of a tensor's max (as
    for summation orders, tests/test_stream.py's ACCUM_SGD)."""
    sgd = dict(name="sgd", lr=0.1)
    results = [
        train(tiny(model=dict(attention=impl), optimizer=sgd), tmp_path / impl, verbose=False)
        for impl in ("reference", "blockwise")
    ]
    model = build_model(tiny(model=BLOCKWISE).model)
    assert_gpt_training_equal(*results, model, check_tokens())
