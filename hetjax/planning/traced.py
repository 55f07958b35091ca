"""What the planner traces of a model (``jax.eval_shape``), kept by what it depends on:
each profile's splits of a config ask for the same, and tracing is most of a small
plan's time (``Workload.from_config``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from hetjax.runtime.stages import remat

KEEP = 64  # entries a cache holds before it starts afresh


def keep(cache: dict, key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` the first time (at most :data:`KEEP` kept)."""
    if key not in cache:
        if len(cache) >= KEEP:
            cache.clear()
        cache[key] = make()
    return cache[key]


_SHAPES: dict[Any, Any] = {}
_KEPT: dict[tuple, list[dict[str, int]]] = {}


def param_shapes(model, m) -> Any:
    """``model``'s params as abstract shapes (``jax.eval_shape`` of its init); ``m``:
    its ModelConfig, what they are kept by."""
    return keep(_SHAPES, m, lambda: jax.eval_shape(model.init, jax.random.key(0)))


def vjp_kept(model, m, b: int, T: int, attention: str) -> list[dict[str, int]]:
    """The residuals of one block's vjp at each keep level (``remat.kept_bytes``) for
    each stage group of ``model`` (ModelConfig ``m``), at ``b`` rows of ``T`` positions,
    from abstract shapes (its params unflattened, in the compute dtype). ``attention``:
    the implementation the trace runs (this process's, after its cuDNN probe)."""

    def trace() -> list[dict[str, int]]:
        dtype = jnp.dtype(m.compute_dtype)
        shapes, inputs = param_shapes(model, m), model.abstract_inputs(b, T)
        kept = []
        for g, group in enumerate(model.groups):
            one_block = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape[1:], dtype), shapes[group.key]
            )
            x, context = inputs[g]  # the context is an argument, as in the runtime
            fn = lambda pc, x, g=g: model.group_block(g, pc[0], x, pc[1])[0]
            kept.append(remat.kept_bytes(fn, (one_block, context), x))
        return kept

    return keep(_KEPT, (m, b, T, attention), trace)
