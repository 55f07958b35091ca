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


def weight_decay_mask(params: Any) -> Any:
    """True for weight matrices (kernels, embeddings), False for biases and norm scales.
    Decided by leaf name, since stacked block params give every leaf a layer axis."""

    def is_matrix(path, leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name not in ("bias", "scale")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


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
    """Global-norm clipping (if ``grad_clip > 0``) followed by the base optimizer."""
    tx = base_optimizer(cfg, total_steps, weight_decay_mask(params))
    if cfg.grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return tx
