"""Offloaded inference's runtime (``hetjax generate`` with ``offload.mode=stream``): the
model's compute-dtype params in the training runtime's param store (``offload.params``:
host RAM, ``storage/params.HostParamStore``, or NVMe, ``storage/params.NvmeParamStore``
with one copy of files of its own), each block brought to the device through the
same prefetch window (``window.PrefetchWindow``) a training forward uses; embed and head
resident. No optimizer state, no gradients, no update loop: the params are read once,
stage by stage, from the run's newest checkpoint, an HF directory or a random init
(``init_source``), cast to the compute dtype and published to the store.

:class:`InferenceRuntime` has the two methods the generation loops call
(``hetjax/inference.py``'s :class:`StreamedBlocks` and :class:`StreamedSeq2Seq`):
:meth:`~InferenceRuntime.stream_blocks`, which folds a step over one stage group's
blocks in forward order, and :meth:`~InferenceRuntime.resident_pages`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import memory
from hetjax.config import Config
from hetjax.config_values import format_bytes
from hetjax.memory import window_wait_lag
from hetjax.parallel.single import SingleDevice
from hetjax.runtime.loop.window import PrefetchWindow
from hetjax.runtime.setup import layout_name, progress
from hetjax.storage.iopool import SlabPool
from hetjax.storage.nvme import check_nvme_path
from hetjax.storage.pages import SlabLayout
from hetjax.storage.params import HostParamStore, LeafViews, NvmeParamStore
from hetjax.storage.stripes import stripes_of
from hetjax.types import MASTER, group_key, is_block
from models import build_model

# A stage's fp32 params as a flat slab (its layout's padded size), by stage name.
StageSource = Callable[[str], np.ndarray]


def init_source(config: Config, model, layouts: dict[str, SlabLayout], state=None) -> StageSource:
    """Where each stage's fp32 params come from, one stage at a time (a model need not
    fit in RAM at once): ``state`` (a checkpoint's, ``checkpoint.restore_newest``: a
    ``StoredState`` read stage by stage, or a ``RuntimeState``), else the HF checkpoint
    of ``model.init_from``, else a random init with the keys a training run uses
    (``model.stage_keys(train.seed)``: the params equal its initial ones)."""
    from hetjax.checkpoint_state import StoredState  # start-up cost: orbax
    from hetjax.hf import open_checkpoint

    if state is not None:

        def from_state(name: str) -> np.ndarray:
            layout = layouts[layout_name(name)]
            if isinstance(state, StoredState) and state.same_layout(name, layout):
                return state.read(name, MASTER, 0, layout.padded_size)
            if isinstance(state, StoredState):  # laid out otherwise: from its params
                return layout.flatten_np(state.stage_tree(name, MASTER))
            return layout.flatten_np(state.stages[name][MASTER])

        return from_state
    checkpoint = open_checkpoint(config.model)
    if checkpoint is not None:
        return lambda name: layouts[layout_name(name)].flatten_np(checkpoint.stage(name))
    keys = model.stage_keys(jax.random.key(config.train.seed))
    inits: dict[str, Any] = {}  # one jitted init per layout

    def random(name: str) -> np.ndarray:
        kind = layout_name(name)
        key = keys[group_key(kind)][int(name[len(kind) :])] if is_block(name) else keys[kind]
        if kind not in inits:
            layout = layouts[kind]
            inits[kind] = jax.jit(lambda k: layout.flatten(model.init_stage(kind, k)))
        return np.asarray(inits[kind](key))

    return random


@dataclasses.dataclass(frozen=True)
class InferencePlan:
    """What offloaded inference holds in each tier, in bytes (compute dtype)."""

    resident: int  # embed and head, on the device throughout
    window_slabs: int  # blocks on the device at once: the one computing + prefetch_depth
    block: int  # the largest block's slab
    blocks: int  # every block's slab
    params_tier: str  # offload.params: where the blocks wait (host or nvme)
    prefetch_depth: int

    @property
    def device(self) -> int:
        """Params on the device at the window's fullest (the KV cache comes on top)."""
        return self.resident + self.window_slabs * self.block

    def describe(self, nvme_dir: Path | None) -> list[str]:
        where = "host RAM" if self.params_tier == "host" else f"NVMe files under {nvme_dir}"
        return [
            "inference plan (offloaded, no optimizer state, no gradients):",
            f"  device: embed and head resident {format_bytes(self.resident)}, a window of "
            f"{self.window_slabs} block slabs x {format_bytes(self.block)} "
            f"(offload.prefetch_depth={self.prefetch_depth}): "
            f"{format_bytes(self.device)} of params, and the KV cache",
            f"  blocks: {format_bytes(self.blocks)} in {where} (offload.params="
            f"{self.params_tier}), each brought to the device once per forward",
        ]


class InferenceRuntime:
    """The blocks of ``config``'s model streamed to one device from their tier for
    forwards only (see the module docstring). ``state``: a checkpoint's to load the
    params from (:func:`init_source`); ``workdir``: where the NVMe files go when
    ``memory.nvme_path`` is empty (None: a temporary directory, removed at close)."""

    def __init__(self, config: Config, state=None, workdir=None):
        self.config = config
        off, mem = config.offload, config.memory
        self.parallel = SingleDevice()
        self.model = model = build_model(config.model)
        self.layouts = self.parallel.stage_layouts(model, mem.page_size)
        self.dtype = jnp.dtype(config.model.compute_dtype)
        self.groups = [[g.stage(i) for i in range(g.num_layers)] for g in model.groups]
        self.block_names = [n for names in self.groups for n in names]
        stage_names = ["embed", *self.block_names, "head"]
        nbytes = lambda n: self.layouts[layout_name(n)].padded_size * self.dtype.itemsize
        self.plan = InferencePlan(
            resident=nbytes("embed") + nbytes("head"),
            window_slabs=off.prefetch_depth + 1,
            block=max(nbytes(n) for n in self.block_names),
            blocks=sum(nbytes(n) for n in self.block_names),
            params_tier=off.params,
            prefetch_depth=off.prefetch_depth,
        )
        self.nvme_dir, self._temporary = None, False
        self.param_store = self._store(nbytes, workdir)
        source = init_source(config, model, self.layouts, state)
        for name in progress(stage_names, f"loading params ({off.params})"):
            slab = source(name).astype(self.dtype)  # (padded_size,), its pages' views
            self.param_store.publish(name, list(slab.reshape(-1, self._page_elems)))
            del slab
        if isinstance(self.param_store, NvmeParamStore):
            self.param_store.wait()  # every write landed: nothing held in RAM
        self.param_store.commit()
        to = self.parallel.to_device
        self.resident = {n: to(self.param_store.get(n), self.layouts[n]) for n in ("embed", "head")}
        accelerator = self.parallel.shardings.pinned_staging() is not None
        self._lag = window_wait_lag(accelerator)

    @property
    def _page_elems(self) -> int:
        return self.layouts["embed"].page_elems

    def _store(self, nbytes, workdir):
        """The param store of ``offload.params``: host RAM, or one copy of NVMe
        files (checked for their bytes) under ``memory.nvme_path``, the workdir's
        ``nvme/inference`` or a temporary directory."""
        shardings = self.parallel.shardings
        views = LeafViews(self.layouts) if self.layouts["embed"].leaf_buffers else None
        if self.config.offload.params != "nvme":
            return HostParamStore(shardings.host, views)
        drives = self.config.memory.nvme_paths
        if drives:
            paths = [Path(d) / "inference" for d in drives]
        elif workdir is not None:
            paths = [Path(workdir) / "nvme" / "inference"]
        else:
            paths, self._temporary = [Path(tempfile.mkdtemp(prefix="hetjax-infer-"))], True
        stripes = stripes_of(paths)
        total = sum(nbytes(n) for n in ["embed", *self.block_names, "head"])
        for path in (stripes.root, *stripes.others):
            check_nvme_path(path, -(-total // stripes.count), "the params")
        self.nvme_dir = stripes.root
        pages, first = {}, 0
        for name in ["embed", *self.block_names, "head"]:
            n = nbytes(name) // (self._page_elems * self.dtype.itemsize)
            pages[name], first = (first, n), first + n
        # the window's slabs and the reads ahead of it, reused from read to read
        reads = self.plan.window_slabs + memory.IO_READAHEAD + 1
        return NvmeParamStore(
            stripes.root / "params", self.dtype, pages, self._page_elems,
            stage_to=shardings.pinned_staging(), views=views,
            slabs=SlabPool(reads * self.plan.block), copies=1, stripes=stripes,
        )  # fmt: skip

    def _to_device(self, stage: str, slab):
        return self.parallel.to_device(slab, self.layouts[layout_name(stage)])

    def stream_blocks(self, step, carry, group: int | None = None):
        """Folds ``carry = step(index, pages, carry)`` over the blocks of stage group
        ``group`` (None: every group's, in forward order), ``index`` the block's place in
        that order, each block's pages brought to the device through the prefetch window
        from their tier. The window waits on the carry's first leaf."""
        names = self.block_names if group is None else self.groups[group]
        window = PrefetchWindow(
            names, self.plan.prefetch_depth, self.resident, self.param_store,
            self._to_device, lag=self._lag,
        )  # fmt: skip
        for j in range(len(names)):
            slab = window.get(j)
            carry = step(j, slab, carry)
            del slab  # the window decides when a slab goes
            window.done(j, after=jax.tree.leaves(carry)[0])
        return carry

    def resident_pages(self, stage: str):
        """The device pages of ``embed`` or ``head``."""
        return self.resident[stage]

    def plan_lines(self) -> list[str]:
        return self.plan.describe(self.nvme_dir)

    def close(self) -> None:
        self.param_store.close()
        if self.nvme_dir is not None and self._temporary:
            shutil.rmtree(self.nvme_dir, ignore_errors=True)
