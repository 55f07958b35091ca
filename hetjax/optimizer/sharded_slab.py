"""Optimizer state on a process's devices, each device holding and updating its own pages.

Under ZeRO-3 a process drives several devices and updates the pages of all of them
(``parallel/zero.py``: a contiguous page range of every stage). With its optimizer state
in device memory (``offload.optimizer=device``, or the device cache of
``offload.optimizer_device_stages``), each device keeps its own pages' state: a kind's
slab is one global array over the process's devices (``NamedSharding``, split on its
only axis), whose shard on each device is that device's contiguous pages. The update is
elementwise, so each device updates its shard on its own (one :class:`SlabOptimizer`
per device, over that device's page range; no communication); the global gradient norm
comes from page norms as before. The refreshed params' pages stay on the device that
computed them (``zero.ShardedParamStore`` makes them the stage's sharded slab).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from hetjax.config import OptimizerConfig
from hetjax.optimizer import moments
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.storage.pages import GradPages, SlabLayout

AXIS = "pages"  # the local mesh's one axis: a slab's pages, split in device order


def device_state_sharding(devices: list[jax.Device]) -> NamedSharding:
    """Where a process's optimizer state on its ``devices`` lives: a flat slab split into
    contiguous parts, one per device in page order, in device memory."""
    mesh = Mesh(np.array(devices), (AXIS,))
    return NamedSharding(mesh, PartitionSpec(AXIS), memory_kind="device")


class ShardedSlabOptimizer:
    """:class:`SlabOptimizer`'s API over state in ``sharding`` (:func:`device_state_sharding`):
    each kind's slab one global array (a list of one chunk), each device's shard updated
    by a :class:`SlabOptimizer` of its own on that device, over its own page range (the
    decay split point moving with it). Scalars (step counts) live on the first device."""

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        layouts: dict[str, SlabLayout],
        sharding: NamedSharding,
        compute_dtype: Any,
    ):
        self.cfg, self.layouts, self.sharding = cfg, layouts, sharding
        self.devices = list(sharding.mesh.devices.flat)
        n = len(self.devices)
        self.parts: list[SlabOptimizer] = []
        for i, device in enumerate(self.devices):
            own = {
                name: lay.shard(i * lay.num_pages // n, lay.num_pages // n)
                for name, lay in layouts.items()
            }
            part = SlabOptimizer(
                cfg,
                total_steps,
                own,
                SingleDeviceSharding(device, memory_kind="device"),
                compute_dtype,
            )
            part.chunk_elems = 0  # one chunk per device: the shard of the global slab
            self.parts.append(part)
        first = self.parts[0]
        self.kinds, self.state_format = first.kinds, first.state_format
        self.scalar_sharding = first.sharding
        self.param_buffers = None  # (the host optimizer's; unused on the device)

    # -- between global slabs and the devices' parts -------------------------------------

    def _bounds(self, layout_name: str) -> list[tuple[int, int]]:
        """``[start, end)`` elements of each device's part of a stage's slab."""
        size = self.layouts[layout_name].padded_size // len(self.devices)
        return [(i * size, (i + 1) * size) for i in range(len(self.devices))]

    def _shards(self, slab) -> list:
        """A global slab (or an int8 pytree of them, or a list of one) -> each device's
        shard, in device order (no copy)."""
        if isinstance(slab, list):
            (slab,) = slab

        def per_device(a):
            by_device = {s.device: s.data for s in a.addressable_shards}
            return [by_device[d] for d in self.devices]

        leaves, treedef = jax.tree.flatten(slab)
        shards = [per_device(a) for a in leaves]
        return [
            jax.tree.unflatten(treedef, [s[i] for s in shards]) for i in range(len(self.devices))
        ]

    def _parts_of(self, layout_name: str, slab) -> list:
        """A whole slab anywhere (a global one, host numpy, one device's array) -> each
        device's part."""
        if isinstance(slab, list) and len(slab) == 1:
            slab = slab[0]
        leaves = jax.tree.leaves(slab)
        if all(isinstance(a, jax.Array) and a.sharding == self.sharding for a in leaves):
            return self._shards(slab)
        assert not isinstance(slab, list), "a whole slab or the global one"
        P = self.layouts[layout_name].page_elems
        return [moments.elements(slab, a, b, P) for a, b in self._bounds(layout_name)]

    def _global(self, parts: list):
        """Each device's chunk (an array, or an int8 pytree) -> the global one."""

        def one(*xs):
            shape = (sum(x.shape[0] for x in xs), *xs[0].shape[1:])
            xs = [jax.device_put(x, p.sharding) for x, p in zip(xs, self.parts, strict=True)]
            return jax.make_array_from_single_device_arrays(shape, self.sharding, xs)

        return jax.tree.map(one, *parts)

    def _assemble(self, states: list[dict[str, list]]) -> dict[str, list]:
        return {k: [self._global([s[k][0] for s in states])] for k in self.kinds}

    # -- the API ------------------------------------------------------------------------

    def init(self, layout_name: str, master) -> tuple[dict[str, list], list]:
        """:meth:`SlabOptimizer.init`, each device's part of ``master`` on that device."""
        out = [
            p.init(layout_name, m)
            for p, m in zip(self.parts, self._parts_of(layout_name, master), strict=True)
        ]
        return self._assemble([slabs for slabs, _ in out]), out[0][1]

    def update(
        self,
        layout_name: str,
        slabs: dict[str, Any],
        scalars: list,
        grad,
        clip: tuple[float, float],
        spare: dict[str, list] | None = None,
        in_place: bool = False,
        skip: frozenset[int] = frozenset(),
        catch_up: tuple = (),
    ) -> tuple[dict[str, list], list, list[jax.Array]]:
        """:meth:`SlabOptimizer.update`, each device updating its own shard with its
        part of ``grad`` (a global device slab, its shards where they are; or the host
        gradient's pages of its range). The params' pages are each on its device."""
        assert not (skip or catch_up), "deferred updates need the native kernel on host buffers"
        states = {k: self._parts_of(layout_name, slabs[k]) for k in self.kinds}
        spares = {k: self._shards(spare[k]) for k in self.kinds} if spare is not None else None
        if isinstance(grad, jax.Array) and grad.sharding == self.sharding:
            grads = self._shards(grad)
        else:
            pages = GradPages.of(grad)
            grads = [GradPages(tuple(pages.chunk(a, b))) for a, b in self._bounds(layout_name)]
        new, pages, new_scalars = [], [], scalars
        for i, part in enumerate(self.parts):
            out, out_scalars, out_pages = part.update(
                layout_name,
                {k: [states[k][i]] for k in self.kinds},
                jax.device_put(scalars, part.sharding),
                grads[i],
                clip,
                spare=None if spares is None else {k: [spares[k][i]] for k in self.kinds},
                in_place=in_place,
            )
            new.append(out)
            pages += out_pages
            if i == 0:
                new_scalars = out_scalars
        return self._assemble(new), new_scalars, pages

    def compute_pages(self, layout_name: str, master) -> list[jax.Array]:
        """The master's pages in the compute dtype, each on the device that owns it."""
        pages = []
        for p, m in zip(self.parts, self._parts_of(layout_name, master), strict=True):
            pages += p.compute_pages(layout_name, m)
        return pages

    def held_chunks(self, layout_name: str, kind: str, values: np.ndarray) -> list:
        """:meth:`SlabOptimizer.held_chunks`: the values' parts held on their devices."""
        parts = [
            p.held_chunks(layout_name, kind, v)
            for p, v in zip(self.parts, self._parts_of(layout_name, values), strict=True)
        ]
        return [self._global([c[0] for c in parts])]

    def values(self, kind: str, chunks: list, layout_name: str) -> np.ndarray:
        """A kind's global slab as flat numpy values (float32 for int8 blocks)."""
        shards = self._shards(chunks)
        return np.concatenate(
            [p.values(kind, [s], layout_name) for p, s in zip(self.parts, shards, strict=True)]
        )

    def state_bytes(self, layout_name: str) -> int:
        """Bytes of one stage's slabs over all the devices (all kinds)."""
        return sum(p.state_bytes(layout_name) for p in self.parts)
