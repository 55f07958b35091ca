"""Where the compute-dtype params wait for the next forward (``offload.params``).

:class:`HostParamStore` keeps each stage's pages in host RAM (``host``);
:class:`NvmeParamStore` in TensorStore page arrays (``nvme``: two copies, the
committed one and the one the step's updates write, read ahead by the runtime's
window; fp32 params with the state on NVMe are its master pages instead); the
device-cached stages' params stay on the device (:class:`DeviceParamStore`), routed by
:class:`SplitParamStore`. Updates are
speculative until committed, as for optimizer state (``states.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.state_format import MASTER_DTYPE
from hetjax.storage.iopool import SlabPool
from hetjax.storage.nvme import (
    BaseCounters,
    PageFutures,
    PageStore,
    bound_writes,
    direct_io,
    forget_done,
)
from hetjax.storage.pages import LeafBuffers, SlabLayout, pages_slab
from hetjax.storage.param_cache import ParamCache
from hetjax.storage.states import copy_chunks
from hetjax.storage.stripes import Stripes
from hetjax.types import stage_layout


def same_client(pages: list, sharding: jax.sharding.Sharding) -> list:
    """Pages for a ``device_put`` into ``sharding``: an array of another JAX client (on a
    GPU, the host optimizer's refreshed params on the CPU client) as the numpy view of
    its host buffer. XLA then copies once into the device's ``pinned_host`` memory,
    where a cross-client ``device_put`` goes through a Literal: an extra copy, and many
    times slower (``gpucheck``'s ``bandwidth.publish`` measures both ways; the
    two-client emulation's figures are in docs/results/2026-11-24.md)."""
    (device,) = sharding.device_set
    client = device.client
    crosses = lambda p: isinstance(p, jax.Array) and next(iter(p.devices())).client is not client
    return [np.asarray(p) if crosses(p) else p for p in pages]


class LeafViews:
    """How the stores hand a stage's params to one device: leaf by leaf
    (``pages.LeafBuffers``, for layouts with ``leaf_buffers``), so that each weight gets
    a device buffer of its own and no stage function copies it out of the pages it
    spans. The stores keep pages where pages are what they store (NVMe, the optimizer's
    output): a host slab is cut into leaf views (no copy) where it becomes device-bound
    (:meth:`host`); the device cache's pages are cut on the device once per update
    (:meth:`device`)."""

    def __init__(self, layouts: dict[str, SlabLayout]):
        self.layouts = layouts
        self._cut: dict[str, object] = {}

    def host(self, stage: str, pages) -> LeafBuffers:
        """A stage's pages (numpy, or views of the host memory they are in) or its flat
        slab -> its leaves as views of the slab (of the one the pages are views of; a
        concatenation where they are not)."""
        slab = pages.reshape(-1) if isinstance(pages, np.ndarray) else pages_slab(list(pages))
        return self.layouts[stage_layout(stage)].leaf_views(slab)

    def device(self, stage: str, pages: list[jax.Array]) -> LeafBuffers:
        """A stage's pages on the device -> its leaves, copied out on the device."""
        name = stage_layout(stage)
        if name not in self._cut:
            self._cut[name] = jax.jit(self.layouts[name].leaves_of_pages)
        return self._cut[name](pages)


class HostParamStore:
    """Compute-dtype params of every stage in the host memory kind: pages, or (``views``)
    the leaf buffers one device takes."""

    def __init__(self, sharding: jax.sharding.Sharding, views: LeafViews | None = None):
        self.sharding = sharding
        self.views = views
        self.pages: dict[str, list[jax.Array] | LeafBuffers] = {}

    def publish(self, stage: str, pages: list) -> None:
        pages = same_client(pages, self.sharding)
        if self.views is not None:
            pages = self.views.host(stage, pages)
        self.pages[stage] = jax.device_put(pages, self.sharding)

    def prefetch(self, stage: str) -> None:
        pass

    def ready(self, stage: str) -> bool:
        """Whether ``get(stage)`` would not wait (for a read)."""
        return True

    def refresh(self, stage: str, pages_of) -> None:
        """A stage's committed params changed outside an update (deferred updates
        caught up, ``optimizer/deferred.py``): ``pages_of()`` gives the new ones."""
        self.publish(stage, pages_of())

    def get(self, stage: str, keep: bool = False) -> list:
        return self.pages[stage]  # (``keep``: held anyway)

    def commit(self) -> None:
        pass

    def abort(self) -> bool:
        """Returns True: pages are published in place, so dropping a step's updates
        needs them republished from the committed masters."""
        return True

    def close(self) -> None:
        pass

    def host_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.pages))

    nvme_bytes = read_bytes = write_bytes = 0  # nothing on NVMe


class DeviceParamStore(HostParamStore):
    """Compute-dtype param pages of the device-cached stages, in device memory: their
    update runs there and publishes in place; the runtime reads them as resident
    stages without a copy (``views``: cut into leaf buffers on the device, once per
    update)."""

    def publish(self, stage: str, pages: list) -> None:
        if self.views is not None:
            pages = self.views.device(stage, pages)
        self.pages[stage] = jax.device_put(pages, self.sharding)

    def host_bytes(self) -> int:
        return 0


class SplitParamStore(BaseCounters):
    """Compute-dtype params of the device-cached stages in ``device`` (a
    :class:`DeviceParamStore`), of the others in ``base`` (host RAM or NVMe)."""

    def __init__(self, device: DeviceParamStore, base, stages):
        self.device, self.base, self.stages = device, base, frozenset(stages)

    def _of(self, stage: str):
        return self.device if stage in self.stages else self.base

    def publish(self, stage: str, pages: list) -> None:
        self._of(stage).publish(stage, pages)

    def prefetch(self, stage: str) -> None:
        self._of(stage).prefetch(stage)

    def ready(self, stage: str) -> bool:
        return self._of(stage).ready(stage)

    def refresh(self, stage: str, pages_of) -> None:
        self._of(stage).refresh(stage, pages_of)

    def get(self, stage: str, keep: bool = False) -> list:
        return self._of(stage).get(stage, keep)

    def commit(self) -> None:
        self.device.commit()
        self.base.commit()

    def abort(self) -> bool:
        """True: the device pages are published in place, so a dropped step's updates
        need them republished (the loop republishes every stage; for ``base`` on NVMe
        that rewrites the uncommitted copy, which the next step overwrites)."""
        self.base.abort()
        return self.device.abort()

    def close(self) -> None:
        self.device.close()
        self.base.close()

    def device_arrays(self) -> list:
        return list(self.device.pages.values())


class _ReadInto:
    """A read of pages from disk into a pooled slab, as ``PageStore.read`` returns one: a
    future whose result is the pages (num_pages, page_elems)."""

    def __init__(self, write, slab: np.ndarray, page_elems: int):
        self._write, self._slab, self._page_elems = write, slab, page_elems

    def add_done_callback(self, callback) -> None:
        self._write.add_done_callback(lambda _: callback(self))

    def done(self) -> bool:
        return self._write.done()

    def result(self) -> np.ndarray:
        self._write.result()
        return self._slab.reshape(-1, self._page_elems)


class _Staged:
    """A read of pages from disk, copied into ``sharding`` (``pinned_host``) by the
    thread that completes the read, as ``pieces`` hands them out (pages, or leaf
    buffers); ``result()`` is what was copied."""

    def __init__(self, read, sharding: jax.sharding.Sharding, pieces):
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        self._sharding, self._pieces = sharding, pieces
        read.add_done_callback(self._land)

    def _land(self, read) -> None:
        try:
            self._done.set_result(pinned(self._pieces(read.result()), self._sharding))
        except BaseException as e:  # noqa: BLE001 — raised by result(), on the caller
            self._done.set_exception(e)

    def done(self) -> bool:
        return self._done.done()

    def result(self) -> list[jax.Array] | LeafBuffers:
        return self._done.result()


def pinned(pieces, sharding: jax.sharding.Sharding):
    """Host pieces (numpy pages or leaf buffers) copied into ``sharding`` (the device's
    ``pinned_host`` memory), waited for: on an I/O thread, so that the dispatching
    thread's copy to the device is a DMA from pinned memory."""
    return jax.block_until_ready(jax.device_put(pieces, sharding))


class OwnPages:
    """The param pages' own files: two copies of TensorStore arrays under ``path``
    (the committed one, read, and the one the step's updates write), or one written in
    place (``nvme_copies.py``)."""

    kind = "params"
    writes = True  # publish writes the pages

    def __init__(
        self,
        path: Path,
        dtype: Any,
        num_pages: int,
        page_elems: int,
        copies: int = 2,
        stripes: Stripes | None = None,
    ):
        kinds = {self.kind: np.dtype(dtype).name}
        self.disk = [
            PageStore(Path(path) / f"gen{g}", kinds, num_pages, page_elems, stripes=stripes)
            for g in range(copies)
        ]
        self.current = 0
        self._target = 0  # the copy publish writes into (the first commit keeps 0)

    def committed(self) -> PageStore:
        return self.disk[self.current]

    def cached(self, stage: str) -> None:
        return None

    def record(self, stage: str, read) -> None:
        pass

    def write(self, stage: str, first: int, data: np.ndarray) -> PageFutures:
        return self.disk[self._target].write(self.kind, first, data, borrowed=True)

    def commit(self) -> None:
        if self._target != self.current:
            self.current = self._target
        self._target = (1 - self.current) % len(self.disk)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.disk)


class MasterPages:
    """fp32 params with the optimizer state on NVMe too are its fp32 master, bit for bit
    (``memory.params_are_master``), so they get no files of their own: a stage is read
    from the state store's committed master pages, or copied from its cached master
    where the host caches the stage's state, and the state store's write of the master
    is the params' write. Saves writing every param twice a step and a second copy of
    them on NVMe (docs/results/2026-11-25.md)."""

    kind = "master"
    writes = False  # the state store writes them

    def __init__(self, states):
        """``states``: the NvmeStateStore (offered each read of its master pages, which
        its own read of the same stage may copy: ``nvme_states.MasterReads``)."""
        self.states = states

    def record(self, stage: str, read) -> None:
        """A read of a stage's committed master pages (a future of its pages)."""
        self.states.offer_master_read(stage, read)

    def committed(self) -> PageStore:
        return self.states.disk[self.states.current]

    def cached(self, stage: str):
        """A cached stage's committed master (a slab or its chunks), else None. The
        update after the next commit writes into the other copy of it
        (``states.recycle``)."""
        if stage not in self.states.cached:
            return None
        return self.states.cache[stage]["master"]

    def write(self, stage: str, first: int, data: np.ndarray) -> PageFutures:
        """Nothing to write: the state store's write of the stage's master this step,
        whose landing ends the need for ``data`` (done at once: none, the stage is
        cached or was not updated, as at start-up, where its state is written)."""
        return PageFutures(self.states.written(stage, self.kind))

    def commit(self) -> None:
        pass  # the state store's commit made its copy current

    nbytes = 0


class NvmeParamStore:
    """Compute-dtype param pages on disk, read ahead for the forward and backward by the
    runtime's window: two copies of their own (:class:`OwnPages`), or, fp32 with
    the state on NVMe, the state's master (:class:`MasterPages`); copies in RAM by
    :class:`ParamCache`'s rules."""

    def __init__(
        self,
        path: Path | None,
        dtype: Any,
        stage_pages: dict[str, tuple[int, int]],
        page_elems: int,
        *,
        stage_to: jax.sharding.Sharding | None = None,
        views: LeafViews | None = None,
        slabs: SlabPool | None = None,
        master_of=None,
        keep_published: tuple[str, ...] = (),
        copies: int = 2,
        stripes: Stripes | None = None,
    ):
        """``stage_to``: the device's ``pinned_host`` memory, where pages read from disk
        are copied as soon as they land (by the thread completing the read, not the
        dispatch thread), so the copy to the device is a DMA from pinned memory, not a
        copy from pageable memory through a bounce buffer. None: pages stay numpy (a
        CPU, where the two memories are one). ``views``: stages are handed out as leaf
        buffers (cut where the read lands), else as pages. ``slabs``: the pool the reads
        land in (and the host optimizer's refreshed params come from), else each read
        gets a fresh buffer. ``master_of``: the NVMe state store whose fp32 master the
        params are (:class:`MasterPages`; ``path`` unused), else they have files of
        their own under ``path`` (:class:`OwnPages`). ``keep_published``: stages whose
        published pages are kept to the commit, landed or not, and handed to their
        first ``get`` after it from RAM (:class:`ParamCache`). ``copies``: of own
        files (:class:`OwnPages`): 2, or 1 written in place; ``stripes``: the drives
        their pages stripe over."""
        self.stage_pages = stage_pages
        self.slabs = slabs
        self.stage_to = stage_to
        self.views = views
        self.page_elems = page_elems
        self.dtype = np.dtype(dtype)
        num_pages = sum(n for _, n in stage_pages.values())
        if master_of is not None:
            assert self.dtype == MASTER_DTYPE, "only params in the master's dtype are the master"
            self.pages = MasterPages(master_of)
        else:
            self.pages = OwnPages(path, dtype, num_pages, page_elems, copies, stripes)
        self.cache = ParamCache(keep_published)
        # stage -> (landing data, future of its pinned copy): with ``stage_to``, a
        # landing stage's published data staged ahead by ``prefetch`` as a read would be
        self._staging: dict[str, tuple[np.ndarray, Any]] = {}
        self._writes: list = []
        self._write_window = max(n for _, n in stage_pages.values()) * page_elems * 4
        self.read_bytes = self.write_bytes = 0
        self.stage_reads: collections.Counter[str] = collections.Counter()  # from disk

    @property
    def keep_published(self) -> frozenset[str]:
        return self.cache.keep_published

    @property
    def disk(self) -> list[PageStore]:
        """The param pages' own copies (:class:`OwnPages`)."""
        return self.pages.disk

    def publish(self, stage: str, pages: list) -> None:
        """Writes a stage's new pages: they are the caller's no more (the write
        references them instead of copying: the host kernel's pages are views of one
        fresh slab, written as they are)."""
        data = pages_slab(pages)
        first, _ = self.stage_pages[stage]
        future = self.pages.write(stage, first, data)
        self.cache.publish(stage, future, data)  # (a commit serves it from ``data``)
        if self.pages.writes:
            self._writes.append((future, data))
            self.write_bytes += data.nbytes
            bound_writes(self._writes, self._write_window)

    def _pieces(self, stage: str, data: np.ndarray) -> list | LeafBuffers:
        """A stage's data on the host (its pages, or one flat slab) -> as it is handed
        out: its leaf buffers (views) or its pages."""
        if self.views is not None:
            return self.views.host(stage, data)
        return list(data.reshape(-1, self.page_elems))

    def refresh(self, stage: str, pages_of) -> None:
        """A stage's committed params changed outside an update (deferred updates
        caught up, ``optimizer/deferred.py``; the loop is idle): the copies in RAM and
        the reads ahead are dropped, and own files get ``pages_of()`` (the fp32
        master's are the state store's, written already: nothing is read for them)."""
        self.cache.drop(stage)
        self._staging.pop(stage, None)
        if self.pages.writes:
            first, _ = self.stage_pages[stage]
            data = np.ascontiguousarray(pages_slab(pages_of()), self.dtype)
            self.pages.committed().write(self.pages.kind, first, data).result()

    def prefetch(self, stage: str) -> None:
        cache = self.cache
        if stage in cache.reads or cache.in_ram(stage):
            self._stage_landing(stage)
            return
        cache.before_read(stage)
        first, n = self.stage_pages[stage]
        cached = self.pages.cached(stage)
        if cached is not None:  # in RAM already: copied as a read would land, on the
            # I/O threads (not the dispatching one)
            slab = self._slab(n)
            read = direct_io().submit(lambda: copy_chunks(cached, slab).reshape(n, -1))
        elif self.slabs is not None:
            disk, kind = self.pages.committed(), self.pages.kind
            slab = self._slab(n)
            read = _ReadInto(disk.read_into(kind, first, slab), slab, self.page_elems)
            self.pages.record(stage, read)
        else:
            read = self.pages.committed().read(self.pages.kind, first, n)
        if self.stage_to:
            read = _Staged(read, self.stage_to, lambda data: self._pieces(stage, data))
        cache.reads[stage] = read

    def _stage_landing(self, stage: str) -> None:
        """With ``stage_to``: a landing stage's data (published last step, served from
        RAM) copied to pinned memory on the I/O threads, as a read lands (a
        ``keep_published`` stage's, handed out once, too)."""
        landing = self.cache.landing.get(stage)  # (one look: a lock-free loop commits)
        if not self.stage_to or landing is None or stage in self.cache.kept:
            return
        data = landing[1]
        if stage not in self._staging or self._staging[stage][0] is not data:
            pieces = lambda: pinned(self._pieces(stage, data), self.stage_to)
            self._staging[stage] = (data, direct_io().submit(pieces))

    def _landed(self, stage: str, data: np.ndarray) -> list | LeafBuffers:
        """A landing stage's data as ``get`` hands it out: pinned with ``stage_to``
        (staged ahead by ``prefetch`` where that copy is of this data, else here), else
        views of it."""
        staged = self._staging.pop(stage, None)
        if not self.stage_to:
            return self._pieces(stage, data)
        if staged is not None and staged[0] is data:
            return staged[1].result()
        return pinned(self._pieces(stage, data), self.stage_to)

    def ready(self, stage: str) -> bool:
        """Whether ``get(stage)`` would not wait for a read: in RAM, or read ahead and
        landed."""
        if self.cache.in_ram(stage):
            return True
        read = self.cache.reads.get(stage)
        return read is not None and read.done()

    def get(self, stage: str, keep: bool = False) -> list | LeafBuffers:
        """A stage's params as the device takes them. ``keep``: hold them for the
        stage's next get too (a block's backward after its forward), which then reads
        nothing; that get hands them over and lets them go."""
        cache = self.cache
        if stage in cache.kept:
            return cache.kept.pop(stage)
        landing = cache.serve_landing(stage)  # written last step, maybe in flight
        if landing is not None:
            data = self._landed(stage, landing)
        else:
            self.prefetch(stage)
            data = cache.reads.pop(stage).result()
            if self.pages.cached(stage) is None:
                _, n = self.stage_pages[stage]
                self.read_bytes += n * self.page_elems * self.dtype.itemsize
                self.stage_reads[stage] += 1
            data = data if self.stage_to else self._pieces(stage, data)
        if keep:
            cache.kept[stage] = data
        return data

    def commit(self) -> None:
        """Makes the step's params current without waiting for the writes still in
        flight (the stages updated last, which the next forward needs first): those
        stages are served from the written data until the next commit."""
        self.cache.commit()
        landing = self.cache.landing  # copies staged of data no longer landing go
        self._staging = {
            s: v for s, v in self._staging.items() if s in landing and landing[s][1] is v[0]
        }
        forget_done(self._writes)  # a write done by now is not landing: had it failed?
        self.pages.commit()
        # Reads still in flight were of the old copy: a consistent snapshot, one
        # update old (sync mode has none outstanding at a commit).

    def abort(self) -> bool:
        """Drops the step's writes: the copy stays; the next publish overwrites
        them. Returns False: the committed copy was never touched."""
        self.wait()
        return False

    def close(self) -> None:
        """Waits for the reads and writes in flight: a read ahead for a step that never
        comes would land after the run closed (in pinned memory, arrays of no one's),
        and its files may be about to go."""
        for read in self.cache.reads.values():
            with contextlib.suppress(Exception):  # a failed read: no one asks for it now
                read.result()
        self.cache.reads.clear()
        self.wait()

    def wait(self) -> None:
        self.cache.kept.clear()
        staging, self._staging = self._staging, {}
        for _, copy in staging.values():  # (a copy on the I/O threads: let it finish)
            copy.result()
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self.cache.forget()

    def host_bytes(self) -> int:
        pooled = self.slabs.holds if self.slabs is not None else lambda a: False
        landing = self.cache.landing.values()
        writes = [d for _, d in [*self._writes, *landing] if not pooled(d)]
        held = {id(d): d.nbytes for d in writes}
        kept = jax.tree.leaves(list(self.cache.kept.values()))
        kept = [a for a in kept if not (isinstance(a, np.ndarray) and pooled(a))]
        slabs = self.slabs.nbytes if self.slabs is not None else 0  # free or handed out
        done = [f for _, f in list(self._staging.values()) if f.done() and not f.exception()]
        staged = [f.result() for f in done]
        staged = sum(a.nbytes for a in jax.tree.leaves(staged))  # pinned copies ahead
        return sum(held.values()) + sum(a.nbytes for a in kept) + slabs + staged

    def _slab(self, num_pages: int) -> np.ndarray:
        """A buffer for a stage's pages: pooled, or fresh."""
        elems = num_pages * self.page_elems
        return (
            self.slabs.take(elems, self.dtype)
            if self.slabs is not None
            else np.empty(elems, self.dtype)
        )

    @property
    def nvme_bytes(self) -> int:
        return self.pages.nbytes
