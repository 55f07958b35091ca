"""Exact causal attention for the model zoo, three ways (``model.attention``).

All three compute ``softmax(q k^T / sqrt(K) + causal mask) v`` for grouped-query
attention: q (B, T, N, G, K), k and v (B, T, N, K), query head ``n * G + g`` reading
key/value head n (HF's ``repeat_kv`` order; plain multi-head attention is G = 1). They
return (B, T, N * G * K), tagged ``attn_out`` for the keep levels (hetjax/runtime/stages/remat.py).

``reference``  the textbook one: the fp32 scores and the probabilities (B, N, G, T, T) are
               whole tensors (the probabilities tagged ``attn_probs``). The tests'
               reference, and what keep level ``probs`` keeps.
``blockwise``  online softmax over (b, b) tiles of the score matrix (FlashAttention,
               Dao et al. 2022; the backward of FlashAttention-2), in plain JAX loops, for
               any backend: no (T, T) tensor exists in forward or backward. A custom_vjp:
               forward saves only its output and each row's logsumexp (B, N, G, T) fp32
               (tagged ``attn_lse``); backward recomputes each tile's scores from q, k and
               those. Tiles above the causal diagonal are skipped, not masked. The
               tiles' probabilities and their gradients stay fp32 in its matmuls
               (the reference rounds the probabilities to the compute dtype).
``fused``      ``jax.nn.dot_product_attention`` with cuDNN's fused kernel (GPU, fp16 or
               bf16, head width a multiple of 8 up to 128).
``auto``       ``fused`` where cuDNN supports the shape and dtype and its kernel passed
               a probe (:func:`probe_fused`: forward and backward once, at the run's
               head width and sequence; a failure falls back to ``blockwise`` with one
               warning line), else ``blockwise``.

Packed rows (``data.format=jsonl``, hetjax/instruct.py): each takes ``segment_ids``
(B, T) int32, the record each position belongs to; a query then attends only to keys of
its own record (and before it), so a packed row computes what its records would alone.
None: one sequence per row.

Block size b: ``model.attention_block``, or when 0 :data:`DEFAULT_BLOCK`; at most T.
Shape letters: B batch, T/S query/key positions, N key/value heads, G query heads per
key/value head, K head width, b block.
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from hetjax.config import ConfigError

F32 = jnp.float32
# Mask value of the scores: the reference's (a finite one: a fully masked row, which
# causal attention never has, would not turn into NaN).
MASKED = float(jnp.finfo(F32).min)
# Tile side when model.attention_block is 0. GPT-2 small's streamed block backward at
# T 1024 on XLA:CPU (2 cores): b 128: 428 ms, 91 MiB of temporaries; 256: 444 ms, 91 MiB;
# 512: 458 ms, 120 MiB; 1024 (one tile): 711 ms, 248 MiB. 256 x 256 fp32 tiles keep a
# GPU's share small too.
DEFAULT_BLOCK = 256


def fused_supported(backend: str, dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention (``jax.nn.dot_product_attention``,
    ``implementation="cudnn"``) takes this backend, compute dtype and head width."""
    return (
        backend in ("gpu", "cuda")
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def resolve(setting: str, backend: str, dtype, head_dim: int) -> str:
    """The implementation ``model.attention=setting`` runs on ``backend`` ("cpu",
    "gpu", ...): ``auto`` becomes ``fused`` or ``blockwise`` (``blockwise`` too where
    this process's probe of cuDNN failed at that dtype and head width)."""
    if setting != "auto":
        return setting
    failed = PROBED.get((jnp.dtype(dtype).name, head_dim))
    return "fused" if fused_supported(backend, dtype, head_dim) and not failed else "blockwise"


# cuDNN's fused attention as this process probed it, by (dtype name, head width): "" where
# it ran forward and backward, else why not (one line).
PROBED: dict[tuple[str, int], str] = {}


def probe_fused(dtype, head_dim: int, seq_len: int, heads: tuple[int, int] = (1, 1)) -> bool:
    """Whether cuDNN's fused attention runs here, forward and backward, in ``dtype`` at
    head width ``head_dim`` and ``seq_len`` positions (one row, ``heads``: key/value
    heads N and query heads per one G): tried once per dtype and head width per process
    (:data:`PROBED`), compiled and run at once even inside a trace. A failure prints one
    warning line on stderr; ``auto`` then runs the blockwise attention."""
    key = (jnp.dtype(dtype).name, head_dim)
    if key not in PROBED:
        N, G = heads
        try:
            with jax.ensure_compile_time_eval():
                q = jnp.full((1, seq_len, N, G, head_dim), 0.1, dtype)
                kv = jnp.full((1, seq_len, N, head_dim), 0.1, dtype)
                loss = lambda q, k, v: fused_attention(q, k, v).astype(F32).sum()
                jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, kv, kv))
            PROBED[key] = ""
        except Exception as e:  # noqa: BLE001 — whatever cuDNN or XLA raise: fall back
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            PROBED[key] = why[:300]
            print(
                f"hetjax: warning: cuDNN fused attention failed its probe ({key[0]}, head "
                f"width {head_dim}, {seq_len} positions: {PROBED[key]}); model.attention=auto "
                "runs the blockwise attention",
                file=sys.stderr,
                flush=True,
            )
    return not PROBED[key]


def probe_for(m, seq_len: int) -> None:
    """A run's start-up probe (``hetjax/train.py``): ``m`` (a ModelConfig) at
    ``seq_len`` positions, where ``auto`` would choose cuDNN on this backend."""
    if (
        m.family in ("gpt", "llama")
        and resolve(m.attention, jax.default_backend(), m.compute_dtype, m.head_dim) == "fused"
        and m.attention == "auto"
    ):
        probe_fused(m.compute_dtype, m.head_dim, seq_len, (m.kv_heads, m.num_heads // m.kv_heads))


def chosen(m) -> str:
    """What ``auto`` (or the set implementation) ran for ``m`` (a ModelConfig) in this
    process, for a report: ``fused (cuDNN)``, ``blockwise (cuDNN failed its probe: ...)``."""
    impl = resolve(m.attention, jax.default_backend(), m.compute_dtype, m.head_dim)
    failed = PROBED.get((jnp.dtype(m.compute_dtype).name, m.head_dim))
    if impl == "fused":
        return "fused (cuDNN)"
    return f"{impl} (cuDNN failed its probe: {failed})" if failed else impl


def block_size(setting: int, seq_len: int) -> int:
    """The tile side b of the blockwise attention: ``model.attention_block`` (0:
    :data:`DEFAULT_BLOCK`), at most ``seq_len``."""
    return min(setting or DEFAULT_BLOCK, seq_len)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, config, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Causal grouped-query attention as ``config`` (a ModelConfig) selects:
    q (B, T, N, G, K), k and v (B, T, N, K), segment_ids (B, T) int32 or None ->
    (B, T, N G K) in q's dtype."""
    head_dim = q.shape[-1]
    impl = resolve(config.attention, jax.default_backend(), q.dtype, head_dim)
    if impl == "fused" and config.attention == "auto":  # probed once (at start-up in train)
        heads = q.shape[2:4]
        impl = "fused" if probe_fused(q.dtype, head_dim, q.shape[1], heads) else "blockwise"
    if impl == "reference":
        return reference_attention(q, k, v, segment_ids)
    if impl == "fused":
        if not fused_supported(jax.default_backend(), q.dtype, head_dim):
            raise ConfigError(
                "config key 'model.attention' is 'fused' (cuDNN), which needs a GPU, "
                f"compute dtype bfloat16 or float16 and a head width that is a multiple "
                f"of 8 up to 128; here: backend {jax.default_backend()!r}, "
                f"{jnp.dtype(q.dtype).name}, head width {head_dim}. Use 'auto'"
            )
        return fused_attention(q, k, v, segment_ids)
    block = block_size(config.attention_block, q.shape[1])
    return blockwise_attention(q, k, v, block, segment_ids)


def same_segment(segment_ids: jax.Array) -> jax.Array:
    """(B, T) int -> (B, T, S) bool: query t and key s belong to the same record."""
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
    """The whole (B, N, G, T, T) score matrix in fp32, softmax, then ``probs @ v``."""
    B, T, N, G, K = q.shape
    scores = jnp.einsum("BTNGK,BSNK->BNGTS", q, k).astype(F32) / math.sqrt(K)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    if segment_ids is not None:
        causal = causal & same_segment(segment_ids)[:, None, None]  # (B, 1, 1, T, S)
    scores = jnp.where(causal, scores, MASKED)
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q.dtype), "attn_probs")
    out = jnp.einsum("BNGTS,BSNK->BTNGK", probs, v).reshape(B, T, N * G * K)
    return checkpoint_name(out, "attn_out")


def cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: tuple
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Generation's attention (hetjax/generate.py): T new positions against a KV cache.
    q (B, T, N, G, K), k and v (B, T, N, K) of the new positions; ``cache`` is (k cache
    (B, S, N, K), v cache, valid (B, S) bool: the slots holding a token, the new ones
    included, start: the slot of the first new position). The new keys and values are
    written at slots start .. start + T - 1; the query at slot i reads the valid slots
    up to i (prompts are left-padded: the padding slots are not valid). Scores and
    softmax in fp32, the probabilities rounded to q's dtype (as
    :func:`reference_attention`). -> ((B, T, N G K), (k cache, v cache) updated)."""
    k_cache, v_cache, valid, start = cache
    k_cache = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
    v_cache = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
    B, T, N, G, K = q.shape
    S = k_cache.shape[1]
    scores = jnp.einsum("BTNGK,BSNK->BNGTS", q, k_cache.astype(q.dtype)).astype(F32)
    scores = scores / math.sqrt(K)
    slots = start + jnp.arange(T)
    keep = (jnp.arange(S)[None, :] <= slots[:, None])[None] & valid[:, None, :]  # (B, T, S)
    scores = jnp.where(keep[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("BNGTS,BSNK->BTNGK", probs, v_cache.astype(q.dtype))
    return out.reshape(B, T, N * G * K), (k_cache, v_cache)


def biased_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    causal: bool,
    mask: jax.Array | None = None,
) -> jax.Array:
    """T5's attention: ``softmax(q k^T + bias (+ causal mask)) v``, the scores not scaled
    by 1/sqrt(K) (T5 folds that into its query projection's init). q (B, T, H, K), k and
    v (B, S, H, K), bias (H, T, S) or None, ``mask`` (B, T, S) bool (the keys each query
    attends to: its own record's in a packed row) or None -> (B, T, H K) in q's dtype.
    The scores and probabilities are whole fp32 tensors, as :func:`reference_attention`'s (the
    probabilities rounded to the compute dtype and tagged ``attn_probs``)."""
    B, T, H, K = q.shape
    scores = jnp.einsum("BTHK,BSHK->BHTS", q, k).astype(F32)  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.astype(F32)[None]
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((T, k.shape[1]), dtype=bool)), scores, MASKED)
    if mask is not None:
        scores = jnp.where(mask[:, None], scores, MASKED)
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q.dtype), "attn_probs")
    out = jnp.einsum("BHTS,BSHK->BTHK", probs, v).reshape(B, T, H * K)
    return checkpoint_name(out, "attn_out")


def fused_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
    """cuDNN's fused kernel; it groups query heads per key/value head as we do. Packed
    rows hand it the records' block-diagonal mask (B, 1, T, S) besides the causal one,
    which JAX passes to cuDNN as an additive bias of that shape (a (B, T, T) tensor in
    the compute dtype: packed rows cost the fused kernel that much memory; not yet run
    on a GPU)."""
    B, T, N, G, K = q.shape
    mask = None if segment_ids is None else same_segment(segment_ids)[:, None]
    out = jax.nn.dot_product_attention(
        q.reshape(B, T, N * G, K), k, v, mask=mask, is_causal=True, implementation="cudnn"
    )
    return checkpoint_name(out.reshape(B, T, N * G * K), "attn_out")


# -- blockwise ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, block: int, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Causal attention by (block, block) tiles with an online softmax:
    q (B, T, N, G, K), k and v (B, T, N, K), segment_ids (B, T) or None -> (B, T, N G K).
    T need not be a multiple of ``block``: the last tile is padded and its padded keys
    lie above every real query's causal diagonal. A query row that a whole key tile is
    masked from (another record's) adds that tile's values with weight exp(0) while its
    running max is still the mask value; the first unmasked score rescales them by
    exp(mask value - score) = 0, and every row has one (its own position)."""
    return _blockwise_fwd(q, k, v, block, segment_ids)[0]


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum of the operands in fp32."""
    return jnp.einsum(spec, a.astype(F32), b.astype(F32))


def _pad(x: jax.Array, length: int, axis: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)


def _tile(x: jax.Array, i, b: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, i * b, b, axis)


def _masked_scores(qi, kj, i, j, b: int, scale: float, seg) -> jax.Array:
    """Scores of query tile i against key tile j, (B, N, G, b, b) fp32, causal mask
    applied (only the diagonal tile has masked entries), and the records' mask where
    ``seg`` (the padded segment ids (B, Tp), or None) is given."""
    s = _dot("BTNGK,BSNK->BNGTS", qi, kj) * scale
    rows = i * b + jnp.arange(b)[:, None]
    cols = j * b + jnp.arange(b)[None, :]
    keep = rows >= cols  # (b, b)
    if seg is not None:
        si, sj = _tile(seg, i, b, 1), _tile(seg, j, b, 1)  # (B, b)
        keep = keep & (si[:, :, None] == sj[:, None, :])[:, None, None]  # (B, 1, 1, b, b)
    return jnp.where(keep, s, MASKED)


def _blockwise_fwd(q, k, v, block: int, segment_ids=None):
    B, T, N, G, K = q.shape
    b = min(block, T)
    nb = -(-T // b)
    Tp, scale = nb * b, 1.0 / math.sqrt(K)
    qp, kp, vp = _pad(q, Tp, 1), _pad(k, Tp, 1), _pad(v, Tp, 1)
    seg = None if segment_ids is None else _pad(segment_ids, Tp, 1)

    def query_tile(i, carry):
        out, lse = carry  # (B, Tp, N, G, K) q.dtype, (B, N, G, Tp) fp32
        qi = _tile(qp, i, b, 1)  # (B, b, N, G, K)

        def key_tile(j, acc_max_sum):
            acc, m, rowsum = acc_max_sum  # (B, N, G, b, K), (B, N, G, b), (B, N, G, b) fp32
            s = _masked_scores(qi, _tile(kp, j, b, 1), i, j, b, scale, seg)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])  # (B, N, G, b, b)
            correction = jnp.exp(m - m_new)
            pv = _dot("BNGTS,BSNK->BNGTK", p, _tile(vp, j, b, 1))
            acc = acc * correction[..., None] + pv
            return acc, m_new, rowsum * correction + p.sum(axis=-1)

        init = (
            jnp.zeros((B, N, G, b, K), F32),
            jnp.full((B, N, G, b), MASKED, F32),
            jnp.zeros((B, N, G, b), F32),
        )
        acc, m, rowsum = lax.fori_loop(0, i + 1, key_tile, init)  # tiles j > i: above the diagonal
        oi = jnp.einsum("BNGTK->BTNGK", acc / rowsum[..., None]).astype(q.dtype)
        out = lax.dynamic_update_slice_in_dim(out, oi, i * b, 1)
        lse = lax.dynamic_update_slice_in_dim(lse, m + jnp.log(rowsum), i * b, 3)
        return out, lse

    init = (jnp.zeros((B, Tp, N, G, K), q.dtype), jnp.zeros((B, N, G, Tp), F32))
    out, lse = lax.fori_loop(0, nb, query_tile, init)
    out = checkpoint_name(out[:, :T].reshape(B, T, N * G * K), "attn_out")
    lse = checkpoint_name(lse[..., :T], "attn_lse")
    return out, (q, k, v, out, lse, segment_ids)


def _blockwise_bwd(block: int, residuals, dout):
    q, k, v, out, lse, segment_ids = residuals
    B, T, N, G, K = q.shape
    b = min(block, T)
    nb = -(-T // b)
    Tp, scale = nb * b, 1.0 / math.sqrt(K)
    do = dout.reshape(B, T, N, G, K)
    # delta_t = sum_k dout * out = sum_s p_ts dp_ts, the softmax backward's row term
    delta = _dot("BTNGK,BTNGK->BNGT", do, out.reshape(B, T, N, G, K))
    # Padded query rows have dout 0, hence no gradient; their lse (0) only keeps exp finite.
    qp, kp, vp, dop = (_pad(x, Tp, 1) for x in (q, k, v, do))
    lse, delta = _pad(lse, Tp, 3), _pad(delta, Tp, 3)
    seg = None if segment_ids is None else _pad(segment_ids, Tp, 1)

    def key_tile(j, carry):
        dq, dk, dv = carry  # (B, Tp, N, G, K), (B, Tp, N, K), (B, Tp, N, K) fp32
        kj, vj = _tile(kp, j, b, 1), _tile(vp, j, b, 1)  # (B, b, N, K)

        def query_tile(i, dq_dkj_dvj):
            dq, dkj, dvj = dq_dkj_dvj
            qi, doi = _tile(qp, i, b, 1), _tile(dop, i, b, 1)  # (B, b, N, G, K)
            s = _masked_scores(qi, kj, i, j, b, scale, seg)
            p = jnp.exp(s - _tile(lse, i, b, 3)[..., None])  # (B, N, G, b, b)
            # p and ds stay fp32 in the matmuls (as in forward): rounding them to a
            # half precision would turn last-bit differences in s into 1e-3 ones
            dvj += _dot("BNGTS,BTNGK->BSNK", p, doi)
            dp = _dot("BTNGK,BSNK->BNGTS", doi, vj)
            ds = p * (dp - _tile(delta, i, b, 3)[..., None]) * scale
            dkj += _dot("BNGTS,BTNGK->BSNK", ds, qi)
            dqi = _dot("BNGTS,BSNK->BTNGK", ds, kj)
            dq = lax.dynamic_update_slice_in_dim(dq, _tile(dq, i, b, 1) + dqi, i * b, 1)
            return dq, dkj, dvj

        zeros = jnp.zeros((B, b, N, K), F32)
        dq, dkj, dvj = lax.fori_loop(j, nb, query_tile, (dq, zeros, zeros))  # i >= j: causal
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j * b, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j * b, 1)
        return dq, dk, dv

    init = (
        jnp.zeros((B, Tp, N, G, K), F32),
        jnp.zeros((B, Tp, N, K), F32),
        jnp.zeros((B, Tp, N, K), F32),
    )
    dq, dk, dv = lax.fori_loop(0, nb, key_tile, init)
    dq, dk, dv = dq[:, :T].astype(q.dtype), dk[:, :T].astype(k.dtype), dv[:, :T].astype(v.dtype)
    return dq, dk, dv, None  # segment ids: data, no gradient


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)
