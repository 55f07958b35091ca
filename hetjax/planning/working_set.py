"""The device working set of the stage functions, estimated from shapes: what the
planner takes where nothing was measured (``Workload.from_config``), fitted to XLA:CPU's
compiled sizes per family and dtype (docs/guide/planner.md), and the attention a block
runs on a backend."""

from __future__ import annotations

from models import attention


def block_attention(m, backend: str) -> str:
    """The attention a block of ``m`` (a ModelConfig) runs on ``backend``: reference,
    blockwise or fused (models/attention.py); a custom family's counts as reference (its
    scores, if any, are whole tensors for all we know)."""
    if m.family not in ("gpt", "llama"):
        return "reference"
    return attention.resolve(m.attention, backend, m.compute_dtype, m.head_dim)


# Device temporaries of the stage functions (XLA's temp_size_in_bytes), in bytes per
# element of the block's (B, T, D) activations, its attention scores and its params, and
# of the head's (B, T, V) logits and (V, D) projection.
#
# Reference attention (the (B, H, T, T) scores are whole tensors): fitted (minimax
# relative error) to XLA:CPU's compiled memory analysis of the stage functions, per
# family and dtype, over 33 shapes each (d 64-2048, T 64-1024, batch 1-8, d_ff 2-6 x d,
# vocab 256-50257). Where a micro-batch has at least 128 tokens the whole working set
# estimated is within 0.73-1.27 of the compiled one (fp32: GPT 0.76-1.23, Llama
# 0.80-1.20; bf16: GPT 0.74-1.26, Llama 0.73-1.27); at 64 tokens the block's params
# dominate and the compiled sizes jump with XLA's choice of weight copies (0.5-2.1).
#
# Blockwise attention (models/attention.py: one (B, H, b, b) tile of scores at a time):
# the streamed block's backward (block_bwd, the largest block function) per element of
# (B, T, D), of the MLP's (B, T, F), of one score tile (B, H, b, b) and of the params,
# fitted (minimax relative error, 2026-11-24) to XLA:CPU's temp_size_in_bytes over 23
# shapes per family and dtype: 15 activation-heavy (d 64-256, heads 2-16, T 128-1024,
# batch 1-8, b 32-256, d_ff 2-6 x d; the default config's and the tests' among them) and
# 8 param-heavy (d 512-2048, 128-1024 tokens): within 0.85-1.15 (GPT fp32), 0.75-1.25
# (GPT bf16), 0.81-1.19 (Llama fp32), 0.83-1.17 (Llama bf16). The previous fit (10
# activation-heavy shapes) gave 0.37 of the compiled size at d 1024 with 128 tokens:
# the block's temporaries of its own params (about 3 bytes a param: page-spanning
# weights concatenated, gradients flattened into pages) were missing. The shapes and
# the fit: docs/results/2026-11-24.md. The tile term is what the loop body holds at once
# (the scores, probabilities and their gradients in fp32); nothing grows with T x T.
# Fused (cuDNN) attention: no score term (not measured, no GPU).
#
# A bf16 step's temporaries on XLA:CPU are nearly fp32-sized: the backend computes bf16
# dots into fp32 outputs (then converts) and converts bf16 weights to fp32 copies for
# them, hence the separate bf16 fits. On an accelerator the dots run in the compute
# dtype, so the activation and param terms scale with it from the fp32 fit, while the
# attention scores and softmax, the logits and the head's gradient stay fp32 (the models
# cast them): that part is not measured (no GPU was at hand). A custom family takes the
# larger of the two families' reference coefficients.
_BLOCK_TEMPS = {  # (family, compute bytes): per activation, score, param element
    ("gpt", 4): (79.1, 11.7, 1.66),
    ("gpt", 2): (87.6, 10.3, 2.25),
    ("llama", 4): (147.0, 8.9, 1.13),
    ("llama", 2): (73.9, 11.5, 3.1),
}
_BLOCKWISE_TEMPS = {  # (family, compute bytes): per activation, MLP, tile, param element
    ("gpt", 4): (68.53, 11.87, 7.67, 2.86),
    ("gpt", 2): (89.12, 3.73, 12.77, 3.69),
    ("llama", 4): (30.86, 26.06, 6.88, 2.77),
    ("llama", 2): (63.84, 12.89, 11.54, 3.21),
}
_HEAD_TEMPS = {4: (6.74, 6.27), 2: (7.22, 6.72)}  # per logit, per projection element


def estimate_working_set(
    m,
    batch: int,
    seq_len: int,
    block_params: int,
    embed_params: int,
    backend: str,
    attentions: int = 1,
    chunks: int = 1,
) -> int:
    """Device bytes of the largest stage function's temporaries plus x / dx (what
    ``StageFunctions.memory_sizes`` measures), from shapes: ``m`` a
    :class:`~hetjax.config.ModelConfig`, one micro-batch of ``batch`` x ``seq_len`` on one
    device, ``block_params`` / ``embed_params`` the stages' param counts, ``backend``
    the XLA backend ("cpu": fitted per dtype; else the fp32 fit scaled, see above), which
    also picks the attention (:func:`block_attention`); ``attentions``: a block's
    attention layers (a T5 decoder block's two hold two score matrices). ``chunks``:
    the recomputed blocks and the head run the micro-batch in that many chunks of rows
    (``offload.batch_chunks``, ``runtime/stages/chunks.py``): their activation terms are one
    chunk's, their param terms unchanged (the gradients summed in place); x / dx stay
    the whole micro-batch's. Checked against the compiled chunked stages by
    tests/test_planner.py."""
    c = 2 if m.compute_dtype in ("bfloat16", "float16") else 4
    fitted = c if backend == "cpu" else 4
    scaled = c / 4 if backend != "cpu" else 1.0  # dots in the compute dtype; scores fp32
    whole = batch * seq_len  # the micro-batch's tokens: x / dx
    batch //= chunks  # one chunk's rows: what a stage's temporaries hold at once
    tokens, D, V, H = batch * seq_len, m.d_model, m.vocab_size, m.num_heads
    impl = block_attention(m, backend)
    if impl == "reference":
        families = [m.family] if m.family in ("gpt", "llama") else ["gpt", "llama"]
        fits = [_BLOCK_TEMPS[f, fitted] for f in families]
        act, score, param = (max(fit[i] for fit in fits) for i in range(3))
        scores = attentions * batch * H * seq_len**2 * score
        block = tokens * D * act * scaled + scores + block_params * param * scaled
    else:
        act, mlp, tile, param = _BLOCKWISE_TEMPS[m.family, fitted]
        b = attention.block_size(m.attention_block, seq_len) if impl == "blockwise" else 0
        per_token = D * act + m.ff_dim * mlp
        block = (tokens * per_token + block_params * param) * scaled + batch * H * b * b * tile
    logit, head = _HEAD_TEMPS[fitted]
    head_fwd_bwd = tokens * V * logit + V * D * head
    # the embedding's gradient, fp32, and before that in the compute dtype
    embed_bwd = embed_params * (4 + (c if c < 4 else 0))
    return int(max(block, head_fwd_bwd, embed_bwd) + 3 * whole * D * c)
