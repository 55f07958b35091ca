"""GPT-2 / GPT-3 in Flax, exposed as stages the runtime can run one at a time.

Architecture: learned token and position embeddings, N pre-LayerNorm blocks (causal
multi-head attention with a fused QKV projection, tanh-GELU MLP), a final LayerNorm and
an output projection tied to the token embedding. Parameter names follow the HF GPT-2
layout (``c_attn``, ``c_proj``, ``c_fc``, ``ln_1``...) so checkpoints map one-to-one.

Stages (see :class:`models.staged.StagedModel`):
  ``embed``  params {wte (V, D), wpe (S, D)}          tokens (B, T) -> x (B, T, D)
  ``blocks`` params of one block, stacked on a leading layer axis L; x -> x
  ``head``   params {ln_f}; with embed's wte (tied)    x, targets -> mean token loss

Parameters are stored in ``param_dtype`` (fp32 master); matmuls run in
``compute_dtype``; LayerNorm statistics, softmax and the loss are computed in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig

Params = dict[str, Any]


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, D)
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        init = nn.initializers.normal(cfg.init_std)
        # GPT-2: residual projections scaled by 1/sqrt(2 * num_layers).
        proj_init = nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        dense = lambda features, name, kinit=init: nn.Dense(
            features, dtype=dtype, param_dtype=cfg.param_dtype, kernel_init=kinit, name=name
        )
        norm = lambda name: nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=cfg.param_dtype, name=name
        )
        B, T, D = x.shape
        H, K = cfg.num_heads, cfg.head_dim

        h = norm("ln_1")(x)
        qkv = dense(3 * D, "c_attn")(h)  # (B, T, 3D): q | k | v, heads contiguous
        q, k, v = (a.reshape(B, T, H, K) for a in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("BTHK,BSHK->BHTS", q, k).astype(jnp.float32) / math.sqrt(K)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        attn = jnp.einsum("BHTS,BSHK->BTHK", probs, v).reshape(B, T, D)
        x = x + dense(D, "c_proj", proj_init)(attn)

        h = norm("ln_2")(x)
        h = nn.gelu(dense(cfg.ff_dim, "c_fc")(h), approximate=True)  # (B, T, F)
        x = x + dense(D, "c_proj_mlp", proj_init)(h)
        return x


class Embed(nn.Module):
    """Token + learned position embedding: (B, T) int -> (B, T, D)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(cfg.init_std)
        wte = self.param("wte", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)
        wpe = self.param("wpe", init, (cfg.max_seq_len, cfg.d_model), cfg.param_dtype)
        T = tokens.shape[1]
        x = jnp.take(wte, tokens, axis=0) + wpe[:T][None]
        return x.astype(cfg.compute_dtype)


class Head(nn.Module):
    """Final LayerNorm and the tied output projection: (B, T, D) -> logits (B, T, V)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, wte: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        x = nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=cfg.param_dtype, name="ln_f"
        )(x)
        logits = jnp.einsum("BTD,VD->BTV", x, wte.astype(dtype))
        return logits.astype(jnp.float32)


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over all tokens: logits (B, T, V) fp32, targets (B, T) int."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


class GPT:
    """A GPT model as three stages. All methods are pure functions of their params."""

    stage_names = ("embed", "blocks", "head")

    def __init__(self, config: ModelConfig):
        self.config = config
        self._embed = Embed(config)
        self._block = Block(config)
        self._head = Head(config)

    # -- init -----------------------------------------------------------------------------

    def init(self, rng: jax.Array) -> Params:
        """Returns ``{'embed': ..., 'blocks': (stacked on axis 0, L), 'head': ...}``."""
        keys = self.stage_keys(rng)
        return {
            "embed": self.init_stage("embed", keys["embed"]),
            "blocks": jax.vmap(lambda k: self.init_stage("block", k))(keys["blocks"]),
            "head": self.init_stage("head", keys["head"]),
        }

    def stage_keys(self, rng: jax.Array) -> dict[str, jax.Array]:
        """The init key of each stage; ``blocks`` holds one key per layer."""
        k_embed, k_blocks, k_head = jax.random.split(rng, 3)
        blocks = jax.random.split(k_blocks, self.config.num_layers)
        return {"embed": k_embed, "blocks": blocks, "head": k_head}

    def init_stage(self, stage: str, key: jax.Array) -> Params:
        """Params of one stage (``embed``, ``block`` or ``head``), so a runtime can
        initialise a model a stage at a time, straight into its placement."""
        cfg = self.config
        x = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
        if stage == "embed":
            return self._embed.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        if stage == "block":
            return self._block.init(key, x)["params"]
        if stage == "head":
            wte = jnp.zeros((cfg.vocab_size, cfg.d_model), cfg.param_dtype)
            return self._head.init(key, x, wte)["params"]
        raise ValueError(f"unknown stage {stage!r}")

    # -- stages ---------------------------------------------------------------------------

    def embed(self, embed_params: Params, tokens: jax.Array) -> jax.Array:
        """tokens (B, T) int32 -> activations (B, T, D) in compute dtype."""
        return self._embed.apply({"params": embed_params}, tokens)

    def block(self, block_params: Params, x: jax.Array) -> jax.Array:
        """One block with unstacked params: (B, T, D) -> (B, T, D)."""
        return self._block.apply({"params": block_params}, x)

    def head_loss(
        self, head_params: Params, embed_params: Params, x: jax.Array, targets: jax.Array
    ) -> jax.Array:
        """x (B, T, D), targets (B, T) -> mean token cross-entropy (fp32 scalar).
        Needs the embed stage's params because the output projection is tied to wte."""
        logits = self._head.apply({"params": head_params}, x, embed_params["wte"])
        return token_loss(logits, targets)

    # -- whole model (the in-memory reference) --------------------------------------------

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        x = self._run_blocks(params["blocks"], self.embed(params["embed"], tokens))
        return self._head.apply({"params": params["head"]}, x, params["embed"]["wte"])

    def loss(self, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        x = self._run_blocks(params["blocks"], self.embed(params["embed"], tokens))
        return self.head_loss(params["head"], params["embed"], x, targets)

    def _run_blocks(self, blocks: Params, x: jax.Array) -> jax.Array:
        # remat: keep only block-boundary activations and recompute each block's inside
        # in backward, as the streaming executor does.
        block = jax.checkpoint(self.block) if self.config.remat else self.block
        x, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, blocks)
        return x

    # -- accounting -----------------------------------------------------------------------

    def param_count(self) -> int:
        """Exact number of parameters, from shapes alone (no allocation)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token (PaLM appendix B): 6 N for the
        matmul parameters (position embedding excluded) plus 12 L T D for attention."""
        cfg = self.config
        n = self.param_count() - cfg.max_seq_len * cfg.d_model
        return 6.0 * n + 12.0 * cfg.num_layers * seq_len * cfg.d_model
