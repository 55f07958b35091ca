"""The declared layout of every stage function (``stages.py``, ``routed.py``): what each
of its arguments and results is (``hetjax.types.Kind``), by which the placement's compute
layout (``hetjax.types.Parallelism``: one device, or ZeRO-3 over a mesh) compiles it,
places its arguments and reduces its results, never by their ranks."""

from __future__ import annotations

from hetjax.types import Kind, StageSignature

_P, _X, _C, _G = Kind.PAGES, Kind.BATCH, Kind.CONTEXT, Kind.GRAD
_W, _M, _L = Kind.WHOLE, Kind.MEAN, Kind.LOCAL
# Each stage function's declared layout: its arguments' kinds, then its results'
# (hetjax.types.Kind). b/e/h: a stage's pages; x, dx, dy: activations (B, T, D); prev:
# the previous group's output (or None); c, dc: a group's context and its gradient;
# stats: a block's auxiliary-loss statistics (means over its rows), dstats their
# cotangent; (db, norms): a gradient leaving the device.
SIGNATURES: dict[str, StageSignature] = {
    # (e, tokens) -> x
    "embed_fwd": StageSignature((_P, _X), _X),
    # (e, tokens, dx) -> (de, norms)
    "embed_bwd": StageSignature((_P, _X, _X), _G),
    # (e, prev, tokens, targets) -> (x, c)
    "input_fwd": StageSignature((_P, _X, _X, _X), (_X, _C)),
    # (e, prev, tokens, targets, dx, dc) -> ((de, norms), dprev)
    "input_bwd": StageSignature((_P, _X, _X, _X, _X, _C), (_G, _X)),
    # (b, x, c) -> (y, stats)
    "block_fwd": StageSignature((_P, _X, _C), (_X, _M)),
    # (b, x, dy, dstats, c, dc) -> ((db, norms), dx, dc)
    "block_bwd": StageSignature((_P, _X, _X, _W, _C, _C), (_G, _X, _C)),
    # (b, x, c) -> ((y, stats), vjp): the vjp's residuals stay on the device that made them
    "kept_forward": StageSignature((_P, _X, _C), ((_X, _M), _L)),
    # (vjp, dy, dstats, dc) -> ((db, norms), dx, dc)
    "block_bwd_kept": StageSignature((_L, _X, _W, _C), (_G, _X, _C)),
    # (b, x, c) -> ((y, stats), residuals)
    "swapped_forward": StageSignature((_P, _X, _C), ((_X, _M), _L)),
    # (b, residuals, dy, dstats, c, dc) -> ((db, norms), dx, dc)
    "swapped_backward": StageSignature((_P, _L, _X, _W, _C, _C), (_G, _X, _C)),
    # c -> zeros shaped as c
    "zero_context": StageSignature((_C,), _C),
    # (h, e, x, targets) -> loss
    "head_loss": StageSignature((_P, _P, _X, _X), _M),
    # (h, e, x, targets, scale) -> (loss, (dh, norms), (de, norms), dx)
    "head_fwd_bwd": StageSignature((_P, _P, _X, _X, _W), (_M, _G, _G, _X)),
    # (loss, [stats of each block], seed) -> (loss + aux loss, dstats)
    "aux_fwd_bwd": StageSignature((_W, _W, _W), (_M, _M)),
    # routed blocks (routed.py, routed_zero.py): (b, x, c) -> (x_mid, top_e, counts);
    # counts the devices' mean: nonzero for an expert any device routed to
    "routed_route": StageSignature((_P, _X, _C), (_X, _X, _M)),
    # (b, x_mid, top_e, slots, c) -> (y, stats)
    "routed_mlp": StageSignature((_P, _X, _X, _W, _C), (_X, _M)),
    # (b, ids, top_e, slots, x, dy, dstats, c, dc) -> ((db, norms), dx, dc)
    "routed_backward": StageSignature((_P, _W, _X, _W, _X, _X, _W, _C, _C), (_G, _X, _C)),
}
