"""A user-defined model, as a user would write one: plain Flax modules handed to
``models.staged.FlaxStages``. Run it with ``model.family="custom"`` and
``model.custom="user_blocks:make_model"`` (this directory on the Python path).

The block is a parallel transformer block (GPT-J, PaLM): attention and MLP both read
one RMSNorm of the input and add to the residual together; no biases. Learned position
embeddings; an untied output layer.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig
from models.staged import FlaxStages


class ParallelBlock(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        cfg = self.config
        B, T, D = x.shape
        H, K = cfg.num_heads, cfg.head_dim
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=cfg.compute_dtype, name=name)
        h = nn.RMSNorm(dtype=cfg.compute_dtype, name="norm")(x)
        q, k, v = (dense(D, n)(h).reshape(B, T, H, K) for n in ("q", "k", "v"))
        scores = jnp.einsum("BTHK,BSHK->BHTS", q, k).astype(jnp.float32) / math.sqrt(K)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e30)
        attn = jnp.einsum("BHTS,BSHK->BTHK", jax.nn.softmax(scores), v).reshape(B, T, D)
        mlp = dense(D, "mlp_out")(nn.gelu(dense(cfg.ff_dim, "mlp_in")(h)))  # (B, T, F) -> D
        return x + dense(D, "attn_out")(attn) + mlp


class Embed(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens):  # (B, T) -> (B, T, D)
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.d_model, name="tokens")(tokens)
        pos = self.param("positions", nn.initializers.normal(0.02), (cfg.max_seq_len, cfg.d_model))
        return (x + pos[: tokens.shape[1]]).astype(cfg.compute_dtype)


class Head(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # (B, T, D) -> logits (B, T, V)
        x = nn.RMSNorm(name="norm")(x)
        return nn.Dense(self.config.vocab_size, use_bias=False, name="out")(x)


def make_model(config: ModelConfig) -> FlaxStages:
    return FlaxStages(config, embed=Embed(config), block=ParallelBlock(config), head=Head(config))
