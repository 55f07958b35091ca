"""A stage function run over its micro-batch in chunks of rows (``offload.batch_chunks``).

A block's backward holds temporaries that grow with the micro-batch's tokens (the MLP's
(B, T, F) activation and its gradient, the attention's q, k, v and theirs...), and so
does the head's (the (B, T, V) logits). Run over the micro-batch's rows in ``n`` equal
chunks, one after the other inside the same jit (a ``lax.scan``), a stage holds one
chunk's: the working set's activation terms shrink by ``n`` while the stage's params
stay on the device for every chunk, so they are streamed once a micro-batch as before.
(``train.grad_accum`` splits the batch too, but each micro-batch streams every stage's
params again.)

The gradient of a stage's params is the sum of its chunks' gradients, accumulated in
place in the gradient slab the backward returns (the loop's carry is the result):
nothing param-sized is added to the working set. The sum is exact in fp32 up to
reassociation; in bf16 (``memory.block_grad_dtype``) each chunk's gradient is rounded
to bf16 before the sum, ``n`` roundings where the whole micro-batch's dot rounds once.

Only for blocks whose rows are independent: no statistics pooled over the micro-batch
(a mixture of experts' auxiliary loss and capacity), no context but one of rows (a
packed row's positions, ``data.format=jsonl``), which splits with them; not T5's
encoder output and bias table.
A stage's results are the whole micro-batch's: rows concatenated, the loss the chunks'
means weighted by their share of the micro-batch's tokens that take a loss
(:func:`loss_weights`): the micro-batch's mean over those tokens, whether every token
takes one (equal chunks: each weighs 1/n) or only some do (``data.format=jsonl``'s
completion tokens: a chunk of prompts only weighs 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax import support
from hetjax.config import ConfigError


def split(a: jax.Array, n: int) -> jax.Array:
    """(B, ...) -> (n, B / n, ...): the chunks a scan runs over."""
    if a.shape[0] % n:  # (the config checks it where it knows the devices)
        raise ConfigError(
            f"config key 'offload.batch_chunks' ({n}) must divide a device's rows of a "
            f"micro-batch ({a.shape[0]}); choose a divisor of it"
        )
    return a.reshape(n, a.shape[0] // n, *a.shape[1:])


def join(a: jax.Array) -> jax.Array:
    """(n, B / n, ...) -> (B, ...)."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def check(model, n: int) -> None:
    """Raises ``ConfigError`` when ``model``'s blocks cannot run in ``n`` chunks of rows
    (the support matrix's model axis, ``support.model_kinds_of``: a custom model reaches
    this without the config's check)."""
    if n > 1 and (why := support.model_refusal("batch_chunks", support.model_kinds_of(model), n)):
        raise ConfigError(why)


def split_rows(context, n: int):
    """A block's context of rows (every leaf (B, ...): a packed row's positions; or
    none) -> its ``n`` chunks (every leaf (n, B / n, ...))."""
    return jax.tree.map(lambda c: split(c, n), context)


def forward(block_fwd, n: int):
    """``block_fwd(b, x, context) -> (y, stats)`` over ``n`` chunks of x's rows (and
    of the context's: :func:`split_rows`)."""

    def run(b, x, context=()):
        one = lambda rows: block_fwd(b, *rows)
        y, stats = jax.lax.map(one, (split(x, n), split_rows(context, n)))
        return join(y), jnp.mean(stats, axis=0)

    return run


def backward(block_fwd, n: int, cotangent, grad_pages, dtype):
    """A block's backward over ``n`` chunks of rows: each chunk recomputes its inside
    from its rows of the input, then runs its vjp; the param gradient pages
    (``grad_pages(db)``) are summed over the chunks in ``dtype``, in place. Returns
    ``(gradient pages, dx, dcontext)`` as the whole block's backward: the context of
    rows (:func:`split_rows`) takes no gradient (a packed row's positions), its sum so
    far ``dcontext`` is returned as it came."""

    def run(b, x, dy, dstats=None, context=(), dcontext=()):
        # the statistics are the chunks' mean (forward): each chunk's gets 1/n of theirs
        dstats = None if dstats is None else dstats / n

        def chunk(acc, rows):
            xc, dyc, cc = rows
            _, vjp = jax.vjp(block_fwd, b, xc, cc)
            db, dx, _ = vjp(cotangent(dyc, dstats))
            pages = grad_pages(db)  # a list of pages, or a grouped stage's GroupPages
            return jax.tree.map(lambda a, p: a + p.astype(dtype), acc, pages), dx

        shapes = jax.eval_shape(grad_pages, _abstract(b))
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), shapes)
        db, dx = jax.lax.scan(chunk, zeros, (split(x, n), split(dy, n), split_rows(context, n)))
        return db, join(dx), dcontext

    return run


def _abstract(b):
    """Abstract shapes of a pytree of arrays (the gradient is structured as the params)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), b)


def loss_weights(targets: jax.Array, n: int) -> jax.Array:
    """Each of ``n`` chunks' weight in the micro-batch's mean token loss, (n,) fp32: its
    targets that take a loss (``>= 0``; ``models.staged.IGNORED`` ones do not) over the
    micro-batch's (none: 0 each). A chunk's loss is the mean over its own such tokens,
    so the weighted sum of the chunks' is the micro-batch's mean."""
    taken = jnp.sum((split(targets, n) >= 0).reshape(n, -1), axis=1).astype(jnp.float32)
    return taken / jnp.maximum(jnp.sum(taken), 1.0)


def head_loss(head_loss, n: int):
    """``head_loss(h, e, x, targets)`` (a mean token loss) over ``n`` chunks of rows:
    the micro-batch's mean (:func:`loss_weights`)."""

    def run(h, e, x, targets):
        one = lambda rows: head_loss(h, e, *rows)
        losses = jax.lax.map(one, (split(x, n), split(targets, n)))
        return jnp.sum(losses * loss_weights(targets, n))

    return run


def head_backward(head_loss, n: int, head_pages, embed_pages):
    """The head's loss and backward over ``n`` chunks of rows: ``head_loss(h, e, x,
    targets)`` the mean token loss. Returns ``(loss, dh pages, de pages, dx)``: the
    loss the chunks' weighted by :func:`loss_weights` (the micro-batch's mean), the
    param gradients summed in fp32 in place. ``head_pages(dh)`` / ``embed_pages(de)``
    lay a gradient out in pages."""

    def run(h, e, x, targets, scale):
        def chunk(acc, rows):
            xc, tc, w = rows
            loss, vjp = jax.vjp(lambda h, e, x: head_loss(h, e, x, tc), h, e, xc)
            dh, de, dx = vjp(scale * w)  # d(weighted sum of means) / d(one chunk's mean)
            dh, de = head_pages(dh), embed_pages(de)
            acc_h, acc_e, total = acc
            add = lambda acc, g: jax.tree.map(lambda a, p: a + p.astype(a.dtype), acc, g)
            return (add(acc_h, dh), add(acc_e, de), total + w * loss.astype(jnp.float32)), dx

        zeros = lambda pages, tree: jax.tree.map(  # pages, or a grouped stage's GroupPages
            lambda p: jnp.zeros(p.shape, jnp.float32), jax.eval_shape(pages, _abstract(tree))
        )
        start = (zeros(head_pages, h), zeros(embed_pages, e), jnp.zeros((), jnp.float32))
        weights = loss_weights(targets, n)
        chunked = (split(x, n), split(targets, n), weights)
        (dh, de, total), dx = jax.lax.scan(chunk, start, chunked)
        return total, dh, de, join(dx)

    return run
