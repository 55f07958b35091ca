"""A checkpoint's training state on disk: written stage by stage from wherever it lives,
read back range by range into any placement. ``checkpoint.py`` drives both through
orbax (this is the ``state`` item of each checkpoint).

**Layout** (``<step>/state/``)::

    proc<p>/<kind>/      zarr3 array (pages, page_elems), one chunk file per page, in the
                         kind's dtype (the optimizer's state format: fp32)
    proc<p>/index.json   the stage each page range holds; CRC-32C of every page (``crc32c``;
                         checkpoints before 2026-11-29: zlib's CRC-32, ``crc32``); the
                         kinds' dtypes where one is not fp32 (``dtypes``; absent: fp32 each)

Each process writes only the state it holds, in parallel with the others; nothing is
gathered. Page size and page order are the writing process's own: those of its NVMe
tier where its state lives there, so those pages are *hard links* to the tier's
committed files (striped over several drives: each drive's linked on that drive,
``checkpoint_drives.py``) (TensorStore writes a chunk to a new file and renames it over the old
one, so a committed file never changes once a link holds it). Other state (host RAM,
device memory, the NVMe tier's RAM cache, or NVMe files on another filesystem) is
written, one stage at a time, straight from the buffers it lives in.

**Placement-free**: ``index.json`` maps each stage's page range to elements of the
stage's *canonical slab* (its leaves back to back in ``SlabLayout`` order, without the
padding: the same for every page size, device count and tier), and the checkpoint's
meta lists each layout's leaves. A restore reads, for each range a process owns, the
pages of whichever processes wrote it (:class:`StoredState`), checking each page's
CRC-32C (``storage/checksums.py``, the NVMe tier's own sum): orbax's and TensorStore's
raw chunks carry no checksum.

**RAM**: a save holds no copy of the state. The stage buffers it writes from are
*frozen* until written: the store waits for that before it reuses them as output, which
is two steps later (``states.py``). A restore holds one stage of one kind at a time.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future as ocp_future

from hetjax.checkpoint_drives import DRIVES, DriveLinks, check_present
from hetjax.config import format_bytes
from hetjax.state_format import MASTER_DTYPE, StateFormat
from hetjax.storage.checksums import ALGORITHM, CHECKSUMS, LEGACY_ALGORITHM
from hetjax.storage.nvme import PageStore, io_context, open_spec, page_array_spec, page_file
from hetjax.storage.pages import SlabLayout, aligned_empty, fitted_page_elems
from hetjax.types import MASTER, CheckpointDamaged, CheckpointError, RuntimeState

INDEX = "index.json"
WINDOW_BYTES = 8 << 20  # pages read at once to check or copy linked state (bounded RAM)
LINK_ERRORS = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP)
DEFAULT_PAGE_ELEMS = 1 << 20  # pages of state given whole (RuntimeState): 4 MiB of fp32


def fp32_format(kinds: list[str]) -> StateFormat:
    """Every kind in ``kinds`` fp32: the format of a checkpoint whose index records no
    dtypes (all of them before state formats), and of a source given none."""
    return StateFormat.fp32([k for k in kinds if k != MASTER])


# -- what a save is given -------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class StagePart:
    """One stage's state held by this process, as a checkpoint takes it: pages
    ``[first_page, first_page + num_pages)`` of this process's checkpoint arrays, the
    canonical slab's elements from ``start`` on.

    ``slabs``: kind -> the slab (flat, whole pages) or its list of chunks (whole pages
    each): numpy or JAX arrays, unchanged until ``release`` (or a function returning
    that dict, called by the writer). ``pages``: instead, the
    committed NVMe files holding the same pages (hard-linked), unchanged until
    ``release``."""

    stage: str
    start: int
    first_page: int
    num_pages: int
    slabs: dict[str, Any] | None = None
    pages: tuple[PageStore, int] | None = None  # the files, and the stage's first page there
    release: Callable[[], None] = lambda: None


@dataclasses.dataclass(kw_only=True)
class StateSource:
    """This process's state for a checkpoint: its stages' parts, each stage's layout
    (which gives the canonical slab), the optax scalars, the fp16 loss scale and the
    dtype of each kind (``state_format``; None: fp32 each)."""

    kinds: list[str]
    page_elems: int
    num_pages: int
    parts: list[StagePart]
    layouts: dict[str, SlabLayout]  # stage -> its layout
    scalars: dict[str, list[np.ndarray]]
    loss_scale: tuple[float, int] | None = None
    state_format: StateFormat | None = None

    def __post_init__(self):
        if self.state_format is None:
            self.state_format = fp32_format(self.kinds)
        assert set(self.state_format.kinds) == set(self.kinds), (self.state_format, self.kinds)

    @classmethod
    def from_state(cls, state: RuntimeState) -> StateSource:
        """The parts of a state held whole in RAM (the in-memory runtime's snapshot), in
        pages fitted to its biggest stage, each kind in the dtype its leaves have."""
        first = next(iter(state.stages.values()))
        dtypes = {k: np.dtype(jax.tree.leaves(first[k])[0].dtype) for k in state.kinds}
        fmt = StateFormat.of({MASTER: dtypes.pop(MASTER), **dtypes})
        sizes = [sum(a.size for a in jax.tree.leaves(t[MASTER])) for t in state.stages.values()]
        page_elems = fitted_page_elems(max(sizes), DEFAULT_PAGE_ELEMS)
        parts, layouts, page = [], {}, 0
        for stage, trees in state.stages.items():
            layout = SlabLayout.from_params(trees[MASTER], page_elems * MASTER_DTYPE.itemsize)
            layouts[stage] = layout
            # flattened by the writer, one stage at a time: no second copy of the state
            slabs = functools.partial(_flatten, layout, trees, fmt)
            parts.append(
                StagePart(
                    stage=stage, start=0, first_page=page, num_pages=layout.num_pages, slabs=slabs
                )
            )
            page += layout.num_pages
        return cls(
            kinds=state.kinds,
            page_elems=page_elems,
            num_pages=page,
            parts=parts,
            layouts=layouts,
            scalars=state.scalars,
            loss_scale=state.loss_scale,
            state_format=fmt,
        )

    def release_all(self) -> None:
        for part in self.parts:
            part.release()
            part.release = lambda: None


def _flatten(layout: SlabLayout, trees: dict[str, Any], fmt: StateFormat) -> dict[str, np.ndarray]:
    return {k: layout.flatten_np(tree, fmt.dtype(k)) for k, tree in trees.items()}


def layout_meta(layouts: dict[str, SlabLayout]) -> dict[str, Any]:
    """Each stage's leaves (path, shape, offset) and size: the canonical slab. A layout
    that cuts leaves into pieces (a grouped one's, ``parallel/grouped.py``) lists each
    piece as (path, the leaf's shape, offset, size, where it starts in the leaf, and where
    the leaf is cut into slices stacked first, its axis and the slices: tensor
    parallelism's)."""

    def entry(leaf) -> list:
        whole = [list(leaf.path), list(leaf.shape), leaf.offset]
        if leaf.size == math.prod(leaf.shape):
            return whole
        # a piece; of the leaf's slices stacked first, where it is cut into parts
        cut = [leaf.axis, leaf.parts] if leaf.parts > 1 else []
        return [*whole, leaf.size, leaf.start, *cut]

    return {
        stage: {"size": lay.size, "leaves": [entry(leaf) for leaf in lay.leaves]}
        for stage, lay in layouts.items()
    }


def _param_shapes(leaves: list) -> dict[tuple, tuple]:
    """The params a stage's layout meta describes: each leaf's shape by path."""
    return {tuple(entry[0]): tuple(entry[1]) for entry in leaves}


def scalars_meta(scalars: dict[str, list]) -> dict[str, Any]:
    return {
        stage: [[np.asarray(a).dtype.name, np.asarray(a).tolist()] for a in values]
        for stage, values in scalars.items()
    }


# -- save -----------------------------------------------------------------------------------


def page_crcs(pages: np.ndarray, algorithm: str = ALGORITHM) -> list[int]:
    """The checksum of each page (row) of ``pages`` (``algorithm``: a key of
    ``checksums.CHECKSUMS``, the one a checkpoint index names)."""
    checksum = CHECKSUMS[algorithm]
    return [checksum(p) for p in pages]


_SUM_NAMES = {ALGORITHM: "CRC-32C", LEGACY_ALGORITHM: "CRC-32"}


def index_sums(part: dict) -> tuple[str, dict[str, list[int]]]:
    """A checkpoint index stage entry's checksum algorithm and per-kind page sums."""
    algorithm = ALGORITHM if ALGORITHM in part else LEGACY_ALGORITHM
    return algorithm, part[algorithm]


def _check_finite(pages: np.ndarray, stage: str, kind: str) -> None:
    if pages.size and not (np.isfinite(pages.max()) and np.isfinite(pages.min())):
        raise CheckpointError(
            f"refusing to save non-finite state (stage {stage}, {kind}); the last complete "
            "checkpoint is kept"
        )


@dataclasses.dataclass
class SaveReport:
    """What one save did: bytes hard-linked and written, seconds in the step and in
    the background."""

    linked_bytes: int = 0
    written_bytes: int = 0
    copied_bytes: int = 0  # linked state copied instead (another filesystem)
    snapshot_s: float = 0.0
    persist_s: float = 0.0

    def describe(self, step: int) -> str:
        copied = f" ({format_bytes(self.copied_bytes)} copied: no hard links)" * bool(
            self.copied_bytes
        )
        return (
            f"checkpoint: step {step} complete: {format_bytes(self.linked_bytes)} hard-linked, "
            f"{format_bytes(self.written_bytes + self.copied_bytes)} written{copied}, "
            f"{self.snapshot_s:.2f} s in the step, {self.persist_s:.1f} s in the background"
        )


class StreamedStateHandler(ocp.AsyncCheckpointHandler):
    """orbax's handler for the ``state`` item (:class:`StreamedStateSave`,
    :class:`StreamedStateRestore`). ``async_save`` is the step's part: the arrays'
    metadata and the hard links; the writes, checksums and index run in the returned
    commit future, in the background."""

    def __init__(self, link: bool = True):
        self.link = link  # False: NVMe-resident state is copied, never hard-linked
        self.report = SaveReport()

    async def async_save(self, directory, args: StreamedStateSave):
        t0 = time.perf_counter()
        source = args.source
        self.report = report = SaveReport()
        try:
            proc = Path(directory) / f"proc{jax.process_index()}"
            context = io_context(sync=True)  # durable once complete
            arrays = {}
            for kind in source.kinds:
                dtype = source.state_format.dtype(kind)
                spec = page_array_spec(proc / kind, source.num_pages, source.page_elems, dtype)
                arrays[kind] = ts.open(spec, create=True, context=context).result()
            copy, live = [], {}
            for part in source.parts:
                if part.pages is None:
                    continue
                # the live pages' sums while they are still the part's (checksums.py)
                store, src_page = part.pages
                live[part.stage] = {
                    k: store.checksums.expected(k, src_page, part.num_pages) for k in source.kinds
                }
                if self.link and _link(part, proc, source.kinds, args.drives):
                    report.linked_bytes += source.state_format.nbytes(
                        part.num_pages * source.page_elems
                    )
                    part.release()
                else:
                    copy.append(part)
        except BaseException:
            source.release_all()
            raise
        report.snapshot_s = time.perf_counter() - t0

        async def persist() -> None:
            t1 = time.perf_counter()
            try:
                crcs = _persist(source, proc, arrays, copy, report, live)
                _write_index(proc, source, crcs, args.drives)
            finally:
                source.release_all()
            report.persist_s = time.perf_counter() - t1

        return [ocp_future.CommitFutureAwaitingContractedSignals(persist(), name="hetjax_state")]

    def save(self, directory, args: StreamedStateSave) -> None:
        for f in asyncio_utils.run_sync(self.async_save(directory, args)) or []:
            f.result()

    def restore(self, directory, args: StreamedStateRestore | None = None) -> StoredState:
        meta = Path(directory).parent / "meta" / "metadata"  # the meta item's file
        return StoredState(Path(directory), json.loads(meta.read_text()))

    def finalize(self, directory) -> None:
        pass


@ocp.args.register_with_handler(StreamedStateHandler, for_save=True)
@dataclasses.dataclass
class StreamedStateSave(ocp.args.CheckpointArgs):
    source: StateSource
    drives: DriveLinks | None = None  # where pages striped over drives link (None: here)


@ocp.args.register_with_handler(StreamedStateHandler, for_restore=True)
@dataclasses.dataclass
class StreamedStateRestore(ocp.args.CheckpointArgs):
    pass


def _link(part: StagePart, proc: Path, kinds: list[str], drives: DriveLinks | None) -> bool:
    """Hard-links a stage's committed NVMe page files into the checkpoint (pages
    striped over drives: each on its drive, in ``drives``' directory there); False where
    the filesystem cannot (another device, no hard links): then they are copied."""
    store, src_page = part.pages
    for kind in kinds:
        src_dir, dst_dir = store.path / kind, proc / kind
        for i in range(part.num_pages):
            src = page_file(src_dir, src_page + i)
            at = part.first_page + i
            if store.stripes is not None and drives is not None:
                dst = drives.chunk_file(proc, store.stripes, src_page + i, kind, at)
            else:
                dst = page_file(dst_dir, at)
                dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except FileNotFoundError:
                continue  # a page of zeros: TensorStore stores no file for it
            except OSError as e:
                if e.errno in LINK_ERRORS:
                    return False
                raise
    return True


def _persist(
    source: StateSource,
    proc: Path,
    arrays: dict,
    copy: list[StagePart],
    report: SaveReport,
    live: dict[str, dict[str, list[int]]],
) -> dict[str, dict[str, list[int]]]:
    """The background part of a save: every part's pages written (or checked, where
    linked), one stage at a time, each released once done. Returns the CRCs. NVMe pages
    (linked or copied) must match ``live``, the sums the tier kept of what it wrote
    (the same CRC-32C): a checkpoint never takes a damaged page for a good one."""
    crcs: dict[str, dict[str, list[int]]] = {}
    P = source.page_elems
    for part in source.parts:
        crcs[part.stage] = sums = {}
        if part.slabs is not None:
            slabs = part.slabs() if callable(part.slabs) else part.slabs
            for kind in source.kinds:
                sums[kind], writes, page = [], [], part.first_page
                chunks = slabs[kind]
                for chunk in chunks if isinstance(chunks, list) else [chunks]:
                    pages = np.asarray(chunk, source.state_format.dtype(kind)).reshape(-1, P)
                    _check_finite(pages, part.stage, kind)
                    sums[kind] += page_crcs(pages)
                    target = arrays[kind][page : page + len(pages)]
                    writes.append(target.write(pages, can_reference_source_data_indefinitely=True))
                    report.written_bytes += pages.nbytes
                    page += len(pages)
                for w in writes:
                    w.result()
        else:
            store, src_page = part.pages
            copied = part in copy
            for kind in source.kinds:
                if copied:
                    sums[kind] = _read_pages(
                        store.arrays[kind], src_page, part, kind, copy_to=arrays[kind]
                    )
                    report.copied_bytes += source.state_format.nbytes(part.num_pages * P, [kind])
                else:
                    sums[kind] = _read_pages(arrays[kind], part.first_page, part, kind)
                    _sync_files(proc / kind, part)
                _check_live(sums[kind], live[part.stage][kind], store, src_page, kind)
        part.release()
        part.release = lambda: None
    return crcs


def _check_live(sums: list[int], live: list[int], store: PageStore, first: int, kind: str):
    bad = [i for i, (a, b) in enumerate(zip(sums, live, strict=True)) if b >= 0 and a != b]
    if bad:
        page = first + bad[0]
        raise CheckpointError(
            f"NVMe page damaged: {page_file(store.path / kind, page)} (page {page} of "
            f"{store.label} {kind}) reads with CRC-32C {sums[bad[0]]:#010x}, was written with "
            f"{live[bad[0]]:#010x}; this checkpoint is not written (the complete ones are "
            "intact). Restart: the run resumes from the newest checkpoint"
        )


def _read_pages(src, src_page: int, part: StagePart, kind: str, copy_to=None) -> list[int]:
    """CRCs of a part's pages, read from ``src`` (from page ``src_page``) a window at a
    time and checked finite; ``copy_to``: also written there, at the part's pages."""
    sums = []
    P, dtype = src.shape[1], src.dtype.numpy_dtype
    step = max(1, WINDOW_BYTES // (P * dtype.itemsize))
    window = aligned_empty(min(step, part.num_pages) * P, dtype).reshape(-1, P)
    for i in range(0, part.num_pages, step):
        n = min(step, part.num_pages - i)
        pages = window[:n]
        ts.array(pages, copy=False, write=True).write(src[src_page + i : src_page + i + n]).result()
        _check_finite(pages, part.stage, kind)
        sums += page_crcs(pages)
        if copy_to is not None:
            copy_to[part.first_page + i : part.first_page + i + n].write(pages).result()
    return sums


def _sync_files(array_dir: Path, part: StagePart) -> None:
    """Makes a part's linked files durable: the NVMe tier writes without fsync."""
    for page in range(part.first_page, part.first_page + part.num_pages):
        try:
            fd = os.open(page_file(array_dir, page), os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_index(proc: Path, source: StateSource, crcs: dict, drives: DriveLinks | None) -> None:
    index = {
        "page_elems": source.page_elems,
        "num_pages": source.num_pages,
        "kinds": source.kinds,
        "stages": {
            part.stage: {
                "start": part.start,
                "first_page": part.first_page,
                "num_pages": part.num_pages,
                ALGORITHM: crcs[part.stage],
            }
            for part in source.parts
        },
    }
    if source.state_format != fp32_format(source.kinds):  # fp32 each: the index as it was
        index["dtypes"] = {k: source.state_format.dtype(k).name for k in source.kinds}
    if drives is not None and drives.used:  # pages linked on their drives: where
        index[DRIVES] = sorted(str(d) for d in drives.used)
    tmp = proc / (INDEX + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(proc / INDEX)


# -- restore --------------------------------------------------------------------------------


class StoredState:
    """A checkpoint's state, read on demand: :meth:`read` gives any element range of a
    stage's canonical slab, whichever processes wrote it. Also the
    :class:`~hetjax.types.RuntimeState` interface (``stages``, ``params()``,
    ``kind_tree``...), which reads the whole state (export, the in-memory runtime).
    ``meta``: the checkpoint's meta; ``hint``: what to do when it is damaged."""

    def __init__(self, directory: Path, meta: dict[str, Any], hint: str = ""):
        self.directory, self.meta, self.hint = directory, meta, hint
        self._procs: list[tuple[Path, dict]] = []
        for proc in sorted(directory.glob("proc*"), key=lambda p: int(p.name[4:])):
            try:
                self._procs.append((proc, json.loads((proc / INDEX).read_text())))
            except (OSError, ValueError) as e:
                raise CheckpointDamaged(
                    f"checkpoint {directory.parent} cannot be read ({proc / INDEX}: {e})"
                ) from e
            check_present(self._procs[-1][1], proc, directory.parent)
        if not self._procs:
            raise CheckpointDamaged(
                f"checkpoint {directory.parent} cannot be read (no proc*/{INDEX} in {directory})"
            )
        self._arrays: dict[tuple[int, str], ts.TensorStore] = {}
        self._whole: dict[str, dict[str, Any]] | None = None

    # -- the checkpoint's contents ------------------------------------------------------

    @property
    def kinds(self) -> list[str]:
        return list(self._procs[0][1]["kinds"])

    @property
    def state_format(self) -> StateFormat:
        """The dtype of each kind as saved (an index without ``dtypes``: fp32 each)."""
        dtypes = self._procs[0][1].get("dtypes")
        if dtypes is None:
            return fp32_format(self.kinds)
        master = {MASTER: dtypes[MASTER]}  # first, as a format lists it
        return StateFormat.of({**master, **{k: np.dtype(d) for k, d in dtypes.items()}})

    @property
    def stage_names(self) -> list[str]:
        return list(self.meta["layouts"])

    @property
    def scalars(self) -> dict[str, list[np.ndarray]]:
        return {
            stage: [np.asarray(v, dtype) for dtype, v in values]
            for stage, values in self.meta["scalars"].items()
        }

    @property
    def loss_scale(self) -> tuple[float, int] | None:
        ls = self.meta.get("loss_scale")
        return (float(ls[0]), int(ls[1])) if ls else None

    def size(self, stage: str) -> int:
        return self.meta["layouts"][stage]["size"]

    def same_layout(self, stage: str, layout: SlabLayout) -> bool:
        """Whether ``stage`` was saved in ``layout`` (its ranges read as they are:
        :meth:`read`). False when it holds the same params laid out otherwise (one saved
        or restored with expert parallelism, whose block slabs are laid out by device):
        restore it from :meth:`stage_tree`. Refuses other params (another model)."""
        saved = self.meta["layouts"][stage]["leaves"]
        now = layout_meta({stage: layout})[stage]["leaves"]
        if saved == now:
            return True
        if _param_shapes(saved) != _param_shapes(now):
            raise CheckpointError(
                f"checkpoint {self.directory.parent} holds stage {stage} with other leaves "
                f"than this model's ({len(_param_shapes(saved))} saved, "
                f"{len(_param_shapes(now))} here): restore it into the model that wrote it"
            )
        return False

    # -- reading ------------------------------------------------------------------------

    def read(self, stage: str, kind: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of ``stage``'s canonical slab of ``kind`` (in its
        saved dtype; zeros past its size), with every page read checked against its
        checksum (CRC-32C; zlib CRC-32 in older checkpoints)."""
        # aligned: the host optimizer's buffer, uncopied
        out = aligned_empty(stop - start, self.state_format.dtype(kind))
        out[:] = 0
        size = self.size(stage)
        for p, (proc, index) in enumerate(self._procs):
            part = index["stages"].get(stage)
            if part is None:
                continue
            P = index["page_elems"]
            lo = max(start, part["start"])
            hi = min(stop, size, part["start"] + part["num_pages"] * P)
            if lo >= hi:
                continue
            first = (lo - part["start"]) // P
            last = (hi - 1 - part["start"]) // P + 1
            page0 = part["first_page"]
            pages = self._array(p, proc, kind)[page0 + first : page0 + last].read().result()
            algorithm, saved = index_sums(part)
            sums = zip(page_crcs(pages, algorithm), saved[kind][first:last], strict=True)
            bad = [first + i for i, (a, b) in enumerate(sums) if a != b]
            if bad:
                raise CheckpointDamaged(
                    f"checkpoint {self.directory.parent} is damaged: {len(bad)} of "
                    f"{last - first} pages read of stage {stage} ({kind}, {proc.name}) differ "
                    f"from what was saved ({_SUM_NAMES[algorithm]} of pages {bad[:3]}; the first "
                    f"is {page_file(proc / kind, page0 + bad[0])}). {self.hint}"
                )
            flat = pages.reshape(-1)
            offset = part["start"] + first * P
            out[lo - start : hi - start] = flat[lo - offset : hi - offset]
        return out

    def _array(self, p: int, proc: Path, kind: str) -> ts.TensorStore:
        if (p, kind) not in self._arrays:
            spec = open_spec(proc / kind)
            try:
                self._arrays[p, kind] = ts.open(spec, read=True).result()
            except ValueError as e:
                raise CheckpointError(
                    f"checkpoint {self.directory.parent} cannot be read ({proc / kind}: {e}). "
                    + self.hint
                ) from e
        return self._arrays[p, kind]

    def stage_tree(self, stage: str, kind: str) -> Any:
        """A stage's state of ``kind`` as its params pytree (nested dicts by leaf path):
        views of the slab read, and leaves saved in pieces assembled from them."""
        flat = self.read(stage, kind, 0, self.size(stage))
        leaves: dict[tuple, np.ndarray] = {}
        stacked: dict[tuple, tuple] = {}  # leaves assembled as slices stacked first
        for path, shape, offset, *piece in self.meta["layouts"][stage]["leaves"]:
            n = math.prod(shape)
            if not piece:  # a whole leaf
                leaves[tuple(path)] = flat[offset : offset + n].reshape(shape)
                continue
            size, start, *cut = piece
            if cut:  # the leaf's axis cut[0] in cut[1] slices, stacked first
                axis, parts = cut
                stacked[tuple(path)] = (axis, tuple(shape))
                shape = [parts, *shape]
                shape[axis + 1] //= parts
            whole = leaves.setdefault(tuple(path), np.zeros(shape, flat.dtype))
            whole.reshape(-1)[start : start + size] = flat[offset : offset + size]
        for path, (axis, shape) in stacked.items():
            leaves[path] = np.moveaxis(leaves[path], 0, axis).reshape(shape)
        tree: dict[str, Any] = {}
        for path, leaf in leaves.items():
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
        return tree

    # -- the RuntimeState interface (whole state in RAM) --------------------------------

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        if self._whole is None:
            self._whole = {
                s: {k: self.stage_tree(s, k) for k in self.kinds} for s in self.stage_names
            }
        return self._whole

    def whole(self) -> RuntimeState:
        return RuntimeState(self.stages, self.scalars, self.loss_scale)

    def params(self) -> dict[str, Any]:
        return self.whole().params()

    def kind_tree(self, kind: str) -> dict[str, Any]:
        return self.whole().kind_tree(kind)

    def nbytes(self) -> int:
        return self.state_format.nbytes(sum(self.size(s) for s in self.stage_names))
