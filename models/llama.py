"""Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) in Flax, as stages.

Architecture: a token embedding with no position embedding, N pre-RMSNorm blocks
(causal grouped-query attention with rotary position embeddings on queries and keys,
SwiGLU MLP), a final RMSNorm and an output projection, untied by default
(``model.tie_embeddings``). No biases anywhere. Rotary embeddings use the
``rotate_half`` convention of HF's ``modeling_llama`` (the first and second halves of a
head's features form the pairs), so HF checkpoints load without permuting q/k rows.

Parameter names follow HF's Llama (``model.layers.{i}.self_attn.q_proj.weight`` is block
``q_proj/kernel``, transposed to (in, out)); ``hetjax/hf.py`` holds the mapping.

Stages (see :class:`models.staged.StagedModel`):
  ``embed``  {embed_tokens (V, D)}                               tokens (B, T) -> (B, T, D)
  ``blocks`` {input_layernorm, q_proj, k_proj, v_proj, o_proj,
              post_attention_layernorm, gate_proj, up_proj, down_proj}, stacked on L
  ``head``   {norm, lm_head (D, V)} (no lm_head when tied to embed_tokens)

Shape letters: B batch, T/S query/key positions, D model width, N key/value heads,
G query heads per key/value head (H = N G), K head width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig
from models.attention import attention
from models.staged import FlaxStages


def rotary_frequencies(config: ModelConfig) -> jax.Array:
    """Angle per position of each feature pair, (K/2,) fp32: ``theta ** (-2 j / K)``,
    rescaled as Llama 3.1 does when ``model.rope_scaling_factor`` is set (HF's
    ``_compute_llama3_parameters``)."""
    K = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
    factor = config.rope_scaling_factor
    if not factor:
        return inv_freq
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old_len = config.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def rotary_tables(seq_len: int, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, each (T, K) fp32: position t, feature j is
    rotated by ``t * inv_freq[j mod K/2]``."""
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None]  # (T, K/2)
    angles = jnp.concatenate([angles, angles], axis=-1)  # (T, K)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates feature pairs (j, j + K/2) of x (..., K); cos, sin broadcast to x."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


class LlamaBlock(nn.Module):
    """x + attn(rms(x)); x + down(silu(gate(rms(x))) * up(rms(x)))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, D)
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        dense = lambda features, name: nn.Dense(
            features,
            use_bias=False,
            dtype=dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(cfg.init_std),
            name=name,
        )
        norm = lambda name: nn.RMSNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=cfg.param_dtype, name=name
        )
        B, T, D = x.shape
        N, K = cfg.kv_heads, cfg.head_dim
        G = cfg.num_heads // N

        h = norm("input_layernorm")(x)
        # Query head n * G + g uses key/value head n (HF's repeat_kv order).
        q = dense(N * G * K, "q_proj")(h).reshape(B, T, N, G, K)
        k = dense(N * K, "k_proj")(h).reshape(B, T, N, K)
        v = dense(N * K, "v_proj")(h).reshape(B, T, N, K)
        cos, sin = rotary_tables(T, rotary_frequencies(cfg))  # (T, K)
        q = apply_rotary(q, cos[:, None, None], sin[:, None, None])
        k = apply_rotary(k, cos[:, None], sin[:, None])
        attn = attention(q, k, v, cfg)  # (B, T, N G K), models/attention.py
        x = x + dense(D, "o_proj")(attn)

        h = norm("post_attention_layernorm")(x)
        h = nn.silu(dense(cfg.ff_dim, "gate_proj")(h)) * dense(cfg.ff_dim, "up_proj")(h)
        return x + dense(D, "down_proj")(h)  # h (B, T, F)


class LlamaEmbed(nn.Module):
    """Token embedding: (B, T) int -> (B, T, D). Positions enter in attention (rotary)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(cfg.init_std)
        table = self.param("embed_tokens", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)
        return jnp.take(table, tokens, axis=0).astype(cfg.compute_dtype)


class LlamaHead(nn.Module):
    """Final RMSNorm and the output projection: (B, T, D) -> logits (B, T, V). With
    ``embedding`` (V, D) given, the projection is tied to it and has no params here."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, embedding: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        x = nn.RMSNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=cfg.param_dtype, name="norm"
        )(x)
        if embedding is not None:
            return jnp.einsum("BTD,VD->BTV", x, embedding.astype(dtype))
        return nn.Dense(
            cfg.vocab_size,
            use_bias=False,
            dtype=dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(cfg.init_std),
            name="lm_head",
        )(x)


class Llama(FlaxStages):
    """A Llama model as three stages; the interface is :class:`models.staged.FlaxStages`'s."""

    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            embed=LlamaEmbed(config),
            block=LlamaBlock(config),
            head=LlamaHead(config),
            tied="embed_tokens" if config.tie_embeddings else None,
        )
