"""GPT-2 / GPT-3 in Flax, exposed as stages the runtime can run one at a time.

Architecture: learned token and position embeddings, N pre-LayerNorm blocks (causal
multi-head attention with a fused QKV projection, ``models/attention.py``; tanh-GELU
MLP), a final LayerNorm and an output projection tied to the token embedding. Parameter
names follow the HF GPT-2 layout (``c_attn``, ``c_proj``, ``c_fc``, ``ln_1``...) so
checkpoints map one-to-one.

Stages (see :class:`models.staged.StagedModel`):
  ``embed``  params {wte (V, D), wpe (S, D)}          tokens (B, T) -> x (B, T, D)
  ``blocks`` params of one block, stacked on a leading layer axis L; x -> x
  ``head``   params {ln_f}; with embed's wte (tied)    x, targets -> mean token loss

Parameters are stored in ``param_dtype`` (fp32 master); every stage computes with its
params cast to ``compute_dtype`` (LayerNorm scales and biases too: the streaming runtime
holds them so), matmuls run in ``compute_dtype``; LayerNorm statistics, softmax and the
loss are computed in fp32, and so are attention's scores and softmax.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig
from models.attention import attention, cached_attention
from models.staged import AxisTable, FlaxStages, segment_ids

# Each param's logical axes (models/staged.py's logical_axes), by its path in its stage.
LOGICAL_AXES: AxisTable = (
    ("wte", ("vocab", "embed")),
    ("wpe", ("position", "embed")),
    ("c_attn/kernel", ("embed", "qkv")),  # q | k | v: not head-major across the three
    ("c_attn/bias", ("qkv",)),
    ("c_proj/kernel", ("heads", "embed")),  # (H K, D)
    ("c_fc/kernel", ("embed", "mlp")),
    ("c_fc/bias", ("mlp",)),
    ("c_proj_mlp/kernel", ("mlp", "embed")),
    ("(c_proj|c_proj_mlp)/bias", ("embed",)),
    ("(ln_1|ln_2|ln_f)/(scale|bias)", ("embed",)),
)


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None, cache=None):
        # (B, T, D) -> (B, T, D); positions (B, T): a packed row's (models/staged.py);
        # cache: generation's (models.attention.cached_attention), then -> (x, (k, v))
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
        kv = None
        if cache is not None:
            attn, kv = cached_attention(q[:, :, :, None], k, v, cache)
        else:
            segments = None if positions is None else segment_ids(positions)
            # (B, T, D), one query head per key/value head
            attn = attention(q[:, :, :, None], k, v, cfg, segments)
        x = x + dense(D, "c_proj", proj_init)(attn)

        h = norm("ln_2")(x)
        h = nn.gelu(dense(cfg.ff_dim, "c_fc")(h), approximate=True)  # (B, T, F)
        x = x + dense(D, "c_proj_mlp", proj_init)(h)
        return x if cache is None else (x, kv)


class Embed(nn.Module):
    """Token + learned position embedding: (B, T) int -> (B, T, D); ``positions`` (B, T)
    int: each token's (a packed row's restart at every record), else 0 .. T-1."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(cfg.init_std)
        wte = self.param("wte", init, (cfg.vocab_size, cfg.d_model), cfg.param_dtype)
        wpe = self.param("wpe", init, (cfg.max_seq_len, cfg.d_model), cfg.param_dtype)
        T = tokens.shape[1]
        pos = wpe[:T][None] if positions is None else jnp.take(wpe, positions, axis=0)
        x = jnp.take(wte, tokens, axis=0) + pos
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


class GPT(FlaxStages):
    """A GPT model as three stages, the head tied to the token embedding ``wte``. All
    methods are pure functions of their params (see :class:`models.staged.FlaxStages`)."""

    logical_axes_table = LOGICAL_AXES

    def __init__(self, config: ModelConfig):
        super().__init__(config, Embed(config), Block(config), Head(config), tied="wte")

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token (PaLM appendix B): 6 N for the
        matmul parameters (position embedding excluded) plus 12 L T D for attention."""
        cfg = self.config
        n = self.param_count() - cfg.max_seq_len * cfg.d_model
        return 6.0 * n + 12.0 * cfg.num_layers * seq_len * cfg.d_model
