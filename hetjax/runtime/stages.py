"""The per-stage jitted functions the streaming runtime runs (and the tracer times), and
the slab layouts of a model's stages.

Each function takes its stage's params as a list of pages and unflattens them inside
the jit (``storage/pages.py``)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hetjax.config import SWAP_LEVELS, ConfigError
from hetjax.runtime import remat
from hetjax.runtime.experts import ExpertSlabLayout
from hetjax.storage.pages import MASTER_ITEMSIZE, SlabLayout, fitted_page_elems

F32 = jnp.float32


def stage_layouts(
    model, page_size: int, page_multiple: int = 1, expert_parallel: int = 1
) -> dict[str, SlabLayout | ExpertSlabLayout]:
    """The slab layouts of a model's stages (``embed``, one ``block``, ``head``), from
    abstract shapes: nothing is allocated. Pages are at most ``page_size`` bytes, fitted
    to the block (``pages.fitted_page_elems``); slabs pad to a multiple of
    ``page_multiple`` pages (ZeRO-3: one equal share per device). With
    ``expert_parallel`` > 1 (of the ``page_multiple`` devices) the block's experts are
    laid out in that many groups (``experts.ExpertSlabLayout``). The layouts are where
    both the runtime and the planner take the stages' sizes from."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    one_block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"])
    block_elems = sum(math.prod(a.shape) for a in jax.tree.leaves(one_block))
    elems = fitted_page_elems(block_elems, page_size // MASTER_ITEMSIZE, page_multiple)
    page_size = elems * MASTER_ITEMSIZE
    if expert_parallel > 1:
        shares = page_multiple // expert_parallel
        block = ExpertSlabLayout.of(one_block, page_size, expert_parallel, shares)
    else:
        block = SlabLayout.from_params(one_block, page_size, page_multiple)
    return {
        "embed": SlabLayout.from_params(shapes["embed"], page_size, page_multiple),
        "block": block,
        "head": SlabLayout.from_params(shapes["head"], page_size, page_multiple),
    }


def page_squared_norms(grad) -> jax.Array:
    """Inside a backward's jit: the squared L2 norm (float32) of each page of a gradient
    as ``grad_slab`` shapes it (a list of pages, or a ``(pages, page_elems)`` array: a
    device's shard under ZeRO-3), as a ``(pages,)`` vector. One reduction fused with the
    gradient's last pass, where a host would read the whole gradient again."""
    if isinstance(grad, (list, tuple)):
        return jnp.stack([jnp.sum(jnp.square(p.astype(F32))) for p in grad])
    return jnp.sum(jnp.square(grad.astype(F32)), axis=-1)


def batch_means(*positions: int):
    """Declares results of a stage function (positions in the tuple it returns) to be
    means over its micro-batch's rows that every row's backward needs whole: a block's
    auxiliary-loss statistics (a mixture of experts' router statistics pool the whole
    micro-batch), and what is computed from them alone. A data-parallel ``jit``
    (ZeRO-3's, ``zero.py``) averages them over its devices and returns them whole on
    every device, as the loss; a one-device ``jit`` has nothing to do. Results not
    declared keep the placement's rule (ZeRO-3: a backward's per-page squared norms,
    1-D too, are split over devices as its gradient). The declaration is an attribute of
    the function (:func:`declared_batch_means`), so any ``jit`` takes it unchanged."""

    def declare(fn):
        fn.batch_means = frozenset(positions)
        return fn

    return declare


def declared_batch_means(fn) -> frozenset[int]:
    """The result positions ``fn`` declares with :func:`batch_means` (none if it does not)."""
    return getattr(fn, "batch_means", frozenset())


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Device bytes of one micro-batch's stage functions, as XLA compiles them."""

    boundary: int  # one block-boundary activation (B, T, D)
    working_set: int  # temporaries of the largest stage function, plus x / dx
    # one block's in-block activations kept from forward to backward (its vjp residuals,
    # inputs included), per offload.keep_level the block supports (remat.py)
    kept: dict[str, int]


class SwappedBlock:
    """A block whose in-block activations go to host memory between its forward and its
    backward (Fuyou's activation swapping, section 4.4; ``offload.swap_blocks``).

    ``forward(pages, x) -> (y, residuals)``: the vjp's residuals at the keep ``level``
    (remat.py: the block's input and the activations the level saves) without the param
    pages, which the window fetches again for backward instead of holding them. The
    runtime copies the residuals to ``pinned_host`` as soon as forward made them and
    back to the device ahead of backward. ``backward(pages, residuals, dy, dstats=None)
    -> ((db, its norms), dx)`` rebuilds the vjp from the pages and the residuals and
    applies it to dy and the auxiliary-loss statistics' cotangent (``cotangent``, as
    ``StageFunctions``' other backwards): what the level did not save is recomputed, as
    in a kept block at that level, so the result is the kept block's."""

    def __init__(self, block_fwd, level: str, cast, cotangent):
        fwd = remat.kept_forward(block_fwd, level)
        # The vjp's structure and which of its leaves are the param pages (by identity
        # with the traced pages): fixed by the forward's trace, used by the backward's.
        self._structure: tuple | None = None

        def forward(b, x):
            y, vjp = jax.vjp(fwd, b, x)
            leaves, tree = jax.tree.flatten(vjp)
            page_of = {id(p): k for k, p in enumerate(b)}
            where = tuple(page_of.get(id(leaf), -1) for leaf in leaves)
            self._structure = (tree, where)
            return y, [leaf for leaf, k in zip(leaves, where, strict=True) if k < 0]

        def backward(b, residuals, dy, dstats=None):
            if self._structure is None:  # traced before any forward (e.g. compiled ahead)
                jax.eval_shape(forward, b, dy)
            tree, where = self._structure
            rest = iter(residuals)
            leaves = [b[k] if k >= 0 else next(rest) for k in where]
            db, dx = jax.tree.unflatten(tree, leaves)(cotangent(dy, dstats))
            return cast(db), dx

        self._forward = forward
        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward)

    def residual_bytes(self, pages, x) -> int:
        """Bytes of the residuals ``forward`` returns, from abstract shapes."""
        _, residuals = jax.eval_shape(self._forward, pages, x)
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in residuals)


class StageFunctions:
    """The jitted per-stage functions the streaming runtime runs (and the tracer times). Each takes
    its stage's params as a list of pages and unflattens them inside the jit.

    ``block_fwd`` returns the block's output and its auxiliary-loss statistics
    (``models/staged.py``; length 0 for a block without), ``aux_fwd_bwd`` adds the
    auxiliary loss of their sum over blocks to the loss and returns the statistics'
    cotangent, which every block's backward takes besides dy (a model without an
    auxiliary loss, ``stats_size`` 0, needs neither). Both declare those results
    means over the batch (:func:`batch_means`). ``block_bwd`` recomputes
    the block's inside from its input boundary, then runs its vjp. ``block_fwd_keep``
    instead returns the vjp (its residuals: the in-block activations ``keep_level``
    keeps, ``remat.py``) with the output, and
    ``block_bwd_kept`` applies it, recomputing only what the level did not keep, for the
    cost of holding the residuals on the device until backward (``offload.keep_blocks``).
    ``kept_forward(level)`` is ``block_fwd_keep`` at any level (the tracer times each).

    ``jit`` compiles a stage function (one device: ``jax.jit`` onto it; ZeRO-3: per
    device with collectives) and ``grad_slab(pages, dtype)`` shapes a gradient as it
    leaves the device; block gradients leave in ``block_grad_dtype``. ``kept_blocks``
    false: no block keeps or swaps its activations (ZeRO-3's; an expert-parallel block
    runs only inside its ``jit``), so :meth:`memory_sizes` does not size them. Every backward
    returns each gradient as ``(gradient, its pages' squared norms)``
    (:func:`page_squared_norms`): the host never takes a norm of a gradient the device
    already holds (``grads.py``).
    """

    def __init__(
        self,
        model,
        layouts: dict[str, SlabLayout],
        jit,
        grad_slab,
        block_grad_dtype=F32,
        keep_level: str = "all",
        kept_blocks: bool = True,
    ):
        E, B, H = layouts["embed"], layouts["block"], layouts["head"]
        self.kept_blocks = kept_blocks

        def out(pages, dtype=F32):  # a gradient as it leaves the device, and its norms
            grad = grad_slab(pages, dtype)
            return grad, page_squared_norms(grad)

        cast = lambda pages: out(pages, block_grad_dtype)
        self.layouts = layouts
        m = model
        self.stats_size = m.stats_size  # 0: no auxiliary loss (aux_fwd_bwd is not needed)

        def embed_fwd(e, tokens):  # (B, T) -> (B, T, D)
            return m.embed(E.unflatten_pages(e), tokens)

        @batch_means(1)  # the statistics: means over the block's tokens
        def block_fwd(b, x):  # (B, T, D) -> ((B, T, D), aux statistics (S,))
            return m.block_stats(B.unflatten_pages(b), x)

        def head_loss(h, e, x, targets):
            return m.head_loss(H.unflatten_pages(h), E.unflatten_pages(e), x, targets)

        def head_fwd_bwd(h, e, x, targets, scale):
            loss, vjp = jax.vjp(lambda h, e, x: head_loss(h, e, x, targets), h, e, x)
            dh, de, dx = vjp(scale)  # scale: the fp16 loss scale, else 1
            return loss, out(dh), out(de), dx

        def cotangent(dy, dstats=None):  # of block_fwd's results; None: no auxiliary loss
            return dy, jnp.zeros((m.stats_size,), F32) if dstats is None else dstats

        def block_bwd(b, x, dy, dstats=None):  # recompute the block's inside, then its vjp
            _, vjp = jax.vjp(block_fwd, b, x)
            db, dx = vjp(cotangent(dy, dstats))
            return cast(db), dx

        def block_bwd_kept(vjp, dy, dstats=None):
            db, dx = vjp(cotangent(dy, dstats))
            return cast(db), dx

        @batch_means(0, 1)  # from the (already averaged) loss and statistics alone
        def aux_fwd_bwd(loss, stats, seed):
            # The auxiliary loss of the blocks' summed statistics, added to the loss, and
            # its gradient: every block's statistics get the same cotangent.
            aux, dstats = jax.value_and_grad(m.aux_loss)(sum(stats, jnp.zeros(m.stats_size, F32)))
            return loss + aux, dstats * seed

        def embed_bwd(e, tokens, dx):
            _, vjp = jax.vjp(lambda e: embed_fwd(e, tokens), e)
            return out(vjp(dx)[0])

        self.embed_fwd = jit(embed_fwd)
        self.block_fwd = jit(block_fwd)
        self.head_loss = jit(head_loss)
        self.head_fwd_bwd = jit(head_fwd_bwd)
        self.block_bwd = jit(block_bwd)
        self._block_fwd, self._kept_forward = block_fwd, {}
        self.block_fwd_keep = self.kept_forward(keep_level)
        self.block_bwd_kept = jax.jit(block_bwd_kept)  # any level's vjp
        self.aux_fwd_bwd = jit(aux_fwd_bwd)
        self.embed_bwd = jit(embed_bwd)
        self._cast, self._cotangent, self._swapped = cast, cotangent, {}

    def kept_forward(self, level: str):
        """The jitted forward of a kept block at keep ``level``: (b, x) -> (y, the vjp
        holding the residuals). One device only (kept blocks are not ZeRO-3's)."""
        if level not in self._kept_forward:
            fwd = remat.kept_forward(self._block_fwd, level)
            self._kept_forward[level] = jax.jit(lambda b, x: jax.vjp(fwd, b, x))
        return self._kept_forward[level]

    def swapped(self, level: str) -> SwappedBlock:
        """The forward and backward of a block that swaps its in-block activations at
        ``level`` to host memory (``offload.swap_blocks``). One device only."""
        if level not in self._swapped:
            self._swapped[level] = SwappedBlock(self._block_fwd, level, self._cast, self._cotangent)
        return self._swapped[level]

    def swap_bytes(self, batch: int, seq_len: int, dtype) -> dict[str, int]:
        """Bytes a swapped block moves to host memory and back (its input and the
        activations its level saves), per level it supports, from abstract shapes."""
        args = self.abstract_args(batch, seq_len, dtype)["block_fwd"]
        levels = [lvl for lvl in remat.levels(self._block_fwd, *args) if lvl in SWAP_LEVELS]
        return {lvl: self.swapped(lvl).residual_bytes(*args) for lvl in levels}

    def abstract_args(self, batch: int, seq_len: int, dtype) -> dict[str, tuple]:
        """Abstract arguments of each function for a micro-batch (batch, seq_len)."""
        sds = jax.ShapeDtypeStruct
        slab = lambda n: self.layouts[n].device_pages(dtype)
        tokens = sds((batch, seq_len), jnp.int32)
        x = jax.eval_shape(self.embed_fwd, slab("embed"), tokens)
        stats = jax.eval_shape(self.block_fwd, slab("block"), x)[1]
        return {
            "embed_fwd": (slab("embed"), tokens),
            "block_fwd": (slab("block"), x),
            "head_fwd_bwd": (slab("head"), slab("embed"), x, tokens, sds((), F32)),
            "block_bwd": (slab("block"), x, x, stats),
            "embed_bwd": (slab("embed"), tokens, x),
        }

    def memory_sizes(self, batch: int, seq_len: int, dtype) -> StageMemory:
        """XLA's own measure of the stage functions' temporaries (by compiling them)."""
        args = self.abstract_args(batch, seq_len, dtype)
        x = args["block_fwd"][1]
        act = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        temps = []
        for name in ("block_bwd", "head_fwd_bwd", "embed_bwd"):
            analysis = getattr(self, name).lower(*args[name]).compile().memory_analysis()
            temps.append(getattr(analysis, "temp_size_in_bytes", 0) if analysis else 0)
        kept = self.kept_bytes(batch, seq_len, dtype) if self.kept_blocks else {}
        return StageMemory(act, max(temps) + 3 * act, kept)

    def keep_levels(self, batch: int, seq_len: int, dtype) -> tuple[str, ...]:
        """The keep levels the block supports (``remat.levels``)."""
        return remat.levels(
            self._block_fwd, *self.abstract_args(batch, seq_len, dtype)["block_fwd"]
        )

    def kept_bytes(self, batch: int, seq_len: int, dtype) -> dict[str, int]:
        """Bytes a kept block holds from forward to backward (its vjp's residuals: the
        kept activations, its param pages and input), per keep level the block
        supports, from abstract shapes."""
        return remat.kept_bytes(
            self._block_fwd, *self.abstract_args(batch, seq_len, dtype)["block_fwd"]
        )

    def check_keep_level(self, offload, batch: int, seq_len: int, dtype) -> None:
        """Raises ``ConfigError`` when ``offload.keep_level`` is one the block does not
        support (it must tag the values that level keeps)."""
        asked = [("keep_level", offload.keep_level)] if offload.keep_blocks else []
        asked += [("swap_level", offload.swap_level)] if offload.swap_blocks else []
        asked = [(key, level) for key, level in asked if level != "all"]
        if not asked:
            return
        levels = self.keep_levels(batch, seq_len, dtype)
        for key, level in asked:
            if level in levels:
                continue
            raise ConfigError(
                f"config key 'offload.{key}' is {level!r}, but this "
                f"model's block supports only {', '.join(levels)}: "
                f"{level!r} keeps the values the block tags 'attn_probs' "
                "(jax.ad_checkpoint.checkpoint_name(probs, 'attn_probs') in its "
                "forward, as the zoo's reference attention does: model.attention="
                "'reference'; the blockwise and fused ones have no probabilities tensor); "
                "tag them or choose another level"
            )
