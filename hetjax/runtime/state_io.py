"""A streaming run's state in the placement-free form (``types.RuntimeState``) and back:
what training checkpoints save and restore, and the master params a run returns."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hetjax.checkpoint_state import StagePart, StateSource, StoredState
from hetjax.runtime.setup import layout_name
from hetjax.state_format import MASTER_DTYPE, StateFormat
from hetjax.storage.pages import SlabLayout
from hetjax.types import MASTER, RuntimeState, StateStore, stages_tree


def master_params(
    stage_names: list[str], layouts: dict[str, SlabLayout], states: StateStore, whole_slab
) -> Any:
    """The fp32 master params as the model's pytree (host numpy); ``whole_slab`` turns
    this process's part of a slab into the whole one."""
    unflat = lambda name: jax.tree.map(
        np.array, layouts[layout_name(name)].unflatten(whole_slab(states.master(name)))
    )
    return stages_tree({name: unflat(name) for name in stage_names})


def source(
    stage_names: list[str],
    layouts: dict[str, SlabLayout],
    states: StateStore,
    own_pages,
    loss_scale: tuple[float, int] | None,
    state_format: StateFormat | None = None,
    values: Callable[[str, list, str], np.ndarray] | None = None,
) -> StateSource:
    """This process's committed state for a checkpoint, taken where it lives
    (``checkpoint_state.py``): each stage's slabs or NVMe files, frozen until written.
    ``own_pages(layout)``: the (first page, number of pages) of a slab this process
    holds; ``state_format``: the optimizer's (None: fp32 each kind). A kind held in
    int8 blocks is saved as the float32 values they hold (a checkpoint's kind is one
    dtype, without scales), ``values(kind, chunks, layout)`` (``SlabOptimizer.values``) giving
    them stage by stage as the checkpoint writes."""
    saved_format = state_format
    blocks = state_format is not None and any(
        state_format.kind(k).block_size for k in state_format.kinds
    )
    if blocks:
        saved_format = StateFormat.of(
            {k: MASTER_DTYPE if f.block_size else f for k, f in state_format.formats}
        )
    parts, scalars, page = [], {}, 0
    for name in stage_names:
        layout = layouts[layout_name(name)]
        first, n = own_pages(layout)
        held, scalars[name], release = states.freeze(name)
        files = isinstance(held, tuple)
        part = StagePart(
            stage=name,
            start=first * layout.page_elems,
            first_page=page,
            num_pages=n,
            release=release,
        )
        if files:
            part.pages = held
        elif blocks:
            part.slabs = functools.partial(_values, held, values, layout_name(name))
        else:
            part.slabs = held
        parts.append(part)
        page += n
    kinds = (
        list(state_format.kinds)
        if blocks
        else list(parts[0].slabs or []) or list(parts[0].pages[0].kinds)
    )
    state_layouts = {name: layouts[layout_name(name)] for name in stage_names}
    P = layouts["embed"].page_elems
    return StateSource(
        kinds=kinds,
        page_elems=P,
        num_pages=page,
        parts=parts,
        layouts=state_layouts,
        scalars=scalars,
        loss_scale=loss_scale,
        state_format=saved_format,
    )


def _values(held: dict, values, layout: str, /) -> dict[str, np.ndarray]:
    return {k: values(k, chunks, layout) for k, chunks in held.items()}


def restore(
    state: RuntimeState | StoredState,
    stage_names,
    layouts,
    optimizer_of,
    own_pages,
    states,
    params,
) -> None:
    """Replaces every stage's state (this process's part of it: ``own_pages``, read
    alone from a stored checkpoint, one stage at a time) and publishes its
    compute-dtype params. ``optimizer_of(stage)``: its SlabOptimizer."""
    for name in stage_names:
        kind = layout_name(name)
        layout, opt = layouts[kind], optimizer_of(name)
        first, n = own_pages(layout)
        start, stop = first * layout.page_elems, (first + n) * layout.page_elems
        if isinstance(state, StoredState) and state.same_layout(name, layout):
            own = {k: state.read(name, k, start, stop) for k in opt.kinds}
        elif isinstance(state, StoredState):  # laid out otherwise: from its params, whole
            own = {k: layout.flatten_np(state.stage_tree(name, k))[start:stop] for k in opt.kinds}
        else:
            own = {k: layout.flatten_np(state.stages[name][k])[start:stop] for k in opt.kinds}
        # each kind as this run holds it: a checkpoint of another state dtype converts
        # (bfloat16 widens exactly, float32 rounds to nearest even, int8 blocks quantize)
        slabs = {k: opt.held_chunks(kind, k, own[k]) for k in opt.kinds}
        scalars = [jax.device_put(np.asarray(a), opt.scalar_sharding) for a in state.scalars[name]]
        states.init_stage(name, slabs, scalars)
        params.publish(name, opt.compute_pages(kind, slabs[MASTER]))
    states.wait_init()
    params.commit()
