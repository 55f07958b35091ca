"""The equivalence criterion shared by the offload-vs-reference tests.

Two parameter trees are equal "within rtol relative" when, for every tensor, the error
norm is at most ``rtol`` times the tensor's norm and every element is within ``rtol``
times the tensor's largest magnitude. Elementwise relative error is not used because
Adam divides near-zero gradients by their own RMS, so elements of size ~1e-7 legitimately
differ in their last bits between two summation orders."""

import jax
import numpy as np


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


def assert_losses_close(actual, expected, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol)
