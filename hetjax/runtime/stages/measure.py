"""The start-up measurements of a run's stage functions: XLA's measure of their
temporaries (``memory_sizes``), what a kept block holds per keep level, what a swapped
block moves, the contexts' bytes; the memory model and the device plan read them.
:class:`~hetjax.runtime.stages.functions.StageFunctions` has these as its methods."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from hetjax.config import KEEP_LEVELS, SWAP_LEVELS, ConfigError
from hetjax.runtime.stages import remat
from hetjax.runtime.stages.signatures import SIGNATURES

F32 = jnp.float32


def _nbytes(tree) -> int:
    """Bytes of a tree of (abstract) arrays."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def context_bytes(model, batch: int, seq_len: int) -> int:
    """Device bytes a streamed micro-batch holds for its stage groups' contexts
    (``models/staged.py``): each group's context and the sum of its blocks' gradients
    of it, and each group's output that the next group's input reads (kept for that
    input's backward). 0 for one group with an empty context (GPT, Llama)."""
    nbytes = lambda tree: sum(
        math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
    )
    inputs = model.abstract_inputs(batch, seq_len)
    total = sum(2 * nbytes(context) for _, context in inputs)
    return total + sum(nbytes(x) for x, _ in inputs[1:])  # the previous groups' outputs


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Device bytes of one micro-batch's stage functions, as XLA compiles them."""

    boundary: int  # one block-boundary activation (B, T, D)
    working_set: int  # temporaries of the largest stage function, plus x / dx
    # one block's in-block activations kept from forward to backward (its vjp residuals,
    # inputs included), per offload.keep_level the block supports (remat.py)
    kept: dict[str, int]
    context: int = 0  # the stage groups' contexts and their gradients (context_bytes)
    # what a swapped block moves per level (StageFunctions.swap_bytes), where asked for
    swapped: dict[str, int] = dataclasses.field(default_factory=dict)
    # devices the measured functions reduce-scatter their gradients over (ZeRO-3): their
    # working set holds the scatter's temporaries (1: measured on one device, without)
    grad_shards: int = 1


class StageMeasurements:
    """The measurements of :class:`~hetjax.runtime.stages.functions.StageFunctions`
    (``self``: its groups, layouts, model and parallelism)."""

    def swap_bytes(self, batch: int, seq_len: int, dtype) -> dict[str, int]:
        """Bytes a swapped block moves to host memory and back (its input and the
        activations its level saves), per level every group's block supports: the
        largest group's."""
        out: dict[str, int] = {}
        for fns, args in zip(self.groups, self.block_args(batch, seq_len, dtype), strict=True):

            def residuals(*args, fns=fns) -> dict[str, int]:
                levels = [lvl for lvl in remat.levels(fns._block_fwd, *args) if lvl in SWAP_LEVELS]
                return {lvl: fns.swapped(lvl).residual_bytes(*args) for lvl in levels}

            part, rows = self._measure(residuals, args)
            for lvl, n in part.items():
                out[lvl] = max(out.get(lvl, 0), n * rows)
        return out

    def block_args(self, batch: int, seq_len: int, dtype) -> list[tuple]:
        """Abstract (pages, x, context) of each group's block for a micro-batch: x and
        the context as the group's jitted input function returns them (so in the
        placement's layout: ZeRO-3 holds a context's params once per device)."""
        tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
        x, args = None, []
        for fns in self.groups:
            x, context = jax.eval_shape(
                fns.input_fwd, self._slab("embed", dtype), x, tokens, tokens
            )
            args.append((self._slab(fns.group.name, dtype), x, context))
        return args

    def _slab(self, name: str, dtype) -> list:
        return self.layouts[name].device_pages(dtype)

    def abstract_args(self, batch: int, seq_len: int, dtype) -> dict[str, tuple]:
        """Abstract arguments of each function of the first group (and the head) for a
        micro-batch (batch, seq_len)."""
        return self.group_args(0, batch, seq_len, dtype)

    def group_args(self, g: int, batch: int, seq_len: int, dtype) -> dict[str, tuple]:
        """Abstract arguments of group g's functions and the head's for a micro-batch."""
        sds = jax.ShapeDtypeStruct
        tokens = sds((batch, seq_len), jnp.int32)
        slab, x, context = self.block_args(batch, seq_len, dtype)[g]
        prev = None if g == 0 else x
        # the statistics' cotangent as backward passes it: None without an auxiliary loss
        stats = jax.eval_shape(self.groups[g].block_fwd, slab, x, context)[1]
        stats = stats if self.stats_size else None
        return {
            "embed_fwd": (self._slab("embed", dtype), tokens),
            "input_fwd": (self._slab("embed", dtype), prev, tokens, tokens),
            "block_fwd": (slab, x, context),
            "head_fwd_bwd": (self._slab("head", dtype), self._slab("embed", dtype), x, tokens,
                             sds((), F32)),
            "block_bwd": (slab, x, x, stats, context, context),
            "embed_bwd": (self._slab("embed", dtype), tokens, x),
            "input_bwd": (self._slab("embed", dtype), prev, tokens, tokens, x, context),
        }  # fmt: skip

    def memory_sizes(self, batch: int, seq_len: int, dtype) -> StageMemory:
        """XLA's own measure of the stage functions' temporaries (by compiling them): the
        largest of every group's block backward, the head's, the embedding's backward and
        the later groups' inputs' backwards."""
        first = self.abstract_args(batch, seq_len, dtype)
        compiled = [
            (self.head_fwd_bwd, first["head_fwd_bwd"]),
            (self.embed_bwd, first["embed_bwd"]),
        ]
        for g, fns in enumerate(self.groups):
            args = self.group_args(g, batch, seq_len, dtype)
            compiled.append((fns.block_bwd, args["block_bwd"]))
            if g:
                compiled.append((fns.input_bwd, args["input_bwd"]))
        temps = []
        for fn, args in compiled:
            analysis = fn.lower(*self.parallel.as_called(args)).compile().memory_analysis()
            temps.append(getattr(analysis, "temp_size_in_bytes", 0) if analysis else 0)
        x = first["block_fwd"][1]
        act = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        context = context_bytes(self.model, batch, seq_len)
        kept = self.kept_bytes(batch, seq_len, dtype) if self.kept_blocks else {}
        # XLA's temporaries are one device's (a ZeRO-3 function is compiled for one
        # device's rows), and so are x / dx beside them; the rest is the micro-batch's
        # (memory.Sizes.per_device)
        working = max(temps) + 3 * act // self.parallel.batch_degree
        return StageMemory(act, working, kept, context, grad_shards=self.parallel.degree)

    def _measure(self, fn, args: tuple) -> tuple[Any, int]:
        """``fn(pages, x, context)`` of a block's abstract arguments ``args`` (global) ->
        (its result, how many devices split the rows it saw): the whole micro-batch's
        (1), or where the block's all-to-all needs the mesh (expert parallelism) or its
        compute is split over it (tensor parallelism, whose residuals traced whole miss
        a split weight's), one device's part, traced inside it (its rows, its group's
        experts or weights' slices: the parallelism's batch degree)."""
        if not self.parallel.on_mesh:
            return fn(*args), 1
        part = self.parallel.per_device(fn, SIGNATURES["block_fwd"], args)
        return part, self.parallel.batch_degree

    @property
    def on_mesh(self) -> bool:
        """Whether a block's compute needs the mesh (expert parallelism's all-to-all,
        tensor parallelism's split weights): its residuals are then laid out over the
        mesh by XLA, and :meth:`held_bytes` measures them."""
        return self.parallel.on_mesh

    def held_bytes(self, kind: str, level: str, batch: int, seq_len: int, dtype) -> int:
        """Bytes a device holds of one block between its forward and its backward at keep
        ``level``: ``kind`` "kept", its vjp (``Kept``); "swapped", its residuals back on
        the device (``Swapped``); the largest group's. As XLA lays them out over the mesh
        (each array's shard on one device, ``ledger.device_bytes``: what the ledger
        counts), compiled from the arguments the block's forward gets (pages gathered
        as the placement gathers them, rows split over the data axes). Only where a
        block's compute needs the mesh (:attr:`on_mesh`): elsewhere each device holds its
        rows' share of the micro-batch's, which :meth:`kept_bytes` and
        :meth:`swap_bytes` measure from shapes."""
        assert self.on_mesh, "one device or data parallelism: kept_bytes / swap_bytes"
        held = 0
        for fns, (_, x, context) in zip(
            self.groups, self.block_args(batch, seq_len, dtype), strict=True
        ):
            pages = self.parallel.device_pages(self.layouts[fns.group.name], dtype)
            rows = self.parallel.abstract_rows(x)
            forward = fns.kept_forward(level) if kind == "kept" else fns.swapped(level).forward
            compiled = forward.lower(pages, rows, context).compile()
            out = zip(
                jax.tree.leaves(compiled.out_info[1]),
                jax.tree.leaves(compiled.output_shardings[1]),
                strict=True,
            )
            shard = lambda a, s: math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
            held = max(held, sum(shard(a, s) for a, s in out))
        return held

    def keep_levels(self, batch: int, seq_len: int, dtype) -> tuple[str, ...]:
        """The keep levels every group's block supports (``remat.levels``)."""
        args = self.block_args(batch, seq_len, dtype)
        supported = [
            set(self._measure(functools.partial(remat.levels, f._block_fwd), a)[0])
            for f, a in zip(self.groups, args, strict=True)
        ]
        return tuple(lvl for lvl in KEEP_LEVELS if all(lvl in s for s in supported))

    def kept_bytes(self, batch: int, seq_len: int, dtype) -> dict[str, int]:
        """Bytes a kept block holds from forward to backward (its vjp's residuals: the
        kept activations, its param pages and input), per keep level every group's block
        supports: the largest group's, from abstract shapes (the micro-batch's
        activations and the block's pages)."""
        levels = self.keep_levels(batch, seq_len, dtype)
        out = dict.fromkeys(levels, 0)
        for fns, args in zip(self.groups, self.block_args(batch, seq_len, dtype), strict=True):

            def activations(slab, x, context, fns=fns) -> dict[str, int]:
                block = lambda pc, x: fns._block_fwd(pc[0], x, pc[1])
                pages = _nbytes((slab, context))
                return {
                    lvl: n - pages for lvl, n in remat.kept_bytes(block, (slab, context), x).items()
                }

            part, rows = self._measure(activations, args)
            pages = _nbytes((args[0], args[2]))
            for lvl, n in part.items():
                if lvl in out:
                    out[lvl] = max(out[lvl], pages + n * rows)
        return out

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
