"""optax on flat slabs: the update the host optimizer loop runs for one stage.

A stage's fp32 master params are one slab (see ``pages.py``); its optimizer state is a
few more slabs of the same size, one per *state kind* (``mu`` and ``nu`` for Adam,
``mu`` for Lion, ``trace`` for SGD with momentum), plus a few scalars (step counts).
:class:`SlabOptimizer` finds those kinds by looking at the optax state's structure, so
any elementwise optax transformation works unchanged, and the slabs map one-to-one onto
the NVMe page arrays (``nvme.py``) and the host cache (``storage/nvme_states.py``).

The weight-decay mask is a split point: optax sees the slab as a pair ``(decayed part,
the rest)`` with the mask ``(True, False)``.

Global-norm clipping needs the norm of all gradients before any stage is updated; the
caller passes ``(global_norm, max_norm)`` to each update, which applies optax's own
formula ``g / norm * max_norm`` when ``norm >= max_norm``. Results therefore equal
``optax.chain(clip_by_global_norm, base)`` over the whole pytree. ``max_norm = 0`` means
no clipping (the speculative update of the overlapped loop, see ``update_loop.py``).

Speed, measured with ``python -m hetjax.bench optimizer`` (README): XLA's CPU backend
compiles optax's AdamW into three loop fusions (mu, nu, params). Over one whole 32M
slab that ran at 110 M params/s here; dispatched in 1M-element chunks, 489 M (the
memory-bandwidth bound measured in the same run: ~1.2 G params/s). So slabs are
updated, stored and written chunk by chunk. For adam and adamw the chunk's update is
the native one-pass kernel (``native.py``) unless ``optimizer.host_kernel=optax``: at
the bound in place, where optax reaches 0.6-0.8 of it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.config import OptimizerConfig
from hetjax.optimizer import moments, native
from hetjax.optimizer.build import base_optimizer, learning_rate_schedule, state_kind_name
from hetjax.state_format import StateFormat, state_format
from hetjax.storage.pages import (
    GradPages,
    SlabLayout,
    aligned_empty,
    page_runs,
    runs_outside,
    zero_page,
)
from hetjax.types import MASTER

F32 = jnp.float32
CHUNK_ELEMS = 1 << 20  # elements per update dispatch on the CPU backend (whole pages)


def chunk_elems(sharding: jax.sharding.Sharding) -> int:
    """Elements per update dispatch for state in ``sharding`` (0: the whole stage).

    On the CPU backend, CHUNK_ELEMS: cache-sized chunks run 4.4x faster than one
    whole-slab update there (module docstring). On an accelerator one dispatch per
    stage: the update is bound by device memory bandwidth whatever its size, and each
    chunk would cost a kernel launch and a round of Python on the dispatching thread
    (about 200 of them for a 200M-parameter stage)."""
    return CHUNK_ELEMS if next(iter(sharding.device_set)).platform == "cpu" else 0


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One leaf of the optax state: a half of a slab kind, or a scalar."""

    kind: str | None  # slab kind for param-shaped leaves, None for scalars
    half: int = 0  # 0: decayed part, 1: the rest


def _state_slots(tx) -> tuple[list[_Slot], Any]:
    """Classifies the optax state's leaves. Two halves of distinct sizes (3 and 5) tell
    param-shaped leaves (which come as consecutive pairs) from scalars."""
    sds = jax.ShapeDtypeStruct
    shapes = jax.eval_shape(tx.init, (sds((3,), F32), sds((5,), F32)))
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    slots: list[_Slot] = []
    used: set[str] = {MASTER}
    i = 0
    while i < len(paths_leaves):
        path, leaf = paths_leaves[i]
        if leaf.shape == (3,):
            if i + 1 >= len(paths_leaves) or paths_leaves[i + 1][1].shape != (5,):
                raise NotImplementedError(f"optax state leaf {path} is not elementwise")
            kind = state_kind_name(path[:-1], used)
            slots += [_Slot(kind, 0), _Slot(kind, 1)]
            i += 2
        elif leaf.shape == ():
            slots.append(_Slot(None))
            i += 1
        else:
            raise NotImplementedError(f"optax state leaf {path} of shape {leaf.shape}")
    return slots, treedef


def _find(state, cls):
    """The one ``cls`` node (an optax state) in ``state``."""
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls))
        if isinstance(x, cls)
    ]
    assert len(found) == 1, (cls, state)
    return found[0]


def _clip_scale(norm, max_norm):
    """The clipping factor of a step whose global gradient norm is ``norm`` (traced;
    ``max_norm`` 0: no clipping). A scalar factor, not optax's ``g / norm * max_norm``:
    XLA will not duplicate a division into the three consumers of the clipped gradient,
    so that form costs a pass of its own over the chunk (equal to within one rounding)."""
    return jnp.where((max_norm == 0) | (norm < max_norm), 1.0, max_norm / norm)


def _host_buffers(slabs: dict, state: StateFormat) -> bool:
    """Whether every kind's slab is one writable numpy array in its ``state`` dtype, or
    int8 blocks of two (host buffers the native kernel may update in place)."""

    def writable(a, dtype) -> bool:
        return isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.writeable

    def held(kind: str) -> bool:
        slab, fmt = slabs[kind], state.kind(kind)
        if fmt.block_size is None:
            return writable(slab, fmt.dtype)
        return isinstance(slab, moments.Int8Blocks) and (
            writable(slab.codes, fmt.dtype) and writable(slab.scales, np.float32)
        )

    return all(held(k) for k in state.kinds)


def _decayed(num_decay: int, start: int, stop: int) -> int:
    """Of the slab's elements ``[start, stop)``, how many lie in its decayed part (the
    first ``num_decay``): the ``num_decay`` of that run."""
    return min(max(num_decay - start, 0), stop - start)


class SlabOptimizer:
    """The configured optax optimizer over stage slabs, jitted where the state lives.

    ``sharding`` is where state arrays live (host RAM or device memory); the update
    computes in that device's ``device`` memory kind (on the CPU backend XLA cannot mix
    host-kind operands with the constants optax creates) and writes its outputs back to
    ``sharding``."""

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        layouts: dict[str, SlabLayout],
        sharding: jax.sharding.Sharding,
        compute_dtype: Any,
    ):
        self.cfg = cfg
        self.layouts = layouts
        self.sharding = sharding
        self.scalar_sharding = sharding  # where the scalars (step counts) live
        self._compute = jax.sharding.SingleDeviceSharding(
            next(iter(sharding.device_set)), memory_kind="device"
        )
        self.compute_dtype = jnp.dtype(compute_dtype)
        # where update_host's refreshed params go (a SlabPool the param store shares,
        # ``iopool.py``), or None: a fresh slab per stage and step
        self.param_buffers = None
        self.tx = base_optimizer(cfg, total_steps, mask=(True, False))
        self._lr = learning_rate_schedule(cfg, total_steps)
        self._slots, self._treedef = _state_slots(self.tx)
        state_kinds = list(dict.fromkeys(s.kind for s in self._slots if s.kind))
        self.kinds = [MASTER, *state_kinds]  # every slab kind, master first
        # what the stores, the memory model and the checkpoint hold each kind in
        self.state_format = state_format(cfg)
        assert self.state_format.kinds == self.kinds, (self.state_format, self.kinds)
        platform = next(iter(sharding.device_set)).platform
        self.native = native.use_native(cfg.host_kernel, cfg.name, platform, self.state_format)
        self.chunk_elems = chunk_elems(sharding)  # 0: one chunk per stage
        self._init = jax.jit(self._init_state, static_argnums=1, out_shardings=sharding)
        # Two ways to give XLA the output buffers instead of fresh allocations (fresh
        # buffers cost a page fault per 4 KiB on the first touch: about half the update's
        # time on the CPU backend, measured with ``bench optimizer``): ``_update_into``
        # writes the new state into ``spare`` (a dead copy of the same slabs),
        # ``_update_in_place`` into the input slabs themselves (a fresh NVMe read).
        update = functools.partial(jax.jit, static_argnums=(5, 6, 7), out_shardings=sharding)
        self._update = update(self._update_chunk)
        self._update_into = update(self._update_chunk, donate_argnums=1, keep_unused=True)
        self._update_in_place = functools.partial(
            update(self._update_chunk, donate_argnums=0), aliased=True
        )
        self._cast = jax.jit(self._cast_pages, static_argnums=1, out_shardings=sharding)
        self._coef = jax.jit(self._host_coef, out_shardings=sharding)
        # a checkpoint's values to int8 blocks and back (``held_chunks``, ``values``),
        # computed in device memory as the update is
        here = lambda f, k: lambda x, page: f(k, jax.device_put(x, self._compute), page)
        self._quantize = {
            k: jax.jit(here(self._encode, k), static_argnums=1, out_shardings=sharding)
            for k in self.kinds
        }
        self._dequantize = {k: jax.jit(here(self._decode, k), static_argnums=1) for k in self.kinds}

    # -- state <-> slabs ----------------------------------------------------------------

    def _assemble(self, slabs: dict[str, jax.Array], scalars: list, num_decay: int):
        leaves, it = [], iter(scalars)
        for slot in self._slots:
            if slot.kind is None:
                leaves.append(next(it))
            else:
                slab = slabs[slot.kind]
                leaves.append(slab[:num_decay] if slot.half == 0 else slab[num_decay:])
        return jax.tree.unflatten(self._treedef, leaves)

    def _disassemble(self, state) -> tuple[dict[str, jax.Array], list]:
        halves: dict[str, list] = {}
        scalars = []
        for slot, leaf in zip(self._slots, jax.tree.leaves(state), strict=True):
            if slot.kind is None:
                scalars.append(leaf)
            else:
                halves.setdefault(slot.kind, []).append(leaf)
        return {k: jnp.concatenate(h) for k, h in halves.items()}, scalars

    # -- jitted bodies ------------------------------------------------------------------

    def _init_state(self, master: jax.Array, layout_name: str):
        num_decay = self.layouts[layout_name].num_decay
        master = jax.device_put(master, self._compute)
        slabs, scalars = self._disassemble(self.tx.init((master[:num_decay], master[num_decay:])))
        slabs = {MASTER: master, **slabs}
        P = self.layouts[layout_name].page_elems
        return {
            k: [self._encode(k, c, P) for c in self._split(v, layout_name)]
            for k, v in slabs.items()
        }, scalars

    def _encode(self, kind: str, x, page: int):
        """A float32 chunk of ``kind`` (whole pages of ``page`` elements) as the state
        format holds it (``moments.py``): float32, bfloat16 or int8 blocks (from each
        page's first element)."""
        fmt, signed = self.state_format.kind(kind), kind not in moments.UNSIGNED_KINDS
        return moments.encode(x, fmt, signed, page)

    def _decode(self, kind: str, x, page: int):
        """A chunk of ``kind`` as held, in float32."""
        return moments.decode(x, kind not in moments.UNSIGNED_KINDS, page)

    def _update_chunk(
        self, slabs, spare, scalars, grad, clip, num_decay: int, page_elems: int, aliased=False
    ):
        del spare  # only its buffers are used: the outputs alias them (donated)
        # ``grad``: the chunk's gradient as its pages (float32 or bfloat16)
        slabs, scalars, grad, clip = jax.device_put((slabs, scalars, grad, clip), self._compute)
        scale = _clip_scale(*clip)
        if self.native:  # the kernel reads the pages as they are
            return self._native_chunk(slabs, scalars, grad, scale, num_decay, page_elems, aliased)
        grad = jnp.concatenate([g.astype(F32) for g in grad])  # fused into the update
        clipped = grad * scale.astype(grad.dtype)
        # moments kept in fewer bytes are updated in float32 and rounded to their
        # dtype (``moments.py``): optax would otherwise compute part of it in bfloat16
        slabs = {k: self._decode(k, v, page_elems) for k, v in slabs.items()}
        master = slabs[MASTER]
        params = (master[:num_decay], master[num_decay:])
        grads = (clipped[:num_decay], clipped[num_decay:])
        state = self._assemble(slabs, scalars, num_decay)
        updates, state = self.tx.update(grads, state, params)
        new = jnp.concatenate([p + u for p, u in zip(params, updates, strict=True)])
        new_slabs, new_scalars = self._disassemble(state)
        new_slabs = {k: self._encode(k, v, page_elems) for k, v in new_slabs.items()}
        # Each page cast straight from the new master (one pass), not a cast of the whole
        # chunk sliced into pages afterwards (a second pass of copies).
        step = page_elems
        pages = [new[k : k + step].astype(self.compute_dtype) for k in range(0, new.shape[0], step)]
        return {MASTER: new, **new_slabs}, new_scalars, pages

    def _native_chunk(self, slabs, scalars, grad, scale, num_decay, page_elems, aliased):
        """``_update_chunk`` by the native kernel (``native.py``): optax computes the new
        scalars (step counts) on empty slabs; the kernel gets the step's coefficients
        as optax derives them and updates the chunk in one pass, reading the gradient's
        pages ``grad`` as they are (float32 or bfloat16). ``aliased``: the results
        overwrite the operands (an update in place)."""
        coef, new_scalars = self._native_coef(scalars, scale)
        c = self.cfg
        decay = c.weight_decay if c.name == "adamw" else 0.0
        attrs = dict(num_decay=np.int64(num_decay if decay else 0), weight_decay=np.float32(decay))
        if isinstance(slabs["mu"], moments.Int8Blocks):
            new, pages = self._native_int8(slabs, coef, grad, page_elems, aliased, attrs)
            return new, new_scalars, pages
        n = slabs[MASTER].shape[0]
        state = tuple(jax.ShapeDtypeStruct((n,), self.state_format.dtype(k)) for k in native.KINDS)
        page = jax.ShapeDtypeStruct((page_elems,), self.compute_dtype)
        call = jax.ffi.ffi_call(
            native.TARGET,
            state + (page,) * (n // page_elems),
            input_output_aliases={0: 0, 1: 1, 2: 2} if aliased else None,
        )
        out = call(slabs[MASTER], slabs["mu"], slabs["nu"], coef, *grad, **attrs)
        return {MASTER: out[0], "mu": out[1], "nu": out[2]}, new_scalars, list(out[3:])

    def _native_int8(self, slabs, coef, grad, page_elems, aliased, attrs):
        """``_native_chunk``'s call with int8 moments: each moment's codes and scales
        are operands of their own. Returns the new state and the params' pages."""
        m, v = slabs["mu"], slabs["nu"]
        state = [slabs[MASTER], m.codes, m.scales, v.codes, v.scales]
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state)
        page = jax.ShapeDtypeStruct((page_elems,), self.compute_dtype)
        call = jax.ffi.ffi_call(
            native.TARGET_INT8,
            shapes + (page,) * (slabs[MASTER].shape[0] // page_elems),
            input_output_aliases={i: i for i in range(5)} if aliased else None,
        )
        out = call(*state[:5], coef, *grad, **attrs)
        new = {
            MASTER: out[0],
            "mu": moments.Int8Blocks(out[1], out[2]),
            "nu": moments.Int8Blocks(out[3], out[4]),
        }
        return new, list(out[5:])

    def _native_coef(self, scalars, scale):
        """The native kernel's coefficients for a step (its ``coef`` operand) and the new
        scalars: optax computes the scalars (step counts) on empty slabs; the kernel gets
        the step's coefficients as optax derives them."""
        empty = jnp.zeros((0,), F32)
        held = lambda f: F32 if f.block_size else f.dtype  # the scalars ignore the dtype
        slabs = {k: jnp.zeros((0,), held(self.state_format.kind(k))) for k in self.kinds}
        state = self._assemble(slabs, scalars, 0)
        _, new_state = self.tx.update((empty, empty), state, (empty, empty))
        _, new_scalars = self._disassemble(new_state)
        adam = _find(state, optax.ScaleByAdamState)
        count = optax.safe_increment(adam.count)  # as scale_by_adam's bias correction
        bias1, bias2 = (1 - b**count for b in (self.cfg.b1, self.cfg.b2))
        lr_count = _find(state, optax.ScaleByScheduleState).count
        step = -1 * self._lr(lr_count)  # scale_by_learning_rate's step size
        c = self.cfg
        coef = [scale, 1 - c.b1, c.b1, 1 - c.b2, c.b2, bias1, bias2, c.eps, 0.0, step]
        return jnp.stack([jnp.asarray(x, F32) for x in coef]), new_scalars

    def _host_coef(self, scalars, clip):
        """``_native_coef`` for :meth:`update_host`."""
        scalars, clip = jax.device_put((scalars, clip), self._compute)
        return self._native_coef(scalars, _clip_scale(*clip))

    def _cast_pages(self, master, layout_name: str):
        master = jnp.concatenate(jax.device_put(list(master), self._compute))
        return self.layouts[layout_name].to_pages(master.astype(self.compute_dtype))

    # -- chunks -------------------------------------------------------------------------

    def chunk_bounds(self, layout_name: str) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk of a slab: whole pages, about ``chunk_elems``
        each (:func:`chunk_elems`; the whole slab where it is 0)."""
        layout = self.layouts[layout_name]
        elems = self.chunk_elems or layout.padded_size
        step = layout.page_elems * max(1, round(elems / layout.page_elems))
        return [(a, min(a + step, layout.padded_size)) for a in range(0, layout.padded_size, step)]

    def _split(self, slab, layout_name: str) -> list:
        """A whole slab -> its chunks (numpy views, or slices inside jit; int8 blocks:
        the chunk's codes and its pages' scales)."""
        P = self.layouts[layout_name].page_elems
        return [moments.elements(slab, a, b, P) for a, b in self.chunk_bounds(layout_name)]

    def as_chunks(self, layout_name: str, slab) -> list:
        """A kind's slab as its chunks (already chunks: unchanged)."""
        return slab if isinstance(slab, list) else self._split(slab, layout_name)

    # -- the API ------------------------------------------------------------------------

    def init(self, layout_name: str, master) -> tuple[dict[str, list], list]:
        """The fresh state of a stage whose fp32 master slab is ``master``: for each kind
        (``master`` included) the slab as its list of chunks, and the scalars."""
        return self._init(jax.device_put(master, self.sharding), layout_name)

    def update(
        self,
        layout_name: str,
        slabs: dict[str, Any],
        scalars: list,
        grad: np.ndarray,
        clip: tuple[float, float],
        spare: dict[str, list] | None = None,
        in_place: bool = False,
        skip: frozenset[int] = frozenset(),
        catch_up: tuple = (),
    ) -> tuple[dict[str, list], list, list[jax.Array]]:
        """One optimizer step of one stage. ``slabs`` is its state by kind, each a list
        of chunks (numpy or JAX arrays) or a whole flat slab (numpy, split here);
        ``scalars`` its scalars, ``grad`` the averaged gradient: as the pages it reached
        the host in (:class:`~hetjax.storage.pages.GradPages`, float32 or bfloat16), a
        flat numpy slab, or a JAX array where it already is (a device-cached stage's, on
        the device); and ``clip``
        ``(global_norm, max_norm)``. Returns the new state (chunk lists, in
        ``sharding``), the new scalars and the refreshed compute-dtype params as pages.

        The slab is updated chunk by chunk (:meth:`chunk_bounds`), each chunk its own
        dispatch: on the CPU backend about CHUNK_ELEMS elements, 4.4x faster than one
        whole-slab update (module docstring; the chunks' working set stays in cache and
        two chunks run at once on two cores); on an accelerator one chunk per stage.

        Output buffers: ``spare`` (the same kinds, as chunks, in ``sharding``) is a dead
        copy of this stage's state that the new state is written into (its arrays
        are deleted); ``in_place`` writes it over ``slabs`` (which must be a copy nobody
        else holds, e.g. a fresh NVMe read). Otherwise the new state gets fresh buffers."""
        if in_place and self.native and _host_buffers(slabs, self.state_format):
            return self.update_host(layout_name, slabs, scalars, grad, clip, skip, catch_up)
        assert not (skip or catch_up), "deferred updates need the native kernel on host buffers"
        layout = self.layouts[layout_name]
        bounds = self.chunk_bounds(layout_name)
        chunked = {k: self.as_chunks(layout_name, slabs[k]) for k in self.kinds}
        update, spares = self._update, [None] * len(bounds)
        if in_place:
            update = self._update_in_place
            chunked = jax.device_put(chunked, self.sharding)  # numpy reads: a copy anyway
        elif spare is not None:
            update = self._update_into
            spares = [{k: spare[k][c] for k in self.kinds} for c in range(len(bounds))]
        clip_arr = (np.float32(clip[0]), np.float32(clip[1]))
        if isinstance(grad, jax.Array):
            grad = [[grad[a:b]] for a, b in bounds]
        else:
            # Each chunk's pages put explicitly: shared with JAX when aligned (the host
            # buffers a gradient lands in are), where numpy arguments to the jitted
            # update would be copied. Neither concatenated nor cast here: in the update.
            pages = GradPages.of(grad)
            grad = jax.device_put([pages.chunk(a, b) for a, b in bounds], self.sharding)
        new: dict[str, list] = {k: [] for k in self.kinds}
        pages: list[jax.Array] = []
        new_scalars = scalars
        for c, (a, b) in enumerate(bounds):
            num_decay = _decayed(layout.num_decay, a, b)
            out, chunk_scalars, chunk_pages = update(
                {k: chunked[k][c] for k in self.kinds},
                spares[c],
                scalars,
                grad[c],
                clip_arr,
                num_decay,
                layout.page_elems,
            )
            for k in self.kinds:
                new[k].append(out[k])
            pages += chunk_pages
            new_scalars = chunk_scalars  # the same in every chunk (step counts)
        return new, new_scalars, pages

    def update_host(
        self,
        layout_name: str,
        slabs: dict[str, np.ndarray],
        scalars: list,
        grad,
        clip: tuple[float, float],
        skip: frozenset[int] = frozenset(),
        catch_up: tuple = (),
    ) -> tuple[dict[str, np.ndarray], list, list[np.ndarray]]:
        """:meth:`update` by the native kernel straight on host buffers, in place, no XLA
        buffer involved: ``slabs`` (each kind a writable numpy slab in its state dtype, e.g. the
        NVMe tier's pooled I/O buffers) are the new state when it returns; the gradient
        is read where it is (its pages, float32 or bfloat16). The new params are pages of
        one fresh compute-dtype slab (aligned: put without a copy). Equal to the jitted
        path bit for bit (the same kernel on the same coefficients).

        Deferred updates (``optimizer/deferred.py``): the pages in ``skip`` (zero
        gradient) are not updated, their params are the master's as it is; each
        ``(pages, inputs)`` of ``catch_up`` first gets the updates it missed, one per
        scalars in ``inputs`` (those the stage's missed updates started from), with a
        zero gradient: the same kernel, so the pages end as if never skipped."""
        layout = self.layouts[layout_name]
        P = layout.page_elems
        for pages, inputs in catch_up:
            self.catch_up(layout_name, {k: slabs[k] for k in self.kinds}, pages, pages, inputs)
        coef, new_scalars = self._coef(scalars, (np.float32(clip[0]), np.float32(clip[1])))
        decay = self.cfg.weight_decay if self.cfg.name == "adamw" else 0.0
        # aligned: the pages are then shared with JAX where they are put (a params store
        # in host RAM, the device on the CPU backend), not copied into buffers of its own
        pool = self.param_buffers
        if pool is not None:
            out = pool.take(layout.padded_size, self.compute_dtype)
        else:
            out = aligned_empty(layout.padded_size, self.compute_dtype)
        grad_pages = list(GradPages.of(grad).pages)
        num_pages = layout.padded_size // P
        if len(grad_pages) == 1 and num_pages > 1:  # a flat slab (summed micro-batches)
            grad_pages = list(grad_pages[0].reshape(num_pages, -1))
        for a, b in runs_outside(num_pages, skip) if skip else [(0, num_pages)]:
            native.host_update(
                {k: moments.elements(slabs[k], a * P, b * P, P) for k in self.kinds},
                grad_pages[a:b],
                np.asarray(coef), decay, _decayed(layout.num_decay, a * P, b * P) if decay else 0,
                out[a * P : b * P], P,
            )  # fmt: skip
        for a, b in page_runs(skip):  # not updated: the params as the master is
            out[a * P : b * P] = slabs[MASTER][a * P : b * P]
        pages = list(out.reshape(-1, P))
        return dict(slabs), new_scalars, pages

    def catch_up(
        self, layout_name: str, slabs: dict[str, np.ndarray], pages, at, inputs: list
    ) -> np.ndarray:
        """The updates ``pages`` of a stage missed, one per scalars in ``inputs``, with a
        zero gradient, in place: ``slabs`` (each kind flat, its state dtype) hold those pages at
        the page positions ``at`` (one per page: the stage's own positions, or 0.. in a
        buffer of just these pages; consecutive pages consecutive there). Returns their
        new params (compute dtype, (pages, page elements) in the order of ``pages``
        sorted)."""
        layout = self.layouts[layout_name]
        P = layout.page_elems
        decay = self.cfg.weight_decay if self.cfg.name == "adamw" else 0.0
        out = aligned_empty(len(pages) * P, self.compute_dtype).reshape(-1, P)
        zero = zero_page((P,), np.float32)  # a missed update's gradient
        positions = dict(zip(pages, at, strict=True))
        for scalars in inputs:
            coef, _ = self._coef(scalars, (np.float32(0), np.float32(0)))
            done = 0
            for a, b in page_runs(pages):
                s, e = positions[a] * P, (positions[a] + b - a) * P
                native.host_update(
                    {k: moments.elements(slabs[k], s, e, P) for k in self.kinds}, [zero] * (b - a),
                    np.asarray(coef),
                    decay, _decayed(layout.num_decay, a * P, b * P) if decay else 0,
                    out[done : done + b - a].reshape(-1), P,
                )  # fmt: skip
                done += b - a
        return out

    def held_chunks(self, layout_name: str, kind: str, values: np.ndarray) -> list:
        """A kind's whole slab given as values (flat numpy, any float dtype: a
        checkpoint's) as the chunks this optimizer holds: cast to the kind's dtype
        (float32 to bfloat16 rounds to nearest even, bfloat16 widens exactly), or
        quantized to int8 blocks chunk by chunk where the format has block scales."""
        fmt = self.state_format.kind(kind)
        if fmt.block_size is None:
            return self.as_chunks(layout_name, np.asarray(values).astype(fmt.dtype, copy=False))
        chunks = self.as_chunks(layout_name, np.asarray(values, np.float32))
        P = self.layouts[layout_name].page_elems
        return [self._quantize[kind](jax.device_put(c, self.sharding), P) for c in chunks]

    def values(self, kind: str, chunks: list, layout_name: str) -> np.ndarray:
        """A kind's slab held as ``chunks`` as flat numpy values: its dtype, or float32
        where the format holds int8 blocks (what they dequantize to)."""
        if self.state_format.kind(kind).block_size is None:
            return np.concatenate([np.asarray(c) for c in chunks])
        P = self.layouts[layout_name].page_elems
        # (a chunk held elsewhere, e.g. on several devices: ``sharded_slab.py``, put here)
        put = lambda c: jax.device_put(c, self.sharding)
        return np.concatenate([np.asarray(self._dequantize[kind](put(c), P)) for c in chunks])

    def compute_pages(self, layout_name: str, master) -> list[jax.Array]:
        """A master slab (or its chunks) cast to the compute dtype, as pages. The master
        may be anywhere (numpy, or another device's: on a GPU the state starts on the
        CPU backend, where the host optimizer lives); it is cast where this optimizer's
        state lives."""
        if not isinstance(master, list):
            master = [master]
        return self._cast(jax.device_put(master, self.sharding), layout_name)

    def state_bytes(self, layout_name: str) -> int:
        """Bytes of one stage's slabs (all kinds, as ``state_format`` holds them)."""
        layout = self.layouts[layout_name]
        return self.state_format.nbytes(layout.padded_size, page_elems=layout.page_elems)
