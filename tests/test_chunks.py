"""offload.batch_chunks (hetjax/runtime/stages/chunks.py): a stage function run over its
micro-batch in chunks of rows computes what the whole micro-batch's does. Training in
chunks against offload.mode=none: tests/test_stream.py (one device), tests/test_zero.py
(ZeRO-3); the planner's working set against the compiled one: tests/test_planner.py."""

import jax
import jax.numpy as jnp
import ml_dtypes  # numpy's bfloat16 (a jax dependency)
import numpy as np
import pytest
from equivalence import assert_trees_close

from hetjax.config import ConfigError, load_config
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.single import SingleDevice
from hetjax.runtime.stages import chunks
from hetjax.runtime.stages import functions as stages
from models import build_model

ROWS, T = 4, 32


def _functions(family: str, n: int, dtype, leaf_buffers: bool):
    overrides = {
        "model.family": family,
        "model.num_layers": "2",
        "model.d_model": "64",
        "model.num_heads": "4",
        "model.max_seq_len": str(T),
        "model.attention_block": "16",
        "train.seq_len": str(T),
        "model.compute_dtype": jnp.dtype(dtype).name,
    }
    if family == "llama":
        overrides.update({"model.num_kv_heads": "2", "model.tie_embeddings": "false"})
    model = build_model(load_config("gpt_tiny", overrides).model)
    layouts = stage_layouts(model, 64 * 1024, leaf_buffers=leaf_buffers)
    fns = stages.StageFunctions(
        model, layouts, SingleDevice(),
        block_grad_dtype=dtype, batch_chunks=n,
    )  # fmt: skip
    return model, layouts, fns


def _stage(layouts, name, dtype, rng):
    L = layouts[name]
    flat = rng.normal(0, 0.05, L.padded_size).astype(np.float32)
    if L.leaf_buffers:
        return jax.tree.map(lambda a: jnp.asarray(a, dtype), L.leaf_views(flat))
    return [jnp.asarray(p, dtype) for p in flat.reshape(L.num_pages, -1)]


def _run(family, n, dtype, leaf_buffers):
    """Every chunked function's results on fixed inputs: the block's forward and
    backward, the head's loss and backward."""
    model, layouts, fns = _functions(family, n, dtype, leaf_buffers)
    rng = np.random.default_rng(0)
    b, e, h = (_stage(layouts, name, dtype, rng) for name in ("block", "embed", "head"))
    x = jnp.asarray(rng.normal(0, 1, (ROWS, T, 64)), dtype)
    dy = jnp.asarray(rng.normal(0, 1, (ROWS, T, 64)), dtype)
    targets = jnp.asarray(rng.integers(0, 256, (ROWS, T)), jnp.int32)
    y, stats = fns.block_fwd(b, x, ())
    (db, norms), dx, _ = fns.block_bwd(b, x, dy, stats, (), ())
    loss, (dh, _), (de, _), dhx = fns.head_fwd_bwd(h, e, x, targets, jnp.float32(1))
    eval_loss = fns.head_loss(h, e, x, targets)
    return dict(y=y, db=db, norms=norms, dx=dx, loss=loss, dh=dh, de=de, dhx=dhx, eval=eval_loss)


@pytest.mark.parametrize(  # slow (10 s): the default run trains in chunks, test_stream's
    "family, leaf_buffers",
    [
        pytest.param("gpt", False, marks=pytest.mark.slow),
        pytest.param("llama", True, marks=pytest.mark.slow),
    ],
    ids=["gpt_pages", "llama_leaves"],
)
def test_chunked_stage_functions_equal_whole_ones(family, leaf_buffers):
    """fp32: every result of the chunked functions (2 and 4 chunks) equals the whole
    micro-batch's at 1e-5 (the gradients are sums over chunks: rounding differs)."""
    whole = _run(family, 1, jnp.float32, leaf_buffers)
    for n in (2, 4):
        chunked = _run(family, n, jnp.float32, leaf_buffers)
        assert jax.tree.structure(chunked) == jax.tree.structure(whole)
        assert_trees_close(chunked, whole, rtol=1e-5)


def test_bf16_chunked_gradient_is_summed_in_bf16():
    """bf16 (memory.block_grad_dtype's bf16 slabs): the block gradient of 4 chunks is,
    bit for bit, the chunks' bf16 gradients (each computed alone, by the whole-batch
    function on the chunk's row) added one after the other in bf16, each partial sum
    rounded to bf16; not their fp32 sum rounded once, which differs in many elements
    on these values. The forward's rows within a bf16 rounding of the whole
    micro-batch's (a dot of fewer rows may block its sums differently)."""
    whole = _run("gpt", 1, jnp.bfloat16, False)
    chunked = _run("gpt", 4, jnp.bfloat16, False)
    assert all(p.dtype == jnp.bfloat16 for p in chunked["db"])
    y, y_whole = (np.asarray(r["y"], np.float32) for r in (chunked, whole))
    assert np.linalg.norm(y - y_whole) <= 2.0**-8 * np.linalg.norm(y_whole)
    # each chunk's gradient alone: the inputs _run draws, one row (a chunk) at a time
    _, layouts, fns = _functions("gpt", 1, jnp.bfloat16, False)
    rng = np.random.default_rng(0)
    b = _stage(layouts, "block", jnp.bfloat16, rng)
    for name in ("embed", "head"):  # (drawn between the block and x: the same stream)
        _stage(layouts, name, jnp.bfloat16, rng)
    x = jnp.asarray(rng.normal(0, 1, (ROWS, T, 64)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(0, 1, (ROWS, T, 64)), jnp.bfloat16)
    grads = []
    for k in range(ROWS):
        _, stats = fns.block_fwd(b, x[k : k + 1], ())
        (g, _), _, _ = fns.block_bwd(b, x[k : k + 1], dy[k : k + 1], stats, (), ())
        grads.append([np.asarray(p, np.float32) for p in g])
    bf16 = lambda a: np.asarray(a, ml_dtypes.bfloat16).astype(np.float32)
    in_bf16 = [np.zeros_like(p) for p in grads[0]]
    for g in grads:  # a bf16 add: the exact sum rounded to bf16 (fp32 rounds no differently)
        in_bf16 = [bf16(a + p) for a, p in zip(in_bf16, g, strict=True)]
    in_fp32 = [bf16(sum(g[i] for g in grads)) for i in range(len(grads[0]))]
    got = np.concatenate([np.asarray(p, np.float32) for p in chunked["db"]])
    np.testing.assert_array_equal(got, np.concatenate(in_bf16))
    assert np.count_nonzero(got != np.concatenate(in_fp32)) > got.size // 10
    w = np.concatenate([np.asarray(p, np.float32) for p in whole["db"]])
    assert np.linalg.norm(got - w) <= 8 * 2.0**-8 * np.linalg.norm(w)


def test_models_whose_rows_are_not_independent_are_refused():
    """The runtime's own check (a user's model reaches it without the config's)."""
    for name, why in (("mixtral_tiny", "pool statistics"), ("t5_tiny", "several stage groups")):
        model = build_model(load_config(name).model)
        with pytest.raises(ConfigError, match=rf"'offload.batch_chunks' \(2\).*{why}"):
            chunks.check(model, 2)
    chunks.check(build_model(load_config("gpt_tiny").model), 2)  # GPT's rows are
