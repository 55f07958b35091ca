"""Optax optimizers built from ``OptimizerConfig``.

The pieces are kept separate so that every runtime can reuse them: the in-memory trainer
chains ``clip -> base``; the host optimizer (offloaded modes) computes the global norm
during backward and applies the same clip factor itself, then runs ``base`` on slabs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from hetjax.config import OptimizerConfig
from hetjax.optimizer.moments import low_precision
from hetjax.state_format import moment_format
from hetjax.storage.pages import weight_decay_mask
from hetjax.types import MASTER


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate at update ``n`` (0-based): linear warmup ``lr * (n + 1) / warmup``
    (so the first update is not wasted at 0), then constant, or cosine decay from ``lr``
    to ``lr * min_lr_ratio`` at ``total_steps``."""
    warmup, peak = cfg.warmup_steps, cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)

    def schedule(count):
        n = jnp.asarray(count, jnp.float32)
        if cfg.schedule == "constant":
            after = jnp.float32(peak)
        else:
            progress = jnp.clip((n - warmup) / decay_steps, 0.0, 1.0)
            after = floor + 0.5 * (peak - floor) * (1 + jnp.cos(jnp.pi * progress))
        if warmup == 0:
            return after
        return jnp.where(n < warmup, peak * (n + 1) / warmup, after)

    return schedule


def base_optimizer(cfg: OptimizerConfig, total_steps: int, mask: Any = None):
    """The elementwise optimizer without clipping. ``mask`` selects weight-decayed leaves."""
    lr = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        return optax.adamw(lr, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "adam":
        return optax.adam(lr, cfg.b1, cfg.b2, cfg.eps)
    if cfg.name == "lion":
        return optax.lion(lr, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.name == "sgd":
        return optax.sgd(lr, momentum=cfg.momentum or None)
    raise AssertionError(cfg.name)


def build_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any):
    """Global-norm clipping (if ``grad_clip > 0``) followed by the base optimizer, its
    moments kept in ``optimizer.state_dtype`` (``moments.py``)."""
    tx = base_optimizer(cfg, total_steps, weight_decay_mask(params))
    if cfg.grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return low_precision(tx, moment_format(cfg.state_dtype))


def state_kind_name(prefix, used: set[str]) -> str:
    """The kind of a params-shaped optax state subtree at key path ``prefix``: its
    innermost named key (``mu``, ``nu``, ``trace``), numbered if already in ``used``
    (which it joins). The in-memory runtime's checkpoints name kinds the same way."""
    names = [str(getattr(p, "name", getattr(p, "key", ""))) for p in prefix]
    base = next((n for n in reversed(names) if n), "state")
    kind, k = base, 1
    while kind in used:
        k += 1
        kind = f"{base}{k}"
    used.add(kind)
    return kind


def optax_tree_slots(opt_shapes: Any, params: Any) -> list[str | None]:
    """Classifies an optax state over a whole params tree, run by run of leaves: a
    kind name for each params-shaped subtree (``mu``, ``nu``...; named as
    :func:`state_kind_name`, so both runtimes agree) and None for
    each scalar leaf."""
    param_leaves = jax.tree_util.tree_leaves_with_path(params)
    n = len(param_leaves)
    depth0 = len(param_leaves[0][0])
    leaves = jax.tree_util.tree_leaves_with_path(opt_shapes)
    slots: list[str | None] = []
    used = {MASTER}
    i = 0
    while i < len(leaves):
        path, leaf = leaves[i]
        if leaf.shape == ():
            slots.append(None)
            i += 1
            continue
        run = [a.shape for _, a in leaves[i : i + n]]
        if run != [a.shape for _, a in param_leaves]:
            raise NotImplementedError(f"optax state leaf {jax.tree_util.keystr(path)}")
        slots.append(state_kind_name(path[: len(path) - depth0], used))
        i += n
    return slots
