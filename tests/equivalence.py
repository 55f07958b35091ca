"""The equivalence criterion shared by the offload-vs-reference tests.

Two parameter trees are equal "within rtol relative" when, for every tensor, the error
norm is at most ``rtol`` times the tensor's norm and every element is within ``rtol``
times the tensor's largest magnitude. Elementwise relative error is not used because
Adam divides near-zero gradients by their own RMS, so elements of size ~1e-7 legitimately
differ in their last bits between two summation orders."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np


def bit_exact_here() -> bool:
    """Whether two runs of the same device programs give the same bits here: on the CPU
    backend, and on a GPU with XLA's deterministic ops (gpucheck's equivalence section
    sets them after probing the flag). Elsewhere a GPU's scatter (the embedding's
    backward) sums with atomics in whatever order: the tests that compare bit for bit
    compare at 1e-5 there."""
    from hetjax.gpucheck.common import DETERMINISTIC_OPS

    flags = os.environ.get("XLA_FLAGS", "").split()
    return jax.default_backend() == "cpu" or DETERMINISTIC_OPS in flags


def check_tokens() -> np.ndarray:
    """The fixed token batch the equivalence checks evaluate both runs' params on."""
    return np.random.default_rng(7).integers(0, 256, (2, 16)).astype(np.int32)


def training_batches(config, steps: int) -> list[np.ndarray]:
    """The first ``steps`` training batches of ``config``'s data, shaped for a runtime's
    ``train_step``: (grad_accum, micro-batch, W), W the window of ``data.objective``
    (seq_len + 1 for lm)."""
    from hetjax.data import make_datasets, window_length

    data, _, _ = make_datasets(config)
    t = config.train
    shape = (t.grad_accum, t.micro_batch_size, window_length(config.data, t.seq_len))
    return [data.batch(s).reshape(shape) for s in range(steps)]


def assert_trees_close(actual, expected, rtol: float = 1e-5) -> None:
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e), "trees differ in structure"
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (jax.tree_util.keystr(path), a.shape, e.shape)
        scale = np.abs(e).max()
        err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
        worst = np.abs(a - e).max()
        assert err <= rtol and worst <= rtol * scale, (
            f"{jax.tree_util.keystr(path)}: relative error {err:.3g}, max abs diff {worst:.3g} "
            f"vs tensor max {scale:.3g} (rtol {rtol})"
        )


# int8 moments (optimizer.state_dtype=int8) under another reduction order: two runs
# whose fp32 gradients part by their rounding (~1e-7 relative: two devices' sum against
# two micro-batches') quantize the same moments to the same codes except where a moment
# lies within that rounding of a code's midpoint; there the code moves one step
# (2**(1/8)) and so does that element's update. Measured 2026-11-29: 1 element of
# 16,384 in a leaf (max abs diff 2.56e-6 against a tensor max of 0.048), on one machine
# and not on another (the rounding decides). A broken shard, scale or page moves whole
# blocks (256 elements) and pages: far more than this.
CODE_FLIPS = 4  # elements a leaf, at most
FLIP_RTOL = 1e-3  # each within this of the tensor's max


def assert_int8_trees_close(actual, expected, rtol: float = 1e-5) -> None:
    """:func:`assert_trees_close` for int8-moment runs: every element within ``rtol``
    of the tensor's max but at most ``CODE_FLIPS`` a leaf (a code moved one step by a
    rounding, above), those within ``FLIP_RTOL``; the rest's relative error within
    ``rtol``."""
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e), "trees differ in structure"
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        name = jax.tree_util.keystr(path)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        scale = np.abs(e).max()
        diff = np.abs(a - e)
        off = diff > rtol * scale
        rest = np.linalg.norm(np.where(off, 0, a - e)) / max(np.linalg.norm(e), 1e-30)
        assert off.sum() <= CODE_FLIPS and rest <= rtol, (
            f"{name}: {int(off.sum())} elements beyond rtol {rtol} of the tensor max "
            f"{scale:.3g} (at most {CODE_FLIPS}: a code moved by a rounding), relative "
            f"error of the rest {rest:.3g}"
        )
        assert diff.max() <= FLIP_RTOL * scale, (
            f"{name}: max abs diff {diff.max():.3g} beyond {FLIP_RTOL} of {scale:.3g}"
        )


def assert_losses_close(actual, expected, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol)


def read_summary(result) -> dict:
    """``summary.json`` of a :class:`~hetjax.train.TrainResult`'s run, checked against
    what ``train`` returned: the file holds the run's own losses (exactly: JSON keeps a
    float's every bit), its validation loss and its last step."""
    summary = json.loads((result.workdir / "summary.json").read_text())
    assert _same(summary["val_loss"], result.val_loss), (summary, result.val_loss)
    if result.losses:
        assert summary["first_loss"] == result.losses[0], (summary, result.losses)
        assert summary["last_loss"] == result.losses[-1], (summary, result.losses)
        assert summary["steps"] == result.records[-1]["step"], summary
    return summary


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _evaluated(result) -> bool:
    """Whether the run evaluated (``train.eval_batches`` > 0 in the config it wrote)."""
    config = json.loads((result.workdir / "config.json").read_text())
    return config["train"]["eval_batches"] > 0


def assert_evaluation_equal(actual, expected, rtol: float = 1e-5) -> None:
    """The validation loss (``train.eval_batches``; the published compute-dtype params)
    finite in both runs and within ``rtol`` (a run without evaluation, NaN by
    definition, only against another without: NaN == NaN compares nothing); and each
    run's ``summary.json`` (read back and checked against its result): first and last
    training loss and validation loss within ``rtol``, the same number of steps."""
    evaluated = _evaluated(actual), _evaluated(expected)
    assert evaluated[0] == evaluated[1], f"one run evaluated, the other not: {evaluated}"
    if evaluated[0]:
        assert math.isfinite(actual.val_loss) and math.isfinite(expected.val_loss), (
            actual.val_loss,
            expected.val_loss,
        )
        assert_losses_close([actual.val_loss], [expected.val_loss], rtol)
    else:
        assert math.isnan(actual.val_loss) and math.isnan(expected.val_loss)
    a, e = read_summary(actual), read_summary(expected)
    assert a["steps"] == e["steps"], (a, e)
    for key in ("first_loss", "last_loss", "val_loss"):
        assert_losses_close([a[key]], [e[key]], rtol)


def without_key_bias(params):
    """A copy of GPT params with the attention key bias zeroed.

    ``q . (k + b_k)`` adds the same ``q . b_k`` to every score of a query row, which
    softmax cancels: the key bias has no effect on the output and its gradient is zero
    in exact arithmetic. In floating point it is rounding noise, which Adam normalises to
    lr-sized steps, so its value after training is noise in any two runs that round
    differently. It is excluded from parameter comparisons (nothing else is); the
    equivalence tests also compare the models' outputs, where it cannot matter."""
    params = jax.tree.map(np.array, params)
    bias = params["blocks"]["c_attn"]["bias"]  # (L, 3D): q | k | v
    d = bias.shape[-1] // 3
    bias[..., d : 2 * d] = 0.0
    return params


def assert_gpt_training_equal(actual, expected, model=None, tokens=None, rtol=1e-5) -> None:
    """Per-step losses, final params (key bias aside, see above), validation loss and
    ``summary.json`` (:func:`assert_evaluation_equal`) within ``rtol``; with ``model``
    and ``tokens``, the final logits too."""
    assert_losses_close(actual.losses, expected.losses, rtol)
    assert_evaluation_equal(actual, expected, rtol)
    assert_trees_close(without_key_bias(actual.params), without_key_bias(expected.params), rtol)
    if model is not None:
        assert_logits_close(model, actual.params, expected.params, tokens, rtol)


def check_fp16_overflow_skips_then_trains(runtime, batch) -> None:
    """For a runtime built with fp16 compute and ``loss_scale_init = 2**60``: the first
    step overflows and is skipped with params untouched and the scale halved; the scale
    then falls until a step goes through and changes every parameter."""
    before = runtime.params()
    stats = runtime.train_step(batch)
    assert stats.skipped and stats.loss_scale == 2.0**60
    jax.tree.map(np.testing.assert_array_equal, runtime.params(), before)
    for _ in range(60):
        stats = runtime.train_step(batch)
        if not stats.skipped:
            break
    assert not stats.skipped and np.isfinite(stats.loss)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), runtime.params(), before)
    assert all(jax.tree.leaves(changed))


def assert_training_equal(actual, expected, model=None, tokens=None, rtol=1e-5) -> None:
    """Per-step losses, every final param, validation loss and ``summary.json`` within
    ``rtol``; with ``model`` and ``tokens``, the final logits too. For models without an
    attention key bias (Llama, user-defined blocks); GPT uses
    :func:`assert_gpt_training_equal`."""
    assert_losses_close(actual.losses, expected.losses, rtol)
    assert_evaluation_equal(actual, expected, rtol)
    assert_trees_close(actual.params, expected.params, rtol)
    if model is not None:
        assert_logits_close(model, actual.params, expected.params, tokens, rtol)


def assert_logits_close(model, actual_params, expected_params, tokens, rtol: float) -> None:
    """The model's logits on ``tokens`` with both params within ``rtol`` of the largest,
    or within one rounding of the model's compute dtype if that is coarser: the logits
    are compute-dtype values, so params that differ in their last fp32 bits may flip a
    logit's rounding, by one ulp (at most eps times the logit; bf16 2^-7, fp16 2^-10).
    ``tokens``: the model's input, or a tuple of its inputs (an encoder-decoder model's
    tokens and targets)."""
    eps = float(jnp.finfo(jnp.dtype(model.config.compute_dtype)).eps)
    inputs = tokens if isinstance(tokens, tuple) else (tokens,)
    a = np.asarray(model.logits(actual_params, *inputs), np.float64)
    e = np.asarray(model.logits(expected_params, *inputs), np.float64)
    tol = max(rtol, eps) * np.abs(e).max()
    assert np.abs(a - e).max() <= tol, (np.abs(a - e).max(), tol)
