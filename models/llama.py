"""Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) in Flax, as stages.

Architecture: a token embedding with no position embedding, N pre-RMSNorm blocks
(causal grouped-query attention with rotary position embeddings on queries and keys,
SwiGLU MLP), a final RMSNorm and an output projection, untied by default
(``model.tie_embeddings``). No biases, unless ``model.qkv_bias`` (Qwen2/Qwen2.5: biases
on the query, key and value projections); ``model.qk_norm`` (Qwen3) adds an RMSNorm of
each query and key head (``q_norm``, ``k_norm``, (K,) shared by the heads) before the
rotary embedding. Rotary embeddings use the
``rotate_half`` convention of HF's ``modeling_llama`` (the first and second halves of a
head's features form the pairs), so HF checkpoints load without permuting q/k rows.

Parameter names follow HF's Llama (``model.layers.{i}.self_attn.q_proj.weight`` is block
``q_proj/kernel``, transposed to (in, out)); ``hetjax/hf.py`` holds the mapping.

Stages (see :class:`models.staged.StagedModel`):
  ``embed``  {embed_tokens (V, D)}                               tokens (B, T) -> (B, T, D)
  ``blocks`` {input_layernorm, q_proj, k_proj, v_proj, o_proj,
              post_attention_layernorm, gate_proj, up_proj, down_proj}, stacked on L
             (q/k/v_proj with a ``bias`` under qkv_bias; q_norm, k_norm under qk_norm)
  ``head``   {norm, lm_head (D, V)} (no lm_head when tied to embed_tokens)

With ``model.num_experts`` E > 0 the MLP is Mixtral's mixture of experts
(:class:`MixtureOfExperts`): the block's gate/up/down_proj are replaced by
``moe/{router (D, E), gate_proj (E, D, F), up_proj (E, D, F), down_proj (E, F, D)}``,
and, with ``model.router_aux_loss_coef`` > 0, the block also returns its router
statistics, from which the model's load-balancing loss is computed
(:meth:`Llama.aux_loss`, the staged interface's auxiliary loss). Built with an
``expert_axis`` (a mesh axis name: ``Llama(config, expert_axis=...)``, run inside a
``shard_map`` over that axis), a block holds only its device's share of the experts
and sends each token to the device of its experts and back (expert parallelism,
``distributed.expert_parallel``; :func:`exchange_with_experts`).

Shape letters: B batch, T/S query/key positions, D model width, N key/value heads,
G query heads per key/value head (H = N G), K head width, F MLP width, V vocabulary,
E experts, X devices the experts are split over.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig
from models.attention import attention, cached_attention
from models.staged import AxisTable, FlaxStages, segment_ids


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


def rotary_at(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles at given positions (B, T) int -> each (B, T, K)
    fp32 (a packed row's positions restart at every record)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, K/2)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates feature pairs (j, j + K/2) of x (..., K); cos, sin broadcast to x."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


class LlamaBlock(nn.Module):
    """x + attn(rms(x)); x + down(silu(gate(rms(x))) * up(rms(x))). ``expert_axis``:
    see :class:`MixtureOfExperts`."""

    config: ModelConfig
    expert_axis: str | None = None
    # Expert-aware streaming (:class:`MixtureOfExperts`'s ``held``; ``part``: "all";
    # "attention", which returns the residual stream after attention and the routing
    # decision; "mlp", which takes that residual stream and runs the rest).
    held: int | None = None
    part: str = "all"

    @nn.compact
    def __call__(self, x: jax.Array, routing=None, positions: jax.Array | None = None, cache=None):
        # (B, T, D) -> (B, T, D); positions (B, T): a packed row's (models/staged.py);
        # cache: generation's (models.attention.cached_attention), then -> (x, (k, v))
        # without the router statistics
        if cache is not None:
            out, kv = self._call(x, routing, positions, cache)
            return (out[0] if isinstance(out, tuple) else out), kv
        return self._call(x, routing, positions)[0]

    def _call(self, x, routing, positions, cache=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        dense = lambda features, name, bias=False: nn.Dense(
            features,
            use_bias=bias,
            dtype=dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nn.initializers.normal(cfg.init_std),
            name=name,
        )
        norm = lambda name: nn.RMSNorm(
            epsilon=cfg.layer_norm_eps, dtype=dtype, param_dtype=cfg.param_dtype, name=name
        )
        kv = None
        if self.part != "mlp":
            x, kv = self._attention(x, dense, norm, positions, cache)
        h = norm("post_attention_layernorm")(x)
        if self.part == "attention":  # the routing decision, made once (MixtureOfExperts)
            return (x, MixtureOfExperts(cfg, route_only=True, name="moe")(h)), kv
        if cfg.num_experts:
            moe = MixtureOfExperts(cfg, self.expert_axis, self.held, name="moe")
            out, stats = moe(h, routing)
            return ((x + out, stats) if router_stats_size(cfg) else x + out), kv
        h = nn.silu(dense(cfg.ff_dim, "gate_proj")(h)) * dense(cfg.ff_dim, "up_proj")(h)
        return x + dense(x.shape[-1], "down_proj")(h), kv  # h (B, T, F)

    def _attention(self, x: jax.Array, dense, norm, positions=None, cache=None):
        """x + attn(rms(x)); ``positions`` (B, T) or None (0 .. T-1 in every row).
        -> (x, the updated (k, v) cache, or None without ``cache``)."""
        cfg = self.config
        B, T, D = x.shape
        N, K = cfg.kv_heads, cfg.head_dim
        G = cfg.num_heads // N
        h = norm("input_layernorm")(x)
        # Query head n * G + g uses key/value head n (HF's repeat_kv order).
        bias = cfg.qkv_bias
        q = dense(N * G * K, "q_proj", bias)(h).reshape(B, T, N, G, K)
        k = dense(N * K, "k_proj", bias)(h).reshape(B, T, N, K)
        v = dense(N * K, "v_proj", bias)(h).reshape(B, T, N, K)
        if cfg.qk_norm:  # over each head's K features (Qwen3), before the rotation
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        if positions is None:
            cos, sin = rotary_tables(T, rotary_frequencies(cfg))  # (T, K)
            segments = None
        else:
            cos, sin = rotary_at(positions, rotary_frequencies(cfg))  # (B, T, K)
            segments = segment_ids(positions)
        q = apply_rotary(q, cos[..., None, None, :], sin[..., None, None, :])
        k = apply_rotary(k, cos[..., None, :], sin[..., None, :])
        kv = None
        if cache is not None:
            attn, kv = cached_attention(q, k, v, cache)
        else:
            attn = attention(q, k, v, cfg, segments)  # (B, T, N G K), models/attention.py
        return x + dense(D, "o_proj")(attn), kv


def router_stats_size(config: ModelConfig) -> int:
    """Length of the router statistics a MoE block returns for the auxiliary loss: the
    fraction of tokens routed to each expert and its mean router probability (2 E), or 0
    (a dense block, or a MoE whose ``router_aux_loss_coef`` is 0: no statistics)."""
    return 2 * config.num_experts if config.num_experts and config.router_aux_loss_coef else 0


class MixtureOfExperts(nn.Module):
    """Mixtral's sparse MLP: a softmax router over E SwiGLU experts, each token sent to
    its top k, their outputs weighted by the top-k probabilities renormalised to sum 1.
    Dropless: the (token, expert) pairs are sorted by expert and each expert multiplies
    its own rows (``jax.lax.ragged_dot``), so no token is dropped and no expert computes
    a token it was not routed to.

    h (B, T, D) -> (out (B, T, D), stats (2 E,) fp32): ``stats`` holds, per expert, the
    fraction of top-k slots routed to it (summing to k over experts) and its mean router
    probability over the tokens, the two factors of the load-balancing loss.

    ``expert_axis``: the mesh axis (inside a ``shard_map``) the experts are split over.
    On device n of its X devices this module holds experts [n E/X, (n+1) E/X) (their
    params have E/X rows), routes its own tokens as above, and computes the pairs on the
    experts' devices (:func:`exchange_with_experts`): the same function of the tokens,
    the router and every expert's params.

    Expert-aware streaming (``offload.expert_fetch=routed``) splits the decision from
    the experts: with ``route_only`` the module returns the routing, ``(top_e (M, k)
    int32, pairs per expert (E,) int32)``, from the router alone; called with
    ``routing=(top_e, slots)`` it uses that decision instead of making one, and holds
    only ``held`` experts (the ones that got pairs, in increasing order: ``slots`` (E,)
    maps an expert to its row among them). The top-k probabilities are then gathered at
    ``top_e``: the values ``top_k`` returns, and the gradient it passes back."""

    config: ModelConfig
    expert_axis: str | None = None
    held: int | None = None
    route_only: bool = False

    @nn.compact
    def __call__(self, h: jax.Array, routing=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        init = nn.initializers.normal(cfg.init_std)
        B, T, D = h.shape
        E, k, F = cfg.num_experts, cfg.experts_per_token, cfg.ff_dim
        router = self.param("router", init, (D, E), cfg.param_dtype)
        tokens = h.reshape(B * T, D)  # (M, D), M = B T
        logits = jnp.einsum("MD,DE->ME", tokens, router.astype(dtype)).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)  # (M, E)
        if routing is None:
            top_p, top_e = jax.lax.top_k(probs, k)  # (M, k)
        else:
            top_e = routing[0]
            top_p = jnp.take_along_axis(probs, top_e, axis=-1)
        expert = top_e.reshape(-1)  # (M k,) the expert of each (token, slot) pair
        if self.route_only:
            return top_e, jnp.bincount(expert, length=E).astype(jnp.int32)
        weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)

        local = E // (jax.lax.axis_size(self.expert_axis) if self.expert_axis else 1)
        group = expert  # the row among the held experts of each pair's expert
        if self.held is not None:
            assert self.expert_axis is None and routing is not None
            local, group = self.held, routing[1][expert]
        gate = self.param("gate_proj", init, (local, D, F), cfg.param_dtype).astype(dtype)
        up = self.param("up_proj", init, (local, D, F), cfg.param_dtype).astype(dtype)
        down = self.param("down_proj", init, (local, F, D), cfg.param_dtype).astype(dtype)

        def experts(rows, sizes):  # rows (R, D) grouped by expert, sizes (local,) -> (R, D)
            act = nn.silu(jax.lax.ragged_dot(rows, gate, sizes))
            return jax.lax.ragged_dot(act * jax.lax.ragged_dot(rows, up, sizes), down, sizes)

        order = jnp.argsort(expert, stable=True)  # pairs grouped by expert
        token = order // k  # (M k,) the token of each sorted pair
        # (E,) pairs per expert (held: per held expert, in the same order)
        sizes = jnp.bincount(group, length=E if self.held is None else local).astype(jnp.int32)
        rows = tokens[token]  # (M k, D)
        if self.expert_axis is None:
            y = experts(rows, sizes)  # (M k, D)
        else:
            y = exchange_with_experts(rows, sizes, experts, self.expert_axis)
        y = y * weights.reshape(-1)[order][:, None].astype(dtype)
        out = jnp.zeros((B * T, D), dtype).at[token].add(y).reshape(B, T, D)

        routed = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, E, dtype=jnp.float32), axis=1), axis=0)
        stats = jnp.concatenate([routed, jnp.mean(probs, axis=0)])  # (2 E,)
        return out, stats


def exchange_with_experts(rows: jax.Array, sizes: jax.Array, experts, axis: str) -> jax.Array:
    """Expert parallelism's dispatch and return, inside a ``shard_map`` over ``axis``
    (X devices, device n holding experts [n E/X, (n+1) E/X)): this device's (token,
    expert) rows (R, D), grouped by expert, ``sizes`` (E,) rows per expert, go to their
    experts' devices (an all-to-all), each device runs ``experts(rows, local sizes)``
    on the rows it received (grouped by its local expert) and the results come back
    (a second all-to-all): (R, D), in the order of ``rows``.

    Dropless at a fixed capacity: a device may send all its R rows to one device, so
    each of the X slots of the send buffer holds R rows, and each device receives X R
    rows, most of them empty (the CPU backend has no ragged all-to-all). That is X x
    the rows of one device's own routing in each buffer and each exchange; empty rows
    cost no expert FLOPs where ``ragged_dot`` skips rows past its groups (on the CPU
    it multiplies every row by every group, masked)."""
    X = jax.lax.axis_size(axis)
    R, D = rows.shape
    local = sizes.shape[0] // X  # experts per device
    expert = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=R)  # (R,)
    device = expert // local  # where each row goes
    per_device = jnp.sum(sizes.reshape(X, local), axis=1)  # (X,)
    slot = jnp.arange(R) - (jnp.cumsum(per_device) - per_device)[device]  # its place there
    send = jnp.zeros((X, R, D), rows.dtype).at[device, slot].set(rows)
    # each slot's expert on the device it goes to; ``local`` marks an empty slot
    ids = jnp.full((X, R), local, jnp.int32).at[device, slot].set(expert % local)
    received = jax.lax.all_to_all(send, axis, 0, 0).reshape(X * R, D)  # [source, slot]
    received_ids = jax.lax.all_to_all(ids, axis, 0, 0).reshape(X * R)
    order = jnp.argsort(received_ids, stable=True)  # by local expert, empty slots last
    local_sizes = jnp.bincount(received_ids, length=local + 1)[:local].astype(jnp.int32)
    y = jnp.zeros_like(received).at[order].set(experts(received[order], local_sizes))
    back = jax.lax.all_to_all(y.reshape(X, R, D), axis, 0, 0)  # [destination, slot]
    return back[device, slot]


class LlamaEmbed(nn.Module):
    """Token embedding: (B, T) int -> (B, T, D). Positions enter in attention (rotary)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        cfg = self.config  # positions: rotary, in the blocks
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


# Each param's logical axes (models/staged.py's logical_axes), by its path in its stage.
LOGICAL_AXES: AxisTable = (
    ("embed_tokens", ("vocab", "embed")),
    ("q_proj/kernel", ("embed", "heads")),  # (D, N G K)
    ("(k_proj|v_proj)/kernel", ("embed", "kv_heads")),  # (D, N K)
    ("q_proj/bias", ("heads",)),  # qkv_bias: split with its kernel's columns
    ("(k_proj|v_proj)/bias", ("kv_heads",)),
    ("(q_norm|k_norm)/scale", ("head_dim",)),  # qk_norm: (K,), one for every head
    ("o_proj/kernel", ("heads", "embed")),
    ("(gate_proj|up_proj)/kernel", ("embed", "mlp")),
    ("down_proj/kernel", ("mlp", "embed")),
    ("moe/router", ("embed", "router")),  # (D, E): every device scores every expert
    ("moe/(gate_proj|up_proj)", ("expert", "embed", "mlp")),  # (E, D, F)
    ("moe/down_proj", ("expert", "mlp", "embed")),
    ("(input_layernorm|post_attention_layernorm|norm)/scale", ("embed",)),
    ("lm_head/kernel", ("embed", "vocab")),
)


class Llama(FlaxStages):
    """A Llama model as three stages; the interface is :class:`models.staged.FlaxStages`'s.
    ``expert_axis``: a MoE model's blocks hold their device's share of the experts
    (:class:`MixtureOfExperts`); its stages are then run inside a ``shard_map`` over that
    axis, and the model is initialised without one (init sees every expert)."""

    logical_axes_table = LOGICAL_AXES

    def __init__(self, config: ModelConfig, expert_axis: str | None = None):
        super().__init__(
            config,
            embed=LlamaEmbed(config),
            block=LlamaBlock(config, expert_axis),
            head=LlamaHead(config),
            tied="embed_tokens" if config.tie_embeddings else None,
        )
        self.stats_size = router_stats_size(config)
        # expert-aware streaming (hetjax/runtime/experts/routed.py; with the experts split over
        # devices, hetjax/runtime/experts/routed_zero.py: a device holds its group's whole)
        self.expert_routing = bool(config.num_experts)
        self.expert_params = EXPERT_PARAMS

    def route(self, g: int, block_params: dict, x: jax.Array, context=()):
        """Expert-aware streaming's first half of a MoE block (of the one group, ``g`` 0;
        no context): x (B, T, D) -> (the residual stream after attention (B, T, D), the
        routing decision (top_e (B T, k) int32), pairs per expert (E,) int32). Reads no
        expert weight."""
        block = self._block.clone(part="attention")
        x, (top_e, counts) = block.apply({"params": block_params}, x, **self._positions(context))
        return x, top_e, counts

    def routed_block(self, g: int, block_params: dict, x, routing, context=(), part="all"):
        """A MoE block that takes its routing decision ``(top_e, slots)`` and holds only
        the routed experts (``block_params``' expert leaves have one row each, in
        increasing expert order; ``slots`` (E,) maps an expert to its row): equal to
        the whole block for tokens routed so. ``part="mlp"``: x is :meth:`route`'s
        residual stream and only the rest of the block runs. With an ``expert_axis``
        the leaves hold the device's whole group of experts (the unrouted ones' rows
        zero) and ``slots`` is not read. -> (y, statistics)."""
        held = None if self._block.expert_axis else block_params["moe"]["gate_proj"].shape[0]
        block = self._block.clone(part=part, held=held)
        out = block.apply({"params": block_params}, x, routing, **self._positions(context))
        return out if self.stats_size else (out, jnp.zeros((0,), jnp.float32))

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        """``router_aux_loss_coef`` x the load-balancing loss of transformers' Mixtral
        (``load_balancing_loss_func``): E sum_e f_e P_e, with f_e the fraction of top-k
        slots routed to expert e and P_e its mean router probability, both pooled over
        every layer's tokens. ``stats`` (2 E,) is the sum over layers of the blocks'
        router statistics; fp32 scalar (0 without statistics)."""
        if not self.stats_size:
            return jnp.float32(0)
        return self.config.router_aux_loss_coef * router_balance_loss(stats, self.config)

    def block_active_params(self) -> int:
        """Params of one block a token's forward uses: all but the experts it is not
        routed to (E - k of them)."""
        cfg = self.config
        unused = (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.ff_dim
        return super().block_active_params() - (unused if cfg.num_experts else 0)


def router_balance_loss(stats: jax.Array, config: ModelConfig) -> jax.Array:
    """The unweighted load-balancing loss (transformers' ``outputs.aux_loss``) from the
    sum over layers of the blocks' router statistics (2 E,)."""
    E, L = config.num_experts, config.num_layers
    routed, prob = stats[:E] / L, stats[E:] / L
    return E * jnp.sum(routed * prob)


EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")  # a MoE block's, under "moe": (E, ...)
