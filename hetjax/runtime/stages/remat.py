"""Which in-block activations a kept block keeps (``offload.keep_level``).

A block the streaming runtime keeps (``offload.keep_blocks``) returns its vjp from
forward, and backward applies it. At level ``all`` that is ``jax.vjp(block, params, x)``:
every residual is held from forward to backward and nothing is recomputed. The other
levels run ``jax.vjp(jax.checkpoint(block, policy=P), params, x)``: the vjp holds only
what policy P saves (and the inputs), and backward recomputes the rest from them.

Which activations to hold follows Fuyou's swap benefit factor (section 4.5): the
recompute FLOPs an activation saves per byte it holds. In a transformer block, highest
first (D model width, T sequence, K head width, per element held):

  ``matmuls``  the weight matmuls' outputs (2 D FLOPs each; every dot without batch
               dimensions: ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``,
               so any block) and what the block tags ``attn_out`` (the attention output,
               2 T FLOPs) and ``attn_lse``. With the blockwise attention
               (models/attention.py) the output and the logsumexp of each score row
               (B, H, T) fp32 are all its backward needs besides q, k, v: the attention
               forward is not recomputed, only the elementwise ops (norms, GELU, rotary).
               The attention backward recomputes its tiles' scores at every level, as it
               does in any block. With the reference attention backward recomputes the
               scores and softmax; with cuDNN's fused one its forward (its softmax
               statistics cannot be tagged).
  ``probs``    also the attention probabilities (B, H, T, T) (2 K FLOPs and a softmax),
               where the block tags them ``attn_probs``: only the reference attention
               (``model.attention=reference``) has them as a tensor. Backward recomputes
               only the elementwise ops.
  ``all``      also the elementwise intermediates (norm statistics, GELU's, rotary q and
               k; the reference attention's fp32 scores and mask): a few FLOPs each.
               Nothing is recomputed.

A block tags a value with ``jax.ad_checkpoint.checkpoint_name(value, "attn_out")`` in its
forward, an identity that changes no result (models/attention.py does for the zoo). A
block with no tags (e.g. a user's, models/staged.py) supports ``matmuls`` (its dots) and
``all``; ``probs`` needs the ``attn_probs`` tag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import jax
from jax.extend.core import Jaxpr, subjaxprs

from hetjax.config import KEEP_LEVELS

# Named values a block may tag, and the level that starts keeping each.
TAGS = {"attn_out": "matmuls", "attn_lse": "matmuls", "attn_probs": "probs"}


def policy(level: str):
    """The ``jax.checkpoint`` policy of a keep level; None for ``all`` (no checkpoint)."""
    if level == "all":
        return None
    rank = KEEP_LEVELS.index(level)  # KEEP_LEVELS: highest benefit factor first
    names = [tag for tag, lvl in TAGS.items() if KEEP_LEVELS.index(lvl) <= rank]
    cp = jax.checkpoint_policies
    return cp.save_from_both_policies(
        cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*names)
    )


def kept_forward(block: Callable, level: str) -> Callable:
    """``block`` to differentiate with ``jax.vjp`` so that the vjp holds ``level``'s
    activations."""
    p = policy(level)
    return block if p is None else jax.checkpoint(block, policy=p)


def tagged_names(block: Callable, *args) -> set[str]:
    """The ``checkpoint_name`` tags in ``block(*args)``'s forward (args may be abstract)."""

    def names(jaxpr: Jaxpr) -> Iterator[str]:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                yield eqn.params["name"]
        for sub in subjaxprs(jaxpr):
            yield from names(sub)

    return set(names(jax.make_jaxpr(block)(*args).jaxpr))


def levels(block: Callable, *args) -> tuple[str, ...]:
    """The keep levels ``block`` supports, highest benefit factor first: ``probs`` only
    where it tags ``attn_probs`` (the reference attention)."""
    tags = tagged_names(block, *args)
    return tuple(lvl for lvl in KEEP_LEVELS if lvl != "probs" or "attn_probs" in tags)


def kept_bytes(block: Callable, params, x) -> dict[str, int]:
    """Bytes of one block's vjp residuals at each level it supports (its inputs among
    them), from abstract shapes: ``block(params, x)``, x (B, T, D)."""

    def residuals(level: str) -> int:
        fwd = kept_forward(block, level)
        _, vjp = jax.eval_shape(lambda p, x: jax.vjp(fwd, p, x), params, x)
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(vjp))

    return {level: residuals(level) for level in levels(block, params, x)}
