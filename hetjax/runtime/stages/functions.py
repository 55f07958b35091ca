"""The per-stage jitted functions the streaming runtime runs (and the tracer times); the
slab layouts of a model's stages are ``parallel/layouts.py``'s.

Each function takes its stage's params as a list of pages and unflattens them inside
the jit (``storage/pages.py``). Each is compiled by the run's parallelism
(``hetjax.types.Parallelism``: one device, or ZeRO-3 over a mesh) from its declared
signature (``signatures.SIGNATURES``: what each argument and result is), never from its
arrays' ranks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from hetjax.runtime.experts.routed import RoutedBlock
from hetjax.runtime.stages import chunks, remat
from hetjax.runtime.stages.measure import StageMeasurements
from hetjax.runtime.stages.signatures import SIGNATURES
from hetjax.storage.pages import SlabLayout
from hetjax.types import Parallelism

F32 = jnp.float32


def page_squared_norms(grad) -> jax.Array:
    """Inside a backward's jit: the squared L2 norm (float32) of each page of a gradient
    as ``grad_slab`` shapes it (a list of pages, or a ``(pages, page_elems)`` array: a
    device's shard under ZeRO-3), as a ``(pages,)`` vector. One reduction fused with the
    gradient's last pass, where a host would read the whole gradient again."""
    if isinstance(grad, (list, tuple)):
        return jnp.stack([jnp.sum(jnp.square(p.astype(F32))) for p in grad])
    return jnp.sum(jnp.square(grad.astype(F32)), axis=-1)


class SwappedBlock:
    """A block whose in-block activations go to host memory between its forward and its
    backward (Fuyou's activation swapping, section 4.4; ``offload.swap_blocks``).

    ``forward(pages, x, context=()) -> (y, residuals)``: the vjp's residuals at the keep
    ``level`` (remat.py: the block's input and the activations the level saves) without
    the param pages, which the window fetches again for backward instead of holding
    them, and without its group's context, which stays on the device. The runtime copies
    the residuals to ``pinned_host`` as soon as forward made them and back to the device
    ahead of backward. ``backward(pages, residuals, dy, dstats=None, context=(),
    dcontext=()) -> ((db, its norms), dx, dcontext + the block's)`` rebuilds the vjp from
    the pages, the context and the residuals and applies it to dy and the
    auxiliary-loss statistics' cotangent (``cotangent``, as :class:`GroupFunctions`'
    other backwards): what the level did not save is recomputed, as in a kept block at
    that level, so the result is the kept block's."""

    def __init__(self, block_fwd, level: str, cast, cotangent, jit):
        fwd = remat.kept_forward(block_fwd, level)
        # The vjp's structure and which of its leaves are the param pages or the context
        # (by identity with the traced arguments): fixed by the forward's trace, used by
        # the backward's.
        self._structure: tuple | None = None

        def forward(b, x, context=()):
            y, vjp = jax.vjp(fwd, b, x, context)
            leaves, tree = jax.tree.flatten(vjp)
            # every array of the pages, however they came (one device's leaves, ZeRO-3's
            # pages, a grouped stage's dense pages and its group: tensor parallelism's)
            given = jax.tree.leaves((b, context))
            given_at = {id(a): k for k, a in enumerate(given)}
            where = tuple(given_at.get(id(leaf), -1) for leaf in leaves)
            self._structure = (tree, where)
            return y, [leaf for leaf, k in zip(leaves, where, strict=True) if k < 0]

        def backward(b, residuals, dy, dstats=None, context=(), dcontext=()):
            if self._structure is None:  # traced before any forward (e.g. compiled ahead)
                jax.eval_shape(forward, b, dy, context)
            tree, where = self._structure
            given = jax.tree.leaves((b, context))
            rest = iter(residuals)
            leaves = [given[k] if k >= 0 else next(rest) for k in where]
            db, dx, dc = jax.tree.unflatten(tree, leaves)(cotangent(dy, dstats))
            return cast(db), dx, jax.tree.map(jnp.add, dcontext, dc)

        self._forward = forward
        self.forward = jit(forward, SIGNATURES["swapped_forward"])
        self.backward = jit(backward, SIGNATURES["swapped_backward"])

    def residual_bytes(self, pages, x, context=()) -> int:
        """Bytes of the residuals ``forward`` returns, from abstract shapes."""
        _, residuals = jax.eval_shape(self._forward, pages, x, context)
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in residuals)


class GroupFunctions:
    """The jitted functions of one stage group (``models/staged.py``): its input and its
    blocks. ``context`` is the group's context (empty for GPT's and Llama's one group),
    an argument of every block function; backwards take the sum of the blocks'
    gradients of it so far (``dcontext``, backward order) and return it with theirs
    added, so that after the group's first block it is the whole sum the input's
    backward needs.

    ``input_fwd(e, prev, tokens, targets) -> (x, context)`` makes the group's input
    from the embed pages and the previous group's output ``prev`` (None for the first
    group); ``input_bwd(e, prev, tokens, targets, dx, dcontext) -> ((de, its norms),
    dprev)`` its backward, a gradient of the embed stage. ``block_fwd(b, x, context)``
    returns the block's output and its auxiliary-loss statistics; ``block_bwd``
    recomputes the block's inside from its input boundary, then runs its vjp;
    ``block_fwd_keep`` instead returns the vjp (its residuals: the in-block activations
    ``keep_level`` keeps, ``remat.py``) with the output, and ``block_bwd_kept`` applies
    it, recomputing only what the level did not keep, for the cost of holding the
    residuals on the device until backward (``offload.keep_blocks``).
    ``kept_forward(level)`` is ``block_fwd_keep`` at any level (the tracer times each).
    With ``batch_chunks`` > 1, ``block_fwd`` and ``block_bwd`` run the micro-batch's
    rows in that many chunks (``chunks.py``), their block gradient summed in
    ``grad_dtype``; kept and swapped blocks run whole (the config allows neither with
    chunks)."""

    def __init__(
        self, model, g: int, layouts, *, jit, out, cast, keep_level: str, batch_chunks: int = 1,
        grad_dtype=F32, constrain=lambda stage, params: params,
    ):  # fmt: skip
        # jit(fn, signature): the parallelism's (hetjax.types.Parallelism.jit)
        m, group = model, model.groups[g]
        E, B = layouts["embed"], layouts[group.name]
        # a stage's params as the parallelism computes with them (tensor parallelism:
        # split by their logical axes; else as they are)
        params = lambda stage, layout, pages: constrain(stage, layout.unflatten_pages(pages))
        self.group, self.index, self.layout = group, g, B
        F32_stats = lambda: jnp.zeros((m.stats_size,), F32)

        def input_fwd(e, prev, tokens, targets):  # -> ((B, T, D), context)
            return m.group_input(g, params("embed", E, e), prev, tokens, targets)

        def input_bwd(e, prev, tokens, targets, dx, dcontext):
            _, vjp = jax.vjp(lambda e, prev: input_fwd(e, prev, tokens, targets), e, prev)
            de, dprev = vjp((dx, dcontext))
            return out(E.grad_pages(de)), dprev

        block_grad = lambda db: cast(B.grad_pages(db))  # pages, whichever way b came

        def block_fwd(b, x, context=()):  # (B, T, D) -> ((B, T, D), aux statistics (S,))
            return m.group_block(g, params(group.name, B, b), x, context)

        def cotangent(dy, dstats=None):  # of block_fwd's results; None: no auxiliary loss
            return dy, F32_stats() if dstats is None else dstats

        def block_bwd(b, x, dy, dstats=None, context=(), dcontext=()):
            _, vjp = jax.vjp(block_fwd, b, x, context)  # recompute the inside, then its vjp
            db, dx, dc = vjp(cotangent(dy, dstats))
            return block_grad(db), dx, jax.tree.map(jnp.add, dcontext, dc)

        def block_bwd_kept(vjp, dy, dstats=None, dcontext=()):
            db, dx, dc = vjp(cotangent(dy, dstats))
            return block_grad(db), dx, jax.tree.map(jnp.add, dcontext, dc)

        n = batch_chunks
        run_fwd, run_bwd = block_fwd, block_bwd
        if n > 1:
            run_fwd = chunks.forward(block_fwd, n)
            in_chunks = chunks.backward(block_fwd, n, cotangent, B.grad_pages, grad_dtype)

            def run_bwd(b, x, dy, dstats=None, context=(), dcontext=()):
                db, dx, dc = in_chunks(b, x, dy, dstats, context, dcontext)
                return cast(db), dx, dc

        self.input_fwd = jit(input_fwd, SIGNATURES["input_fwd"])
        self.input_bwd = jit(input_bwd, SIGNATURES["input_bwd"])
        self.block_fwd = jit(run_fwd, SIGNATURES["block_fwd"])
        self.block_bwd = jit(run_bwd, SIGNATURES["block_bwd"])
        self.block_bwd_kept = jit(block_bwd_kept, SIGNATURES["block_bwd_kept"])  # any level's
        # the first backward's sum so far: zeros shaped as the context
        zeros = lambda context: jax.tree.map(jnp.zeros_like, context)
        self.zero_context = jit(zeros, SIGNATURES["zero_context"])
        self._block_fwd, self._kept_forward, self._swapped = block_fwd, {}, {}
        self._cast, self._cotangent = block_grad, cotangent
        self._model, self._jit, self._routed = m, jit, None
        self._params = lambda b: params(group.name, B, b)  # (the routed block's)
        self.block_fwd_keep = self.kept_forward(keep_level)

    def kept_forward(self, level: str):
        """The jitted forward of a kept block at keep ``level``: (b, x, context=()) ->
        (y, the vjp holding the residuals), compiled by the parallelism as any stage
        function (the vjp a ``Kind.LOCAL`` result: each device keeps its own)."""
        if level not in self._kept_forward:
            fwd = remat.kept_forward(self._block_fwd, level)
            kept = lambda b, x, c=(): jax.vjp(fwd, b, x, c)
            self._kept_forward[level] = self._jit(kept, SIGNATURES["kept_forward"])
        return self._kept_forward[level]

    def swapped(self, level: str) -> SwappedBlock:
        """The forward and backward of a block that swaps its in-block activations at
        ``level`` to host memory (``offload.swap_blocks``), compiled by the
        parallelism (the residuals ``Kind.LOCAL``)."""
        if level not in self._swapped:
            self._swapped[level] = SwappedBlock(
                self._block_fwd, level, self._cast, self._cotangent, self._jit
            )
        return self._swapped[level]

    def routed(self) -> RoutedBlock:
        """The functions of this group's block streamed expert-aware (``routed.py``):
        one device, a model with ``expert_routing``."""
        if self._routed is None:
            # RoutedBlock compiles its route, mlp and backward by name
            jit = lambda fn: self._jit(fn, SIGNATURES[f"routed_{fn.__name__}"])
            self._routed = RoutedBlock(
                self._model, self.index, self.layout, jit, self._cast, self._cotangent,
                unflatten=self._params,
            )  # fmt: skip
        return self._routed


class StageFunctions(StageMeasurements):
    """The jitted per-stage functions the streaming runtime runs (and the tracer times).
    Each takes its stage's params as a list of pages and unflattens them inside the jit.

    ``groups[g]`` are stage group g's input and block functions (:class:`GroupFunctions`);
    ``block_fwd``, ``block_bwd``, ``embed_fwd`` and the like are the first group's, the
    one group of GPT and Llama (``embed_fwd(e, tokens)`` its input, ``embed_bwd(e,
    tokens, dx)`` that input's backward with an empty context). Blocks return their
    auxiliary-loss statistics (``models/staged.py``; length 0 for a block without),
    ``aux_fwd_bwd`` adds the auxiliary loss of their sum over blocks to the loss and
    returns the statistics' cotangent, which every block's backward takes besides dy (a
    model without an auxiliary loss, ``stats_size`` 0, needs neither). Both declare those
    results means over the batch (``Kind.MEAN`` in ``signatures.SIGNATURES``).

    ``parallel`` (a :class:`~hetjax.types.Parallelism`: ``SingleDevice``, ``Zero3``)
    compiles every stage function from its signature in ``signatures.SIGNATURES`` (one device:
    ``jax.jit`` onto it; ZeRO-3: per device with collectives) and its ``grad_slab(pages,
    dtype)`` shapes a gradient as it leaves the device; block gradients leave in
    ``block_grad_dtype``. ``kept_blocks``
    false: no block keeps or swaps its activations (ZeRO-3's; an expert-parallel block
    runs only inside its ``jit``), so :meth:`memory_sizes` does not size them. Every backward
    returns each gradient as ``(gradient, its pages' squared norms)``
    (:func:`page_squared_norms`): the host never takes a norm of a gradient the device
    already holds (``grads.py``). ``batch_chunks`` > 1: the blocks' streamed forward and
    backward and the head run the micro-batch in that many chunks of rows
    (``chunks.py``: the working set of one chunk, the params fetched once).
    """

    def __init__(
        self,
        model,
        layouts: dict[str, SlabLayout],
        parallel: Parallelism,
        *,
        block_grad_dtype=F32,
        keep_level: str = "all",
        kept_blocks: bool = True,
        batch_chunks: int = 1,
    ):
        E, H = layouts["embed"], layouts["head"]
        chunks.check(model, batch_chunks)
        self.parallel = parallel
        self.kept_blocks, self.batch_chunks = kept_blocks, batch_chunks

        jit = parallel.jit

        def out(pages, dtype=F32):  # a gradient as it leaves the device, and its norms
            grad = parallel.grad_slab(pages, dtype)
            return grad, page_squared_norms(grad)

        cast = lambda pages: out(pages, block_grad_dtype)
        self.layouts, self.model = layouts, model
        m = model
        self.stats_size = m.stats_size  # 0: no auxiliary loss (aux_fwd_bwd is not needed)
        group = functools.partial(
            GroupFunctions, jit=jit, out=out, cast=cast, keep_level=keep_level,
            batch_chunks=batch_chunks, grad_dtype=block_grad_dtype, constrain=parallel.constrain,
        )  # fmt: skip
        self.groups = [group(m, g, layouts) for g in range(len(m.groups))]
        first = self.groups[0]

        def head_loss(h, e, x, targets):
            return m.head_loss(
                parallel.constrain("head", H.unflatten_pages(h)),
                parallel.constrain("embed", E.unflatten_pages(e)),
                x,
                targets,
            )

        def head_fwd_bwd(h, e, x, targets, scale):
            if batch_chunks > 1:
                run = chunks.head_backward(head_loss, batch_chunks, H.grad_pages, E.grad_pages)
                loss, dh, de, dx = run(h, e, x, targets, scale)
                return loss, out(dh), out(de), dx
            loss, vjp = jax.vjp(lambda h, e, x: head_loss(h, e, x, targets), h, e, x)
            dh, de, dx = vjp(scale)  # scale: the fp16 loss scale, else 1
            return loss, out(H.grad_pages(dh)), out(E.grad_pages(de)), dx

        def aux_fwd_bwd(loss, stats, seed):  # from the averaged loss and statistics alone
            # The auxiliary loss of the blocks' summed statistics, added to the loss, and
            # its gradient: every block's statistics get the same cotangent.
            aux, dstats = jax.value_and_grad(m.aux_loss)(sum(stats, jnp.zeros(m.stats_size, F32)))
            return loss + aux, dstats * seed

        def embed_fwd(e, tokens):  # the first group's input: (B, T) -> (B, T, D)
            embed = parallel.constrain("embed", E.unflatten_pages(e))
            return m.group_input(0, embed, None, tokens, tokens)[0]

        def embed_bwd(e, tokens, dx):
            _, vjp = jax.vjp(lambda e: embed_fwd(e, tokens), e)
            return out(E.grad_pages(vjp(dx)[0]))

        sig = SIGNATURES
        chunked_loss = chunks.head_loss(head_loss, batch_chunks)  # the micro-batch's mean
        self.head_loss = jit(chunked_loss if batch_chunks > 1 else head_loss, sig["head_loss"])
        self.head_fwd_bwd = jit(head_fwd_bwd, sig["head_fwd_bwd"])
        self.aux_fwd_bwd = jit(aux_fwd_bwd, sig["aux_fwd_bwd"])
        self.embed_fwd = jit(embed_fwd, sig["embed_fwd"])
        self.embed_bwd = jit(embed_bwd, sig["embed_bwd"])
        self.block_fwd, self.block_bwd = first.block_fwd, first.block_bwd
        self.block_fwd_keep, self.block_bwd_kept = first.block_fwd_keep, first.block_bwd_kept
        self.kept_forward, self.swapped = first.kept_forward, first.swapped
