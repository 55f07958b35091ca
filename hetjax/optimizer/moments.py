"""Moments kept in fewer bytes (``optimizer.state_dtype``): the codes and the optax wrapper.

The optimizer computes in float32 whatever the format: a step widens the moments it
reads, updates them as in fp32 and rounds what it keeps (``state_format.py`` says how
each kind is stored). Two formats besides fp32:

* ``bfloat16``: rounded to nearest even (XLA's convert, ml_dtypes' ``astype``).
* ``int8``, blockwise: each block of :data:`~hetjax.state_format.INT8_BLOCK`
  elements keeps its absolute maximum as an fp32 scale and each element the index of the
  nearest entry of a logarithmic code of the value divided by that scale, ties to the
  smaller magnitude (dynamic quantisation, as 8-bit optimizers do: Dettmers et al.,
  "8-bit Optimizers via Block-wise Quantization"). In a host slab the blocks start at
  each page's first element (a page not whole blocks ends in a short block of its own),
  so a page's blocks are the same in any chunk, device's shard or page file. A signed
  moment (``mu``) uses ``±2**((k - 127) / 8)``, ``k`` in 1..127, and 0 (its smallest
  magnitude 1.9e-5 of the block's maximum); Adam's ``nu`` is never negative and uses 255
  codes ``2**((k - 255) / 8)`` (stored as the byte ``k``, smallest 3.4e-10 of the
  maximum); a positive ``nu`` maps to at least the smallest code, never to 0, so no
  element's denominator ``sqrt(nu) + eps`` collapses to ``eps``. A block of zeros has
  scale 0.

:func:`low_precision` wraps an optax transformation so its moments are kept in a
format (the in-memory runtime, ``offload.mode=none``, and the host optimizer's jitted
path, ``slab.py``); tests/test_state_dtype.py checks each code against a numpy
reference written from this description.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.state_format import INT8_BLOCK, KindFormat

F32 = jnp.float32
UNSIGNED_KINDS = ("nu",)  # moments that are never negative (Adam's second moment)


def _code(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The code's magnitudes by index (float32; index 0 is 0) and the midpoints between
    neighbours (``mid[i]`` between entries ``i`` and ``i + 1``), each computed in
    float64 and rounded once."""
    top = 127 if signed else 255
    k = np.arange(top + 1, dtype=np.float64)
    values = np.where(k == 0, 0.0, 2.0 ** ((k - top) / 8))
    mids = (values[:-1] + values[1:]) / 2
    return values.astype(np.float32), mids.astype(np.float32)


SIGNED_CODE = _code(signed=True)
UNSIGNED_CODE = _code(signed=False)


@flax.struct.dataclass
class Int8Blocks:
    """A moment in int8 blocks: ``codes`` (int8, the moment's shape; an unsigned
    moment's bytes read as uint8) and ``scales`` (float32, one per block of the
    flattened moment)."""

    codes: jax.Array
    scales: jax.Array


def _blocks(x: jax.Array, page: int | None) -> jax.Array:
    """A moment flattened and zero-padded to whole blocks: (blocks, INT8_BLOCK). With
    ``page``, the blocks restart at each page (of ``page`` elements; the size a
    multiple of it): each page zero-padded to whole blocks of its own."""
    rows = x.reshape(-1) if page is None else x.reshape(-1, page)
    pad = -rows.shape[-1] % INT8_BLOCK
    return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, pad)]).reshape(-1, INT8_BLOCK)


def _unblock(blocks: jax.Array, n: int, page: int | None) -> jax.Array:
    """:func:`_blocks`' inverse: the first ``n`` elements (of each page)."""
    if page is None:
        return blocks.reshape(-1)[:n]
    return blocks.reshape(n // page, -1)[:, :page].reshape(-1)


def scale_count(elems: int, page: int | None = None) -> int:
    """Scales of ``elems`` elements: a block of ``INT8_BLOCK`` from the first (and with
    ``page``, from each page's first)."""
    if page is None:
        return -(-elems // INT8_BLOCK)
    return elems // page * -(-page // INT8_BLOCK)


def _nearest(y: jax.Array, mids: np.ndarray) -> jax.Array:
    """The index of the code entry nearest ``y`` (>= 0), ties to the smaller: the number
    of midpoints below ``y``. Estimated from ``log2`` (the code is logarithmic, 8
    entries an octave), then corrected by one comparison each way against the
    midpoints, which decide: a binary search's answer at the cost of two gathers."""
    top = mids.shape[0]
    below = jnp.asarray(np.concatenate([[-np.inf], mids]), F32)  # below[k]: between k-1, k
    above = jnp.asarray(np.concatenate([mids, [np.inf]]), F32)  # above[k]: between k, k+1
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    k = jnp.round(8 * jnp.log2(jnp.maximum(y, tiny))) + top
    k = jnp.clip(k, 0, top).astype(jnp.int32)
    k = k + (y > above[k])
    return k - (y <= below[k])


def quantize(x: jax.Array, signed: bool, page: int | None = None) -> Int8Blocks:
    """``x`` (float32, any shape) as int8 blocks (module docstring); with ``page``, the
    blocks restart at every page of ``page`` elements (a host slab's chunk)."""
    _, mids = SIGNED_CODE if signed else UNSIGNED_CODE
    blocks = _blocks(x.astype(F32), page)  # (N, B)
    scales = jnp.max(jnp.abs(blocks), axis=1)  # (N,)
    safe = jnp.where(scales == 0, jnp.float32(1), scales)
    y = jnp.abs(blocks) / safe[:, None]
    k = _nearest(y, mids)
    if not signed:
        k = jnp.where(y > 0, jnp.maximum(k, 1), 0)
        codes = k.astype(jnp.uint8).view(jnp.int8)
    else:
        codes = jnp.where(blocks < 0, -k, k).astype(jnp.int8)
    codes = _unblock(codes, x.size, page).reshape(x.shape)
    return Int8Blocks(codes, scales)


def dequantize(q: Int8Blocks, signed: bool, page: int | None = None) -> jax.Array:
    """The float32 moment int8 blocks hold: the code's value times the block's scale
    (``page``: as :func:`quantize`'s)."""
    values, _ = SIGNED_CODE if signed else UNSIGNED_CODE
    n = q.codes.size
    codes = _blocks(q.codes, page)  # (N, B)
    if signed:
        k = jnp.abs(codes.astype(jnp.int32))
        value = jnp.where(codes < 0, -1, 1) * jnp.asarray(values)[k]
    else:
        value = jnp.asarray(values)[codes.view(jnp.uint8).astype(jnp.int32)]
    return _unblock(value * q.scales[:, None], n, page).reshape(q.codes.shape)


def elements(slab: Any, start: int, stop: int, page: int) -> Any:
    """Elements ``[start, stop)`` of a kind's flat host slab (numpy; whole pages of
    ``page`` elements): a view; of int8 blocks (blocks from each page's first element),
    the codes' and their pages' scales."""
    if not isinstance(slab, Int8Blocks):
        return slab[start:stop]
    assert start % page == 0 and stop % page == 0, (start, stop, page)
    first, last = scale_count(start, page), scale_count(stop, page)
    return Int8Blocks(slab.codes[start:stop], slab.scales[first:last])


def encode(x: jax.Array, fmt: KindFormat, signed: bool, page: int | None = None) -> Any:
    """A float32 moment in ``fmt`` (``page``: as :func:`quantize`'s)."""
    if fmt.block_size is not None:
        return quantize(x, signed, page)
    return x.astype(fmt.dtype)


def decode(x: Any, signed: bool, page: int | None = None) -> jax.Array:
    """A moment in its format, as float32 (exact for bfloat16)."""
    if isinstance(x, Int8Blocks):
        return dequantize(x, signed, page)
    return x.astype(F32)


def _signed(path) -> bool:
    names = {str(getattr(p, "name", getattr(p, "key", ""))) for p in path}
    return not names & set(UNSIGNED_KINDS)


def _is_moment(leaf) -> bool:
    return isinstance(leaf, Int8Blocks) or (
        jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.ndim(leaf) > 0
    )


def encode_state(state: Any, fmt: KindFormat) -> Any:
    """Every moment (params-shaped float leaf) of an optax state in ``fmt``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: encode(x, fmt, _signed(path)) if _is_moment(x) else x, state
    )


def decode_state(state: Any) -> Any:
    """An optax state with its moments back in float32."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: decode(x, _signed(path)) if _is_moment(x) else x,
        state,
        is_leaf=lambda x: isinstance(x, Int8Blocks),
    )


def low_precision(tx: optax.GradientTransformation, fmt: KindFormat):
    """``tx`` with its moments kept in ``fmt``: each update widens them to float32,
    runs ``tx`` and rounds (or quantizes) the new ones. ``fmt`` float32: ``tx``."""
    if fmt.dtype == np.float32 and fmt.block_size is None:
        return tx

    def init(params):
        return encode_state(tx.init(params), fmt)

    def update(updates, state, params=None):
        updates, new = tx.update(updates, decode_state(state), params)
        return updates, encode_state(new, fmt)

    return optax.GradientTransformation(init, update)
