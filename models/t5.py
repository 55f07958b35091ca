"""T5 (Raffel et al. 2020; the v1.1 recipe) in Flax, as an encoder and a decoder stage group.

Architecture, as HF's ``T5ForConditionalGeneration``: a token embedding shared by both
stacks; pre-RMSNorm blocks (a norm that scales without subtracting the mean, no biases
anywhere); attention whose scores are not scaled by 1/sqrt(K) and get a learned
relative position bias: each stack has one table (buckets, H), indexed by the bucket of
``key position - query position`` (bidirectional buckets in the encoder, causal ones in
the decoder; :func:`relative_position_buckets`), and every block of the stack adds the
same bias (HF computes it in the stack's first block and passes it on); a feed-forward
layer that is T5 v1.1's gated GELU, ``wo(gelu_tanh(wi_0 h) * wi_1 h)``, or T5 v1.0's
``wo(relu(wi h))`` (``model.feed_forward_proj``). The encoder's output goes through its
final norm; every decoder block attends to it (cross-attention, no position bias) after
its causal self-attention. The decoder's final norm and an untied output projection
(tied with ``model.tie_embeddings``, as T5 v1.0, which then scales the decoder's output
by D^-0.5) make the logits. Init is HF's ``_init_weights`` (``model.init_std`` is not
used). Dropout is not implemented (hetjax trains without it).

The decoder's input is the targets shifted right behind ``model.decoder_start_token``
(teacher forcing; HF's ``_shift_right`` of its labels), so the model's ``loss(params,
tokens, targets)`` takes what ``data.objective=prefix_lm`` cuts from a window: the
encoder's tokens and the decoder's targets (``hetjax/data.py``).

Stages (see :class:`models.staged.StagedModel`):
  ``embed``    {shared (V, D), encoder_relative_attention_bias (NB, H),
               decoder_relative_attention_bias (NB, H), encoder_final_layer_norm}: what
               both stacks read. The encoder's input is the embedded tokens, its context
               its bias table; the decoder's input the embedded shifted targets, its
               context the encoder's output after its final norm (B, T, D) and the
               decoder's bias table
  ``encoder``  {self_attention_layer_norm, SelfAttention/{q,k,v,o}, ff_layer_norm,
               DenseReluDense/{wi_0,wi_1,wo} (or wi,wo)}, stacked on L
  ``decoder``  the encoder block's and {cross_attention_layer_norm,
               EncDecAttention/{q,k,v,o}}, stacked on L_dec (``model.num_decoder_layers``)
  ``head``     {final_layer_norm, lm_head (D, V)} (no lm_head when tied to shared)

Parameter names follow HF's (``encoder.block.{i}.layer.0.SelfAttention.q.weight`` is
encoder block ``SelfAttention/q/kernel``, transposed to (in, out)).

Shape letters: B batch, T query positions, S key positions, D model width, H heads, K
head width (D / H), F feed-forward width, V vocabulary, NB position buckets.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import ModelConfig
from models.attention import biased_attention
from models.staged import AxisTable, Params, StageGroup, Stages, segment_ids

F32 = jnp.float32
EXPERT_PARAMS = ("wi_0", "wi_1", "wi", "wo")  # a Switch layer's, under "moe": (E, ...)


def relative_position_buckets(
    query_len: int, key_len: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """The bucket of each (query, key) pair's relative position ``key - query``, (T, S)
    int32, as HF's ``T5Attention._relative_position_bucket`` computes it (float32 logs,
    truncated): half the buckets are exact distances, the others logarithmically wider
    up to ``max_distance``; bidirectional buckets split them between the two directions,
    causal ones map every later key to bucket 0. Static shapes: a numpy constant."""
    relative = np.arange(key_len)[None, :] - np.arange(query_len)[:, None]  # (T, S)
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    ratio = np.maximum(relative, 1).astype(np.float32) / np.float32(max_exact)
    scaled = (
        np.log(ratio)
        / np.float32(np.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    )
    large = np.minimum(max_exact + scaled.astype(np.int64), num_buckets - 1)
    return (buckets + np.where(is_small, relative, large)).astype(np.int32)


def position_bias(table: jax.Array, query_len: int, key_len: int, causal: bool, config):
    """The relative position bias (H, T, S) of a stack's ``table`` (NB, H)."""
    buckets = relative_position_buckets(
        query_len,
        key_len,
        not causal,
        config.relative_attention_num_buckets,
        config.relative_attention_max_distance,
    )
    return jnp.transpose(table[buckets], (2, 0, 1))


def _dense(config: ModelConfig, features: int, std: float, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=False,
        dtype=jnp.dtype(config.compute_dtype),
        param_dtype=config.param_dtype,
        kernel_init=nn.initializers.normal(std),
        name=name,
    )


def _norm(config: ModelConfig, name: str) -> nn.RMSNorm:
    """T5's layer norm: RMS without mean subtraction, a scale, no bias."""
    return nn.RMSNorm(
        epsilon=config.layer_norm_eps,
        dtype=jnp.dtype(config.compute_dtype),
        param_dtype=config.param_dtype,
        name=name,
    )


class T5Attention(nn.Module):
    """Multi-head attention of x (B, T, D) over kv (B, S, D), with an optional position
    bias (H, T, S) and causal mask; q, k, v, o initialised as HF's T5."""

    config: ModelConfig
    causal: bool

    @nn.compact
    def __call__(
        self, x: jax.Array, kv: jax.Array, bias: jax.Array | None, mask: jax.Array | None = None
    ) -> jax.Array:
        cfg = self.config
        D, H, K = cfg.d_model, cfg.num_heads, cfg.head_dim
        B, T, _ = x.shape
        S = kv.shape[1]
        q = _dense(cfg, H * K, (D * K) ** -0.5, "q")(x).reshape(B, T, H, K)
        k = _dense(cfg, H * K, D**-0.5, "k")(kv).reshape(B, S, H, K)
        v = _dense(cfg, H * K, D**-0.5, "v")(kv).reshape(B, S, H, K)
        out = biased_attention(q, k, v, bias, self.causal, mask)  # (B, T, H K)
        return _dense(cfg, D, (H * K) ** -0.5, "o")(out)


class T5FeedForward(nn.Module):
    """Gated GELU (v1.1) or ReLU (v1.0) feed-forward: (B, T, D) -> (B, T, D)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        cfg = self.config
        D, F = cfg.d_model, cfg.ff_dim
        if cfg.feed_forward_proj == "gated-gelu":
            gate = nn.gelu(_dense(cfg, F, D**-0.5, "wi_0")(h), approximate=True)
            h = gate * _dense(cfg, F, D**-0.5, "wi_1")(h)  # (B, T, F)
        else:
            h = nn.relu(_dense(cfg, F, D**-0.5, "wi")(h))
        return _dense(cfg, D, F**-0.5, "wo")(h)


class SwitchFeedForward(nn.Module):
    """The Switch Transformer's sparse feed-forward layer (Fedus et al. 2022): a softmax
    router over E experts, each of them the dense layer's shape (``T5FeedForward``'s
    gated GELU or ReLU, stacked on a leading E axis), each token sent to its top expert
    and its output scaled by that expert's router probability. Dropless (no capacity, no
    dropped token): the tokens are sorted by expert and each expert multiplies its own
    rows (``jax.lax.ragged_dot``), as ``models/llama.py``'s Mixtral does. The router
    computes in fp32 (Switch's selective precision).

    h (B, T, D) -> (out (B, T, D), stats (2 E,) fp32): per expert the fraction of tokens
    routed to it and its mean router probability, the two factors of the
    load-balancing loss.

    Expert-aware streaming (``offload.expert_fetch=routed``), as ``models/llama.py``'s
    ``MixtureOfExperts``: with ``route_only`` the module returns the routing, ``(top_e
    (M, 1) int32, tokens per expert (E,) int32)``, from the router alone; called with
    ``routing=(top_e, slots)`` it uses that decision and holds only ``held`` experts
    (those that got tokens, in increasing order; ``slots`` (E,) maps an expert to its
    row among them)."""

    config: ModelConfig
    held: int | None = None
    route_only: bool = False

    @nn.compact
    def __call__(self, h: jax.Array, routing=None) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = jnp.dtype(cfg.compute_dtype)
        B, T, D = h.shape
        E, F = cfg.num_experts, cfg.ff_dim
        router = self.param("router", nn.initializers.normal(D**-0.5), (D, E), cfg.param_dtype)
        tokens = h.reshape(B * T, D)  # (M, D)
        logits = jnp.einsum("MD,DE->ME", tokens.astype(F32), router.astype(F32))
        probs = jax.nn.softmax(logits, axis=-1)  # (M, E)
        # (M,) each token's top expert: the router's, or the decision given
        chosen = jnp.argmax(probs, axis=-1) if routing is None else routing[0][:, 0]
        if self.route_only:
            counts = jnp.bincount(chosen, length=E).astype(jnp.int32)
            return chosen[:, None].astype(jnp.int32), counts
        local, group = E, chosen  # the experts held, and each token's row among them
        if self.held is not None:
            local, group = self.held, routing[1][chosen]
        expert = lambda name, shape, std: self.param(
            name, nn.initializers.normal(std), (local, *shape), cfg.param_dtype
        ).astype(dtype)
        gated = cfg.feed_forward_proj == "gated-gelu"
        wi = expert("wi_0" if gated else "wi", (D, F), D**-0.5)
        wi_1 = expert("wi_1", (D, F), D**-0.5) if gated else None
        wo = expert("wo", (F, D), F**-0.5)

        order = jnp.argsort(chosen, stable=True)  # tokens grouped by expert
        sizes = jnp.bincount(group, length=local).astype(jnp.int32)  # (local,) tokens per expert
        rows = tokens[order]  # (M, D)
        act = jax.lax.ragged_dot(rows, wi, sizes)  # (M, F)
        if gated:
            act = nn.gelu(act, approximate=True) * jax.lax.ragged_dot(rows, wi_1, sizes)
        else:
            act = nn.relu(act)
        y = jax.lax.ragged_dot(act, wo, sizes)  # (M, D)
        gate = jnp.take_along_axis(probs, chosen[:, None], axis=-1)  # (M, 1)
        y = y * gate[order].astype(dtype)
        out = jnp.zeros((B * T, D), dtype).at[order].set(y).reshape(B, T, D)

        routed = jnp.mean(jax.nn.one_hot(chosen, E, dtype=F32), axis=0)
        stats = jnp.concatenate([routed, jnp.mean(probs, axis=0)])  # (2 E,)
        return out, stats


# Expert-aware streaming splits a sparse layer (``part``): "all"; "attention", its
# attention (and cross-attention) and the router's decision -> (the residual stream, the
# routing); "mlp", which takes that residual stream and runs the experts, ``held`` of
# them, with the decision given (``routing``; SwitchFeedForward).


class T5EncoderBlock(nn.Module):
    """x + attn(rms(x)) with the encoder's bidirectional bias; x + ff(rms(x)). A
    ``sparse`` layer's feed-forward layer is experts (:class:`SwitchFeedForward`,
    ``moe``): it returns its router statistics too (``part``, ``held``: above)."""

    config: ModelConfig
    sparse: bool = False
    held: int | None = None
    part: str = "all"

    @nn.compact
    def __call__(self, x: jax.Array, table: jax.Array, seg=None, routing=None):  # (B, T, D)
        cfg = self.config
        if self.part != "mlp":
            T = x.shape[1]
            h = _norm(cfg, "self_attention_layer_norm")(x)
            bias = position_bias(table, T, T, False, cfg)
            mask = None if seg is None else same_record(seg, seg)
            x = x + T5Attention(cfg, causal=False, name="SelfAttention")(h, h, bias, mask)
        return _feed_forward(cfg, self.sparse, x, self.held, self.part, routing)


class T5DecoderBlock(nn.Module):
    """x + causal attn(rms(x)) with the decoder's bias; x + attn(rms(x)) over the
    encoder's output ``memory`` (B, S, D); x + ff(rms(x)) (experts when ``sparse``).
    With an instruction row's records (``enc_seg`` (B, S), ``dec_seg`` (B, T): each
    position's record, :func:`row_records`) a position attends only to its own record's
    positions, in both attentions."""

    config: ModelConfig
    sparse: bool = False
    held: int | None = None
    part: str = "all"

    @nn.compact
    def __call__(
        self, x, memory: jax.Array, table: jax.Array, enc_seg=None, dec_seg=None, routing=None
    ):
        cfg = self.config
        if self.part != "mlp":
            T = x.shape[1]
            h = _norm(cfg, "self_attention_layer_norm")(x)
            bias = position_bias(table, T, T, True, cfg)
            own = cross = None
            if enc_seg is not None:
                own, cross = same_record(dec_seg, dec_seg), same_record(dec_seg, enc_seg)
            x = x + T5Attention(cfg, causal=True, name="SelfAttention")(h, h, bias, own)
            h = _norm(cfg, "cross_attention_layer_norm")(x)
            x = x + T5Attention(cfg, causal=False, name="EncDecAttention")(h, memory, None, cross)
        return _feed_forward(cfg, self.sparse, x, self.held, self.part, routing)


def _feed_forward(
    cfg: ModelConfig, sparse: bool, x: jax.Array, held=None, part="all", routing=None
):
    """x + ff(rms(x)), called in a block's compact scope (its modules are the block's);
    with ``sparse`` the experts', with their router statistics: ``(x, stats)``; with
    ``part="attention"`` (sparse) ``(x, (top_e, tokens per expert))`` instead."""
    h = _norm(cfg, "ff_layer_norm")(x)
    if not sparse:
        return x + T5FeedForward(cfg, name="DenseReluDense")(h)
    if part == "attention":
        return x, SwitchFeedForward(cfg, route_only=True, name="moe")(h)
    out, stats = SwitchFeedForward(cfg, held, name="moe")(h, routing)
    return x + out, stats


class T5SwitchBlock(nn.Module):
    """Two T5 layers, a dense one then a sparse one (the Switch Transformer's experts in
    every other layer, HF's ``sparse_step`` 2): the block of a T5 with experts, so that a
    stack's blocks are identical. -> (x, the sparse layer's router statistics).
    ``part``, ``held``, ``routing``: the sparse layer's (above); "mlp" runs only the rest
    of the sparse layer."""

    config: ModelConfig
    decoder: bool
    held: int | None = None
    part: str = "all"

    @nn.compact
    def __call__(self, x: jax.Array, *context, routing=None):
        layer = T5DecoderBlock if self.decoder else T5EncoderBlock
        if self.part != "mlp":
            x = layer(self.config, name="dense")(x, *context)
        sparse = layer(self.config, sparse=True, held=self.held, part=self.part, name="sparse")
        return sparse(x, *context, routing=routing)


class T5CachedAttention(nn.Module):
    """:class:`T5Attention`'s params, for one new decoder position against a KV cache.
    Self-attention (``causal``): this position's key and value go into ``cache`` (k, v
    (B, S, H, K)) at ``start``, and it attends to the keys up to it. Cross-attention:
    the keys and values of ``kv`` (the encoder's output) when given, else ``cache``'s
    (computed once, at the first position). -> (out (B, 1, D), (k, v))."""

    config: ModelConfig
    causal: bool

    @nn.compact
    def __call__(self, x, kv, cache, bias, mask, start):
        cfg = self.config
        D, H, K = cfg.d_model, cfg.num_heads, cfg.head_dim
        B, T, _ = x.shape
        q = _dense(cfg, H * K, (D * K) ** -0.5, "q")(x).reshape(B, T, H, K)
        keys, values = _dense(cfg, H * K, D**-0.5, "k"), _dense(cfg, H * K, D**-0.5, "v")
        if self.causal:
            k, v = (
                jax.lax.dynamic_update_slice_in_dim(c, f(x).reshape(B, T, H, K), start, axis=1)
                for c, f in zip(cache, (keys, values), strict=True)
            )
        elif kv is not None:
            S = kv.shape[1]
            k, v = keys(kv).reshape(B, S, H, K), values(kv).reshape(B, S, H, K)
        else:
            k, v = cache
        out = biased_attention(q, k, v, bias, False, mask)  # (B, T, H K)
        return _dense(cfg, D, (H * K) ** -0.5, "o")(out), (k, v)


class T5DecoderStep(nn.Module):
    """:class:`T5DecoderBlock` (dense) for one new position against its caches
    (``T5.decode_block``): ``cache`` (k, v, cross k, cross v); ``memory`` the encoder's
    normed output at the first position (the cross keys and values made of it), None
    after; ``bias`` (H, 1, S) this position's row of the decoder's; ``enc_seg`` the
    prompts' records (B, P) (1: the prompt, 2: its padding) or None."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, cache, memory, bias, enc_seg, start):
        cfg = self.config
        B, S = x.shape[0], cache[0].shape[1]
        upto = jnp.broadcast_to(jnp.arange(S) <= start, (B, 1, S))  # causal: the keys so far
        prompt = None if enc_seg is None else (enc_seg == 1)[:, None, :]  # (B, 1, P)
        h = _norm(cfg, "self_attention_layer_norm")(x)
        a, (k, v) = T5CachedAttention(cfg, True, name="SelfAttention")(
            h, None, cache[:2], bias, upto, start
        )
        x = x + a
        h = _norm(cfg, "cross_attention_layer_norm")(x)
        a, (ck, cv) = T5CachedAttention(cfg, False, name="EncDecAttention")(
            h, memory, cache[2:], None, prompt, start
        )
        return _feed_forward(cfg, False, x + a), (k, v, ck, cv)


def row_records(tokens: jax.Array, decoder_len: int):
    """An encoder's tokens -> (ids (B, T), the encoder's records (B, T), the decoder's
    (B, ``decoder_len``)), each position's record as ``models.staged.segment_ids``
    numbers them, fp32 (a stage group's context is differentiated), or None for plain
    tokens (B, T). An instruction row (``hetjax/instruct.py``) is (B, 2, T): ids and
    positions (one record: the prompt's from 0, its padding's from 0 again; the
    decoder's is record 1 throughout), or (B, 3, T), packed: ids, the encoder's
    positions and the decoder's (record k's prompt and completion are record k on each
    side)."""
    if tokens.ndim == 2:
        return tokens, None, None
    enc = segment_ids(tokens[:, 1]).astype(F32)
    if tokens.shape[1] == 2:
        return tokens[:, 0], enc, jnp.ones((tokens.shape[0], decoder_len), F32)
    return tokens[:, 0], enc, segment_ids(tokens[:, 2]).astype(F32)


def same_record(query_seg: jax.Array, key_seg: jax.Array) -> jax.Array:
    """Records (B, T) and (B, S) -> (B, T, S) bool: which keys a query may attend to."""
    return query_seg[:, :, None] == key_seg[:, None, :]


def shift_right(targets: jax.Array, start: int, records: jax.Array | None = None) -> jax.Array:
    """The decoder's input (B, T): the targets shifted one right behind ``start``; with
    ``records`` (B, T) (a packed row's, :func:`row_records`) each record's on its own,
    ``start`` at the first position of every record."""
    shifted = jnp.concatenate([jnp.full_like(targets[:, :1], start), targets[:, :-1]], axis=1)
    if records is None:
        return shifted
    first = jnp.concatenate(
        [records[:, :1] == records[:, :1], records[:, 1:] != records[:, :-1]], axis=1
    )
    return jnp.where(first, start, shifted)


class T5Shared(nn.Module):
    """The embed stage: what both stacks' inputs are made of (see the module docstring)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        D, V = cfg.d_model, cfg.vocab_size
        table = lambda name: self.param(
            name,
            nn.initializers.normal(D**-0.5),
            (cfg.relative_attention_num_buckets, cfg.num_heads),
            cfg.param_dtype,
        )
        self.shared = self.param("shared", nn.initializers.normal(1.0), (V, D), cfg.param_dtype)
        self.encoder_relative_attention_bias = table("encoder_relative_attention_bias")
        self.decoder_relative_attention_bias = table("decoder_relative_attention_bias")
        self.encoder_final_layer_norm = _norm(cfg, "encoder_final_layer_norm")

    def _embed(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, D)
        return jnp.take(self.shared, tokens, axis=0).astype(self.config.compute_dtype)

    def encoder_input(self, tokens: jax.Array):
        """tokens (B, T), or an instruction row's (:func:`row_records`) -> (x (B, T, D),
        the encoder's context: its bias table, and the row's records)."""
        ids, enc_seg, _ = row_records(tokens, 1)
        table = self.encoder_relative_attention_bias
        return self._embed(ids), (table,) if enc_seg is None else (table, enc_seg)

    def decoder_input(self, encoder_out: jax.Array, targets: jax.Array, records=None):
        """-> (x (B, T, D), the decoder's context: the encoder's normed output, the
        decoder's bias table, and an instruction row's records on both sides
        (``records``: :func:`row_records`' two, or None)). Targets that take no loss
        (``IGNORED``, an instruction row's padding) read as token 0, as HF's
        ``_shift_right`` reads its -100 labels as the pad token."""
        start = self.config.decoder_start_token
        dec_seg = None if records is None else records[1]
        x = self._embed(shift_right(jnp.maximum(targets, 0), start, dec_seg))
        memory = self.encoder_final_layer_norm(encoder_out)
        context = (memory, self.decoder_relative_attention_bias)
        return x, context if records is None else (*context, *records)

    def __call__(self, tokens: jax.Array):  # init: every param
        x, _ = self.encoder_input(tokens)
        return self.decoder_input(x, tokens)


class T5Head(nn.Module):
    """The decoder's final norm and the output projection: (B, T, D) -> logits (B, T, V).
    With ``embedding`` (V, D) given, the projection is tied to it (and the decoder's
    output scaled by D^-0.5 first, as T5 v1.0)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, embedding: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        x = _norm(cfg, "final_layer_norm")(x)
        if embedding is not None:
            x = x * cfg.d_model**-0.5
            return jnp.einsum("BTD,VD->BTV", x, embedding.astype(x.dtype))
        return _dense(cfg, cfg.vocab_size, 1.0, "lm_head")(x)


# Each param's logical axes (models/staged.py's logical_axes), by its path in its stage.
LOGICAL_AXES: AxisTable = (
    ("shared", ("vocab", "embed")),
    ("(encoder|decoder)_relative_attention_bias", ("buckets", "heads")),
    ("(q|k|v)/kernel", ("embed", "heads")),  # (D, H K)
    ("o/kernel", ("heads", "embed")),
    ("(wi|wi_0|wi_1)/kernel", ("embed", "mlp")),
    ("wo/kernel", ("mlp", "embed")),
    ("moe/router", ("embed", "router")),  # (D, E): every device scores every expert
    ("moe/(wi|wi_0|wi_1)", ("expert", "embed", "mlp")),  # (E, D, F)
    ("moe/wo", ("expert", "mlp", "embed")),
    ("[a-z_]*layer_norm/scale", ("embed",)),
    ("lm_head/kernel", ("embed", "vocab")),
)


class T5(Stages):
    """T5 as stages: embed, the encoder group, the decoder group, head (see the module
    docstring); the whole-model functions are :class:`models.staged.Stages`'."""

    logical_axes_table = LOGICAL_AXES

    def __init__(self, config: ModelConfig):
        self.config = config
        per_block = config.layers_per_block  # a T5 with experts: a dense and a sparse layer
        self.groups = (
            StageGroup("encoder", config.num_layers // per_block),
            StageGroup("decoder", config.decoder_layers // per_block),
        )
        self.tied = "shared" if config.tie_embeddings else None
        self._shared, self._head = T5Shared(config), T5Head(config)
        if config.num_experts:
            self._blocks = (T5SwitchBlock(config, False), T5SwitchBlock(config, True))
        else:
            self._blocks = (T5EncoderBlock(config), T5DecoderBlock(config))
        # the encoder's, then the decoder's router statistics (each stack's loss apart)
        experts = 2 * config.num_experts if config.num_experts else 0
        self.stats_size = 2 * experts if config.router_aux_loss_coef else 0
        # expert-aware streaming (route, routed_block): the Switch layers' experts
        self.expert_routing = bool(config.num_experts)
        self.expert_params = EXPERT_PARAMS

    def init_stage(self, stage: str, key: jax.Array) -> Params:
        cfg = self.config
        tokens = jnp.zeros((1, 1), jnp.int32)
        x = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
        table = jnp.zeros((cfg.relative_attention_num_buckets, cfg.num_heads), cfg.param_dtype)
        if stage == "embed":
            return self._shared.init(key, tokens)["params"]
        if stage == "encoder":
            return self._blocks[0].init(key, x, table)["params"]
        if stage == "decoder":
            return self._blocks[1].init(key, x, x, table)["params"]
        if stage == "head":
            if self.tied is None:
                return self._head.init(key, x)["params"]
            embedding = jnp.zeros((cfg.vocab_size, cfg.d_model), cfg.param_dtype)
            return self._head.init(key, x, embedding)["params"]
        raise ValueError(f"unknown stage {stage!r}")

    def group_input(self, g: int, embed_params: Params, prev, tokens, targets):
        shared = {"params": embed_params}
        if g == 0:
            return self._shared.apply(shared, tokens, method=T5Shared.encoder_input)
        _, enc_seg, dec_seg = row_records(tokens, targets.shape[1])
        records = None if enc_seg is None else (enc_seg, dec_seg)
        return self._shared.apply(shared, prev, targets, records, method=T5Shared.decoder_input)

    def group_block(self, g: int, block_params: Params, x: jax.Array, context):
        out = self._blocks[g].apply({"params": block_params}, x, *context)
        if not self.config.num_experts:
            return out, jnp.zeros((0,), F32)
        return self._in_slot(g, *out)

    def route(self, g: int, block_params: Params, x: jax.Array, context=()):
        """Expert-aware streaming's first half of a Switch block of group ``g``: its dense
        layer and its sparse layer up to the router -> (the residual stream (B, T, D),
        the decision top_e (B T, 1) int32, tokens per expert (E,) int32). Reads no
        expert weight."""
        block = self._blocks[g].clone(part="attention")
        x, (top_e, counts) = block.apply({"params": block_params}, x, *context)
        return x, top_e, counts

    def routed_block(self, g: int, block_params: Params, x, routing, context=(), part="all"):
        """A Switch block of group ``g`` that takes its routing decision ``(top_e, slots)``
        and holds only the routed experts (``block_params``' expert leaves have one row
        each, in increasing expert order): equal to the whole block for tokens routed so.
        ``part="mlp"``: x is :meth:`route`'s residual stream and only the rest of the
        sparse layer runs. -> (y, statistics), as :meth:`group_block`."""
        held = block_params["sparse"]["moe"]["wo"].shape[0]
        block = self._blocks[g].clone(part=part, held=held)
        return self._in_slot(
            g, *block.apply({"params": block_params}, x, *context, routing=routing)
        )

    def _in_slot(self, g: int, x: jax.Array, stats: jax.Array):
        """A block's output and its router statistics in group ``g``'s slot of the
        model's (the encoder's first, the decoder's second), or none."""
        if not self.stats_size:
            return x, jnp.zeros((0,), F32)
        half = self.stats_size // 2  # the group's slot: encoder first, decoder second
        return x, jnp.concatenate([jnp.zeros(g * half, F32), stats, jnp.zeros((1 - g) * half, F32)])

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        """``router_aux_loss_coef`` x the Switch Transformer's load-balancing loss of
        each stack, summed (HF's SwitchTransformers adds the encoder's and the
        decoder's): E sum_e f_e P_e, with f_e the fraction of the stack's tokens routed
        to expert e and P_e its mean router probability, pooled over the stack's sparse
        layers and the micro-batch. ``stats`` (4 E,): the sum over blocks of their
        statistics, in their group's slot; fp32 scalar."""
        if not self.stats_size:
            return jnp.float32(0)
        E, loss = self.config.num_experts, jnp.float32(0)
        for g, group in enumerate(self.groups):
            part = stats[2 * E * g : 2 * E * (g + 1)] / group.num_layers
            loss += E * jnp.sum(part[:E] * part[E:])
        return self.config.router_aux_loss_coef * loss

    def group_active_params(self, g: int) -> int:
        """Params of one block a token's forward uses: all but the experts of its
        sparse layer it is not routed to (E - 1 of them)."""
        cfg = self.config
        if not cfg.num_experts:
            return self.block_param_count(g)
        expert = (3 if cfg.feed_forward_proj == "gated-gelu" else 2) * cfg.d_model * cfg.ff_dim
        return self.block_param_count(g) - (cfg.num_experts - 1) * expert

    # -- generation with a KV cache (hetjax/inference.py) -------------------------------

    def decode_input(self, embed_params: Params, ids: jax.Array) -> jax.Array:
        """The decoder's new tokens (B, 1) int32 -> their embedding (B, 1, D)."""
        embed = lambda m, ids: m._embed(ids)
        return self._shared.apply({"params": embed_params}, ids, method=embed)

    def decode_context(self, embed_params: Params, encoder_out: jax.Array, tokens: jax.Array):
        """The decoder's context for generation: (the encoder's normed output (B, P, D),
        the decoder's bias table, and the records of prompts right-padded (B, 2, P),
        :func:`row_records`)."""
        targets = jnp.zeros((encoder_out.shape[0], 1), jnp.int32)
        return self.group_input(1, embed_params, encoder_out, tokens, targets)[1]

    def decode_block(self, block_params: Params, x: jax.Array, start, cache, context, first):
        """One dense decoder block over the new position ``start`` (the same for every
        row) against its cache (k, v (B, S, H, K) of the positions so far; the cross
        keys and values (B, P, H, K), made from ``context``'s encoder output when
        ``first``) -> (x (B, 1, D), the cache updated)."""
        if self.config.num_experts:
            raise ValueError("T5's KV cache is for dense blocks (a Switch T5 runs whole)")
        memory, table, *records = context
        S = cache[0].shape[1]
        bias = jax.lax.dynamic_slice_in_dim(
            position_bias(table, S, S, True, self.config), start, 1, axis=1
        )
        step = T5DecoderStep(self.config)
        args = (memory if first else None, bias, records[0] if records else None, start)
        return step.apply({"params": block_params}, x, cache, *args)

    def head_logits(self, head_params: Params, embed_params: Params, x: jax.Array) -> jax.Array:
        """x (B, T, D) -> fp32 logits (B, T, V)."""
        embedding = None if self.tied is None else embed_params[self.tied]
        return self._head.apply({"params": head_params}, x, embedding).astype(jnp.float32)

    def logits(self, params: Params, tokens: jax.Array, targets: jax.Array | None = None):
        """tokens (B, T) the encoder's, targets (B, T) whose shift is the decoder's input
        -> fp32 logits (B, T, V)."""
        if targets is None:
            raise ValueError("T5.logits needs the targets: the decoder reads them shifted right")
        return super().logits(params, tokens, targets)

    def block_flops_per_row(self, seq_len: int, target_len: int | None = None) -> float:
        """The encoder's blocks over ``seq_len`` tokens, the decoder's over
        ``target_len`` (``seq_len`` when None): its self-attention over ``target_len``
        keys, its cross-attention over ``seq_len``."""
        S, D = target_len or seq_len, self.config.d_model
        (L_enc, enc), (L_dec, dec) = (
            (g.num_layers, g.num_layers * self.group_active_params(i))
            for i, g in enumerate(self.groups)
        )
        attention = 12.0 * D * (L_enc * seq_len**2 + L_dec * (S * S + S * seq_len))
        return 6.0 * (enc * seq_len + dec * S) + attention

    def attention_layers(self) -> int:
        """The encoder's self-attentions and the decoder's self- and cross-attentions."""
        return self.config.num_layers + 2 * self.config.decoder_layers
