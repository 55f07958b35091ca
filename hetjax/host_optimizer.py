"""The host optimizer: fp32 master slabs and optax state per stage, updated off-device.

Each stage's master params live as one slab (see ``pages.py``) in the placement's
optimizer memory (host RAM). ``update`` runs the configured optax optimizer jitted on
that memory over ``(decayed, not decayed)`` halves of the slab, so the weight-decay mask
is a split point, and returns the refreshed compute-dtype params, as pages, for the next forward.

Global-norm clipping needs the norm of all gradients before any stage is updated; the
caller computes it (over every stage's gradient) and passes it to each update, which
applies optax's own formula ``g / norm * max_norm`` when ``norm >= max_norm``. Results
therefore equal ``optax.chain(clip_by_global_norm, base)`` over the whole pytree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import OptimizerConfig
from hetjax.optim import base_optimizer
from hetjax.pages import SlabLayout


class HostOptimizer:
    """Master params and optimizer state of every stage, on the host."""

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        layouts: dict[str, SlabLayout],
        sharding: jax.sharding.Sharding,
        compute_dtype: Any,
    ):
        self.cfg = cfg
        self.layouts = layouts  # stage name -> layout
        self.sharding = sharding
        # Where the update computes: the optimizer device's own memory. Its operands live
        # in ``sharding`` (pinned_host on a CPU-only machine); XLA's CPU backend cannot
        # mix host-kind operands with the constants optax creates, so each jitted
        # function moves its inputs here first and writes its outputs back to host.
        self._compute = jax.sharding.SingleDeviceSharding(
            next(iter(sharding.device_set)), memory_kind="device"
        )
        self.compute_dtype = jnp.dtype(compute_dtype)
        # Each slab is a pair (decayed part, the rest): the mask is a pytree of two bools.
        self.tx = base_optimizer(cfg, total_steps, mask=(True, False))
        self.master: dict[str, jax.Array] = {}
        self.state: dict[str, Any] = {}
        self._init = jax.jit(self._init_state, static_argnums=1, out_shardings=sharding)
        self._cast = jax.jit(
            lambda m, layout_name: self.layouts[layout_name].to_pages(
                jax.device_put(m, self._compute).astype(self.compute_dtype)
            ),
            static_argnums=1,
            out_shardings=sharding,
        )
        self._update = jax.jit(
            self._update_slab,
            static_argnums=(4,),
            donate_argnums=(0, 1),
            out_shardings=sharding,
        )

    def set_master(self, name: str, layout_name: str, slab: jax.Array | np.ndarray) -> None:
        """Installs stage ``name``'s fp32 master slab (laid out by ``layout_name``)."""
        master = jax.device_put(slab, self.sharding)
        self.master[name] = master
        self.state[name] = self._init(master, self.layouts[layout_name].num_decay)

    def _init_state(self, master: jax.Array, num_decay: int):
        master = jax.device_put(master, self._compute)
        return self.tx.init((master[:num_decay], master[num_decay:]))

    def _update_slab(self, master, state, grad, clip, layout_name: str):
        num_decay = self.layouts[layout_name].num_decay
        master, state, grad, clip = jax.device_put((master, state, grad, clip), self._compute)
        # clip = (global_norm, max_norm); max_norm 0 disables clipping.
        norm, max_norm = clip
        clipped = jnp.where((max_norm == 0) | (norm < max_norm), grad, grad / norm * max_norm)
        params = (master[:num_decay], master[num_decay:])
        grads = (clipped[:num_decay], clipped[num_decay:])
        updates, state = self.tx.update(grads, state, params)
        new = jnp.concatenate([p + u for p, u in zip(params, updates, strict=True)])
        return new, state, self.layouts[layout_name].to_pages(new.astype(self.compute_dtype))

    def update(
        self, name: str, layout_name: str, grad: np.ndarray, global_norm: float
    ) -> list[jax.Array]:
        """Applies one optimizer step to stage ``name``; returns its new compute-dtype
        params as the slab's pages (in the optimizer's memory). ``grad`` is the averaged
        fp32 gradient slab."""
        grad = jax.device_put(np.asarray(grad, np.float32), self.sharding)
        clip = (jnp.float32(global_norm), jnp.float32(self.cfg.grad_clip))
        clip = jax.device_put(clip, self.sharding)
        self.master[name], self.state[name], compute = self._update(
            self.master[name], self.state[name], grad, clip, layout_name
        )
        return compute

    def compute_pages(self, name: str, layout_name: str) -> list[jax.Array]:
        """Stage ``name``'s master slab cast to the compute dtype, as pages, on the host."""
        return self._cast(self.master[name], layout_name)

    def nbytes(self) -> int:
        leaves = jax.tree.leaves((self.master, self.state))
        return sum(a.nbytes for a in leaves)
