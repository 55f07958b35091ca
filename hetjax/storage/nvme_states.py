"""The NVMe tier of optimizer state (``offload.optimizer=nvme``): :class:`NvmeStateStore`
keeps each stage's slabs in TensorStore page arrays on disk, with a host RAM cache for
as many stages as ``memory.host_budget`` allows. The access order is known and cyclic
(backward order, every step), so the cache is chosen by Belady's rule (evict the stage
whose next use is furthest) simulated over that order at start-up
(``memory_host.belady_cache``); the other stages stream from disk every step, with
read-ahead and delayed write-back (writes complete while later stages update).

On disk there are two copies of every array, one holding the committed state and
one receiving the step's writes, and ``commit`` flips them; or one, written in place,
where no written update can be dropped (``nvme_copies.py``). See ``states.py`` for the
stores' interface and why updates are speculative until committed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax import faults
from hetjax.state_format import StateFormat
from hetjax.storage.iopool import IoPool, Slot
from hetjax.storage.nvme import PageStore, bound_writes, forget_done
from hetjax.storage.pages import page_runs, runs_outside
from hetjax.storage.states import MANIFEST, Frozen, flat
from hetjax.storage.stripes import Stripes
from hetjax.types import MASTER


class NvmeStateStore:
    """Optimizer state in TensorStore arrays under ``path``, ``copies`` copies of it
    (two, or one written in place), with a host cache of the stages in ``cached``."""

    def __init__(
        self,
        path: Path,
        state_format: StateFormat,
        stage_pages: dict[str, tuple[int, int]],
        page_elems: int,
        *,
        cached: list[str],
        sharding: jax.sharding.Sharding,
        io_slots: int,
        master_reads_kept: int = 0,
        copies: int = 2,
        stripes: Stripes | None = None,
    ):
        """``state_format``: the kinds and their dtypes (``state_format.py``).
        ``stage_pages``: stage -> (first page, number of pages); ``cached``: the
        stages kept in host RAM (``sharding``); ``io_slots``: stages' worth of pooled
        I/O buffers (``iopool.py``), what the host plan counts (``memory.IO_SLOTS``);
        ``master_reads_kept``: how many reads of the committed master pages made
        elsewhere are kept for this store's reads (:class:`MasterReads`);
        ``copies``: 2, or 1 where no written update can be dropped
        (``nvme_copies.py``: a step writes the committed pages in place); ``stripes``:
        the drives the pages stripe over (``stripes.py``)."""
        self.path = Path(path)
        self.state_format = state_format
        self.kinds = state_format.kinds
        self.stage_pages = stage_pages  # stage -> (first page, number of pages)
        self.page_elems = page_elems
        self.cached = set(cached)
        self.sharding = sharding  # where cached slabs live (host RAM)
        num_pages = sum(n for _, n in stage_pages.values())
        dtypes = state_format.dtypes
        self.disk = [
            PageStore(self.path / f"gen{g}", dtypes, num_pages, page_elems, stripes=stripes)
            for g in range(copies)
        ]
        self.current = 0  # the copy holding the committed state
        # streamed stages a dropped step wrote in place (one copy): neither read
        # nor checkpointed until a restore rewrites them
        self._torn: set[str] = set()
        self.cache: dict[str, dict[str, jax.Array]] = {}
        self.scalars: dict[str, list] = {}
        self._pending_cache: dict[str, dict] = {}
        self._pending_scalars: dict[str, list] = {}
        self._spare: dict[str, dict] = {}  # cached stages' dead copies (recycle)
        self._writes: list = []  # (future, data kept alive until the write completes)
        # stage -> its write futures into the committed copy that a commit did not
        # wait for (the step's tail: see ``commit``); a read of the stage waits for them
        self._landing: dict[str, list] = {}
        self._by_stage: dict[str, list] = {}  # the step's writes, by stage
        self._by_kind: dict[tuple[str, str], list] = {}  # and their futures by (stage, kind)
        self._manifest_due = False
        biggest = max(n for _, n in stage_pages.values()) * page_elems
        # Write-back in flight: the biggest stage's state, as the host plan counts it.
        self._write_window = state_format.nbytes(biggest)
        self._pool = IoPool(dtypes, biggest, io_slots)
        self._reads: dict[str, _Read] = {}  # read-ahead into the pool, this copy
        self._held: dict[str, Slot] = {}  # read and handed out, not yet written back
        self._catching: dict[str, Slot] = {}  # read for a catch-up, not yet written back
        self._frozen = Frozen()  # cached slabs and copies a checkpoint writes from
        self.read_bytes = self.write_bytes = 0
        self.read_kinds: collections.Counter[str] = collections.Counter()  # bytes by kind
        # The committed state's version (a commit or a restore makes a new one), and
        # the reads of its master pages made elsewhere, tagged with it
        self.version = 0
        self._master_reads = MasterReads(master_reads_kept)
        self._write_manifest()

    # -- start-up -----------------------------------------------------------------------

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        self._drop_reads()  # of state this replaces (a restore)
        self._torn.discard(stage)
        self.version += 1
        self.scalars[stage] = scalars
        if stage in self.cached:
            self.cache[stage] = jax.device_put(slabs, self.sharding)
        else:
            self._wait_writes()  # one stage in flight: start-up RAM stays bounded
            self._write(self.current, stage, slabs)

    def wait_init(self) -> None:
        self._wait_writes()

    # -- the loop's API -----------------------------------------------------------------

    def prefetch(self, stage: str, skip: frozenset[int] = frozenset()) -> Any:
        """Starts reading a streamed stage's slabs into a pooled buffer (once per
        copy: a second call returns the same read); None for cached stages.
        ``skip``: the stage's pages (indices within it) the step's update leaves alone
        (zero gradients, ``optimizer/deferred.py``): only their master is read."""
        if stage in self.cached:
            return None
        if stage in self._reads:
            return self._reads[stage]
        self._check_whole(stage)
        self._land(stage)
        first, n = self.stage_pages[stage]
        slot = self._pool.take(stage)
        elems = n * self.page_elems
        kinds, futures = self.kinds, []
        landed = self._master_reads.take(stage, self.version)
        if landed is not None:  # the master's pages are read already: copied, not read
            futures.append(_copy_when_done(landed, slot.view(MASTER, elems)))
            kinds = [k for k in kinds if k != MASTER]
        disk, P = self.disk[self.current], self.page_elems
        runs = runs_outside(n, skip) if skip else [(0, n)]
        read_kinds: collections.Counter[str] = collections.Counter()
        for k in kinds:  # the master whole: the params not updated are published too
            for a, b in runs if k != MASTER else [(0, n)]:
                futures.append(disk.read_into(k, first + a, slot.view(k, elems)[a * P : b * P]))
                read_kinds[k] += self.state_format.nbytes((b - a) * P, [k])
        read = self._reads[stage] = _Read(slot, elems, futures, read_kinds, skip)
        return read

    def get(self, stage: str, handle: Any = None, skip: frozenset[int] = frozenset()) -> tuple:
        """A stage's committed state (waits for its read) as ``(slabs, scalars)``. A
        streamed stage's slabs are its pooled buffers, the caller's to update in place
        until :meth:`put`; but those of the pages in ``skip`` (see :meth:`prefetch`)."""
        if stage in self.cached:
            return self.cache[stage], self.scalars[stage]
        read = handle if handle is not None else self.prefetch(stage, skip)
        if self._reads.get(stage) is read:
            del self._reads[stage]
        for future in read.futures:
            future.result()
        missing = read.skipped - skip
        if missing:  # read ahead for fewer updated pages than the update has: the rest now
            first, _ = self.stage_pages[stage]
            P, futures = self.page_elems, []
            for k in self.kinds:
                for a, b in page_runs(missing) if k != MASTER else []:
                    view = read.slot.view(k, read.elems)[a * P : b * P]
                    futures.append(self.disk[self.current].read_into(k, first + a, view))
                    read.kinds[k] += self.state_format.nbytes((b - a) * P, [k])
            for future in futures:
                future.result()
        self._held[stage] = read.slot
        slabs = {k: read.slot.view(k, read.elems) for k in self.kinds}
        self.read_bytes += read.kinds.total()
        self.read_kinds.update(read.kinds)
        return slabs, self.scalars[stage]

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        """Output buffers for a stage's next update (see ``MemoryStateStore``): a cached
        stage's dead copy; a streamed stage's own read (updated in place)."""
        if stage in self.cached:
            spare = self._spare.pop(stage, None)
            self._frozen.wait(stage, spare)
            return spare, False
        return None, True

    def put(
        self, stage: str, slabs: dict, scalars: list, skip: frozenset[int] = frozenset()
    ) -> None:
        """A stage's updated state: kept in the cache, or written (asynchronously) to
        the copy that ``commit`` will make current; its pooled buffers go back
        to the pool once written. ``skip``: pages the update left alone (see
        :meth:`prefetch`), hard-linked from the committed copy, not written."""
        self._pending_scalars[stage] = scalars
        if stage in self.cached:
            self._pending_cache[stage] = slabs
        else:
            slot = self._held.pop(stage, None)
            futures = self._write(self._target, stage, slabs, stage, slot, skip)
            if faults.fire("kill_mid_update"):  # the crash tests' torn step
                for future in futures:
                    future.result()
                faults.Faults.kill()
            if slot is not None:
                self._pool.give(slot, futures)

    def commit(self) -> None:
        """Makes the step's state current. Does not wait for the write-back still in
        flight (the last stages the step updated): the next step's forward needs none
        of it, so the writes land while it runs, and a later read of such a stage
        waits for its own writes first. The manifest follows once they have landed."""
        self._land_all()  # the previous step's tail: long done (its stages were read)
        self._landing = {stage: [f for f, _ in writes] for stage, writes in self._by_stage.items()}
        self._by_stage, self._by_kind = {}, {}
        forget_done(self._writes)
        for stage in self._pending_cache:
            self._spare[stage] = self.cache[stage]
        self.cache.update(self._pending_cache)
        self.scalars.update(self._pending_scalars)
        self._pending_cache.clear()
        self._pending_scalars.clear()
        self.current = self._target
        self.version += 1
        self._drop_reads()  # of the copy just replaced
        self._manifest_due = True
        if not self._writes:
            self._land_all()

    @property
    def _target(self) -> int:
        """The copy a step's updates write: the other one, or (one copy)
        the committed one, in place."""
        return (1 - self.current) % len(self.disk)

    def _check_whole(self, stage: str) -> None:
        if stage in self._torn:
            raise RuntimeError(
                f"the NVMe state of {stage} was written in place by a step whose updates "
                "were then dropped (memory.nvme_copies=1): it is neither read nor "
                "checkpointed until a restore rewrites it; the run resumes from its newest "
                "checkpoint"
            )

    def abort(self) -> None:
        if len(self.disk) == 1:  # written in place: those stages hold no committed state
            self._torn.update(self._by_stage)
        self._wait_writes()  # into the uncommitted copy; then forgotten
        self._drop_reads()
        self._spare.update(self._pending_cache)
        self._pending_cache.clear()
        self._pending_scalars.clear()

    def offer_master_read(self, stage: str, read) -> None:
        """A read of ``stage``'s committed master pages made elsewhere (a future of its
        pages: the params', ``params.MasterPages``), for this store's next read of the
        stage to copy the master from instead of reading it again."""
        self._master_reads.offer(stage, self.version, read)

    def written(self, stage: str, kind: str) -> list:
        """The futures of this step's writes of a stage's ``kind`` pages (none: the
        stage is cached, or was not updated since the last commit)."""
        return list(self._by_kind.get((stage, kind), []))

    # -- inspection and durability -------------------------------------------------------

    def master(self, stage: str) -> np.ndarray:
        """A stage's committed fp32 master slab (only that kind is read from disk)."""
        if stage in self.cached:
            return flat(self.cache[stage]["master"])
        self._land(stage)
        first, n = self.stage_pages[stage]
        return self.disk[self.current].read("master", first, n).result().reshape(-1)

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        """A stage's committed state as fresh host copies (for a checkpoint)."""
        if stage in self.cached:
            slabs = {k: np.array(flat(v)) for k, v in self.cache[stage].items()}
        else:
            self._check_whole(stage)
            self._land(stage)
            first, n = self.stage_pages[stage]
            reads = {k: self.disk[self.current].read(k, first, n) for k in self.kinds}
            slabs = {k: f.result().reshape(-1) for k, f in reads.items()}
        return slabs, [np.array(s) for s in self.scalars[stage]]

    def freeze(self, stage: str) -> tuple[Any, list, Callable[[], None]]:
        """A stage's committed state for a checkpoint, unchanged until the returned
        release is called: a cached stage's slabs (see ``MemoryStateStore.freeze``), or a
        streamed stage's files, as ``(PageStore, first page)``, once their writes have
        landed (writes into that copy wait for the release); and its scalars."""
        scalars = [np.array(s) for s in self.scalars[stage]]
        if stage in self.cached:
            return self.cache[stage], scalars, self._frozen.add(stage, self.cache[stage])
        self._check_whole(stage)
        self._land(stage)
        files = (self.disk[self.current], self.stage_pages[stage][0])
        return files, scalars, self._frozen.add(stage, self.current)

    def flush(self) -> None:
        """Writes the cached stages into the committed copy too, so the files
        alone hold the whole state (``manifest.json`` says which copy)."""
        for stage, slabs in self.cache.items():
            self._write(self.current, stage, slabs)
        self._wait_writes()
        self._write_manifest()

    def host_bytes(self) -> int:
        live = [self.cache, self._pending_cache, self._spare]
        unpooled = [d for _, d in self._writes if not self._pool.holds(d)]
        return self._pool.nbytes + sum(a.nbytes for a in jax.tree.leaves([live, unpooled]))

    def device_bytes(self) -> int:
        return 0

    @property
    def nvme_bytes(self) -> int:
        return sum(d.nbytes for d in self.disk)

    # -- internals ----------------------------------------------------------------------

    def _write(
        self,
        which: int,
        stage: str,
        slabs: dict,
        speculative: str = "",
        slot: Slot | None = None,
        skip: frozenset[int] = frozenset(),
    ) -> list:
        """Starts writing a stage's slabs (whole, or chunk by chunk as they come);
        ``speculative``: the stage, when these are a step's writes that commit may
        leave in flight; ``slot``: the pooled buffers the stage was read into (slabs
        in them are written without a copy); ``skip``: pages (of the stage, whole
        slabs only) not written but linked from the committed copy
        (:meth:`PageStore.link_from`: they were not updated). Returns the futures."""
        first, n = self.stage_pages[stage]
        self._frozen.wait(stage, which)
        futures = []
        P = self.page_elems
        for k in self.kinds:
            if skip:  # whole slabs: the runs written, the rest linked
                data = np.asarray(slabs[k])
                pieces = [(first + a, data[a * P : b * P]) for a, b in runs_outside(n, skip)]
            else:
                chunks = slabs[k] if isinstance(slabs[k], list) else [slabs[k]]
                pieces = [(None, chunk) for chunk in chunks]
            page = first
            for at, chunk in pieces:
                page = page if at is None else at
                data = np.asarray(chunk)  # waits for this chunk's update only
                pooled = slot is not None and np.shares_memory(data, slot.arrays[k])
                future = self.disk[which].write(k, page, data, borrowed=pooled)
                self._track(future, data, speculative, k)
                futures.append(future)
                self.write_bytes += data.nbytes
                page += data.size // P
                bound_writes(self._writes, self._write_window)
            if skip and which != self.current:  # (in place: those pages are there already)
                linked = [first + p for p in sorted(skip)]
                future = self.disk[which].link_from(self.disk[1 - which], k, linked)
                self._track(future, _NOTHING, speculative, k)
                futures.append(future)
        return futures

    def _track(self, future, data: np.ndarray, speculative: str, kind: str) -> None:
        self._writes.append((future, data))
        if speculative:
            self._by_stage.setdefault(speculative, []).append((future, data))
            self._by_kind.setdefault((speculative, kind), []).append(future)

    def links(self, stage: str) -> bool:
        """Whether a step may leave some of ``stage``'s pages unwritten (linked from
        the committed copy instead): a streamed stage, one file per page."""
        return stage not in self.cached and self.disk[0].links

    def read_pages(self, stage: str, pages: list[int]) -> dict[str, np.ndarray]:
        """Some of a streamed stage's committed pages (indices within it, sorted), each
        kind as one array (len(pages), page elements): views of a pooled I/O slot,
        held until :meth:`write_pages` writes them back (a fresh buffer per catch-up
        left glibc's heaps 0.8 GB larger at 210M params)."""
        self._land(stage)
        first, _ = self.stage_pages[stage]
        P, futures, out = self.page_elems, [], {}
        slot = self._catching[stage] = self._pool.take(stage)
        for k in self.kinds:
            out[k] = slot.view(k, len(pages) * P).reshape(-1, P)
            at = 0
            for a, b in page_runs(pages):
                view = out[k][at : at + b - a].reshape(-1)
                futures.append(self.disk[self.current].read_into(k, first + a, view))
                at += b - a
        for future in futures:
            future.result()
        nbytes = self.state_format.nbytes
        self.read_bytes += nbytes(len(pages) * P)
        self.read_kinds.update({k: nbytes(len(pages) * P, [k]) for k in self.kinds})
        return out

    def write_pages(self, stage: str, pages: list[int], slabs: dict[str, np.ndarray]) -> None:
        """Replaces some of a streamed stage's committed pages (as :meth:`read_pages`
        gave them) and waits for the writes: a deferred update's catch-up, the same
        state whatever the step does. Read-ahead of the stage, and reads of its master
        offered (:meth:`offer_master_read`), are of the old state: forgotten."""
        first, _ = self.stage_pages[stage]
        self._frozen.wait(stage, self.current)
        futures, at = [], 0
        for a, b in page_runs(pages):
            for k in self.kinds:
                data = slabs[k][at : at + b - a].reshape(-1)
                futures.append(self.disk[self.current].write(k, first + a, data, borrowed=True))
                self.write_bytes += data.nbytes
            at += b - a
        for future in futures:
            future.result()
        self._pool.give(self._catching.pop(stage))
        read = self._reads.pop(stage, None)
        if read is not None:
            self._pool.give(read.slot, read.futures)
        self.version += 1

    def _drop_reads(self) -> None:
        """Forgets the read-ahead and the stages handed out and not written back (their
        state is no longer current); their buffers return to the pool once the reads
        are done."""
        for read in self._reads.values():
            self._pool.give(read.slot, read.futures)
        for slot in self._held.values():
            self._pool.give(slot)
        self._reads, self._held = {}, {}

    def _land(self, stage: str) -> None:
        """Waits for the writes of ``stage`` the last commit left in flight."""
        for future in self._landing.pop(stage, []):
            future.result()

    def _land_all(self) -> None:
        for stage in list(self._landing):
            self._land(stage)
        if self._manifest_due:
            self._manifest_due = False
            self._write_manifest()

    def _wait_writes(self) -> None:
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self._by_stage, self._by_kind = {}, {}
        self._land_all()

    def _write_manifest(self) -> None:
        manifest = {
            "generation": self.current,  # (the on-disk names predate memory.nvme_copies)
            "kinds": self.kinds,
            "page_elems": self.page_elems,
            "stages": {s: list(r) for s, r in self.stage_pages.items()},
            "note": "state of stage s, kind k: gen{generation}/k pages [first, first + n)",
        }
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.path / MANIFEST)


class MasterReads:
    """Reads of stages' committed master pages made elsewhere (the params',
    ``params.MasterPages``), each tagged with the state's version it read: the latest
    ``hold`` are kept, and the state store's read of a stage takes its kept read if it
    is of the current version (a block's backward read comes shortly before the host
    optimizer reads its state), copying the master from it instead of reading it
    again. Offered by the dispatching thread, taken by the loop's: locked."""

    def __init__(self, hold: int):
        self.hold = hold
        self._reads: collections.OrderedDict[str, tuple[int, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def offer(self, stage: str, version: int, read) -> None:
        with self._lock:
            self._reads.pop(stage, None)
            self._reads[stage] = (version, read)
            while len(self._reads) > self.hold:
                self._reads.popitem(last=False)

    def take(self, stage: str, version: int):
        """The kept read of ``stage`` if it read ``version``, else None."""
        with self._lock:
            got = self._reads.pop(stage, None)
        return got[1] if got is not None and got[0] == version else None


_NOTHING = np.empty(0, np.uint8)  # the data a hard link holds for its landing


@dataclasses.dataclass(eq=False)
class _Read:
    """A streamed stage's read into a pooled slot: ``elems`` per kind."""

    slot: Slot
    elems: int
    futures: list
    kinds: collections.Counter  # bytes read from disk by kind (the master may come from
    # elsewhere, deferred pages are skipped)
    skipped: frozenset[int] = frozenset()  # the pages not read (but their master)


def _copy_when_done(read, out: np.ndarray) -> concurrent.futures.Future:
    """Copies ``read``'s result (pages of a stage's master) into ``out`` once it lands, on
    the thread that lands it; the copy's future."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def copy(landed) -> None:  # (``landed``, not ``read``: no cycle, see ``nvme._then``)
        try:
            np.copyto(out, landed.result().reshape(-1))
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 — raised by result(), on the caller
            done.set_exception(e)

    read.add_done_callback(copy)
    return done
