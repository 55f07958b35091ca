"""A streaming run's state in the placement-free form (``types.RuntimeState``) and back:
what training checkpoints save and restore, and the master params a run returns."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hetjax.runtime.setup import layout_name
from hetjax.storage.pages import SlabLayout
from hetjax.types import MASTER, RuntimeState, StateStore


def master_params(
    stage_names: list[str], layouts: dict[str, SlabLayout], states: StateStore, whole_slab
) -> Any:
    """The fp32 master params as the model's pytree (host numpy); ``whole_slab`` turns
    this process's part of a slab into the whole one."""
    unflat = lambda name: jax.tree.map(
        np.array, layouts[layout_name(name)].unflatten(whole_slab(states.master(name)))
    )
    blocks = [unflat(n) for n in stage_names if n.startswith("block")]
    return {
        "embed": unflat("embed"),
        "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks),
        "head": unflat("head"),
    }


def snapshot(
    stage_names: list[str],
    layouts: dict[str, SlabLayout],
    states: StateStore,
    whole_slab,
    loss_scale: tuple[float, int] | None,
) -> RuntimeState:
    """Every stage's committed state, per kind, as the stage's params pytree."""
    stages, scalars = {}, {}
    for name in stage_names:
        layout = layouts[layout_name(name)]
        slabs, scalars[name] = states.committed(name)
        stages[name] = {k: layout.unflatten(whole_slab(slab)) for k, slab in slabs.items()}
    return RuntimeState(stages, scalars, loss_scale)


def restore(
    state: RuntimeState, stage_names, layouts, optimizer_of, own_slab, states, params
) -> None:
    """Replaces every stage's state (this process's part of it, ``own_slab``) and
    publishes its compute-dtype params. ``optimizer_of(stage)``: its SlabOptimizer."""
    for name in stage_names:
        kind = layout_name(name)
        layout, opt = layouts[kind], optimizer_of(name)
        whole = state.stages[name]
        own = {k: own_slab(layout, layout.flatten_np(whole[k])) for k in opt.kinds}
        slabs = {k: opt.as_chunks(kind, own[k]) for k in opt.kinds}
        scalars = [jax.device_put(np.asarray(a), opt.sharding) for a in state.scalars[name]]
        states.init_stage(name, slabs, scalars)
        params.publish(name, opt.compute_pages(kind, slabs[MASTER]))
    states.wait_init()
    params.commit()
