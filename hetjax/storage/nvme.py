"""The NVMe tier: fp32 state pages in TensorStore arrays on local disk.

Each kind of state (``master``, and one per optimizer moment such as ``mu``, ``nu``) is
one zarr3 array over the ``file`` kvstore with shape ``(num_pages, page_elems)`` and one
chunk per page, so a stage is a contiguous page range and every read or write moves
whole chunks. (Boundary activations, ``swap.py``, use the same store with one
row per boundary, chunked by page.) Reads and writes return TensorStore futures
(asynchronous; the caller overlaps them with compute). There is no fsync on the hot
path (``file_io_sync`` off): durability is the checkpoint's job. Nor is there file
locking (``file_io_locking`` mode ``none``): each store has one writer, its own process,
and the lock files TensorStore otherwise creates and removes around every chunk write
cost a third of the write bandwidth here (docs/results/2026-11-22.md). Chunk files are opened with
O_DIRECT (``file_io_mode`` ``direct``, :data:`IO_MODE`): the state passes each step
once, so the page cache only copies it again and evicts what else the machine caches.

Start-up checks (:func:`check_nvme_path`) run before anything is created, so a bad path
or a full disk fails with the numbers and leaves nothing half-written.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from hetjax import faults, timeline
from hetjax.config import ConfigError, format_bytes
from hetjax.storage.checksums import PageChecksums, page_checksum
from hetjax.storage.pages import DIRECT_ALIGN
from hetjax.storage.stripes import Stripes

IO_CONCURRENCY = 16  # concurrent file operations; see MEASUREMENTS.md (4 MiB chunks, 16)
# TensorStore's ``file_io_mode``: ``direct`` opens the chunk files with O_DIRECT (no page
# cache; TensorStore aligns the buffers), ``default`` goes through the page cache,
# ``memmap`` maps the files for reads. Chosen by ``python -m hetjax.bench io``'s sweep
# (docs/results/2026-11-24.md).
IO_MODE = "direct"


def io_context(sync: bool = False, mode: str = IO_MODE, concurrency: int = IO_CONCURRENCY):
    """The TensorStore context of the NVMe tier's arrays (``sync``: fsync each write,
    for checkpoints)."""
    return ts.Context(
        {
            "file_io_sync": sync,
            "file_io_locking": {"mode": "none"},
            "file_io_concurrency": {"limit": concurrency},
            "file_io_mode": {"mode": mode},
        }
    )


def check_nvme_path(
    path: str | Path, needed_bytes: int | dict[str, int], what: str = "the optimizer state"
) -> Path:
    """Makes sure ``path`` is a writable directory on a disk with ``needed_bytes`` free
    (for ``what``, named in the error; or a dict of bytes by what needs them). Raises
    ``ConfigError`` naming ``memory.nvme_path`` otherwise; creates only the directory
    itself (and removes it again if the checks fail)."""
    breakdown = ""
    if isinstance(needed_bytes, dict):
        parts = {k: v for k, v in needed_bytes.items() if v}
        names = list(parts)
        if len(names) > 1:
            what = f"{', '.join(names[:-1])} and {names[-1]}"
        elif names:
            what = names[0]
        needed_bytes = sum(parts.values())
        if len(parts) > 1:
            breakdown = ": " + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
    path = Path(path)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"memory.nvme_path {str(path)!r} cannot be created ({e.strerror}); point it at a "
            "writable directory on a local SSD"
        ) from None
    try:
        if not path.is_dir():
            raise ConfigError(f"memory.nvme_path {str(path)!r} is not a directory")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".hetjax-write-test-"):
                pass
        except OSError as e:
            raise ConfigError(
                f"memory.nvme_path {str(path)!r} is not writable ({e.strerror}); point it at a "
                "writable directory on a local SSD"
            ) from None
        free = shutil.disk_usage(path).free
        if free < needed_bytes:
            raise ConfigError(
                f"memory.nvme_path {str(path)!r} for {what} needs {format_bytes(needed_bytes)} "
                f"({needed_bytes} bytes{breakdown}) on disk but only {format_bytes(free)} is free "
                f"(short by {format_bytes(needed_bytes - free)}); free space or use another disk"
            )
    except ConfigError:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise
    return path


# -- the page files --------------------------------------------------------------------------
# One format for every page array on disk, the tier's and a checkpoint's alike (whose
# restore hard-links the tier's files in): a zarr3 array over the ``file`` kvstore, shape
# (pages, page_elems), one chunk a page (a row), its chunk keys zarr3's default, so page
# p's bytes are the file ``<array>/c/<p>/0`` (raw where the codecs are, ``_raw_chunks``).


def page_array_spec(
    path: str | Path, num_pages: int, page_elems: int, dtype: Any, chunk_elems: int | None = None
) -> dict:
    """The TensorStore spec creating a page array at ``path`` (``chunk_elems``: a chunk's
    elements, a page's unless given)."""
    return {
        **open_spec(path),
        "metadata": {
            "shape": [num_pages, page_elems],
            "data_type": jnp.dtype(dtype).name,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [1, chunk_elems or page_elems]},
            },
        },
    }


def open_spec(path: str | Path) -> dict:
    """The TensorStore spec opening an existing page array at ``path``."""
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def page_dir(array_dir: str | Path, page: int) -> Path:
    """The directory of page ``page``'s chunk files (``<array>/c/<page>``; striped over
    drives, ``stripes.py``, and linked into checkpoints, ``checkpoint_drives.py``)."""
    return Path(array_dir) / "c" / str(page)


def page_file(array_dir: str | Path, page: int) -> Path:
    """The file of page ``page`` of a page array (``<array>/c/<page>/0``)."""
    return page_dir(array_dir, page) / "0"


class PageStore:
    """fp32 pages of several state kinds on disk, one TensorStore array per kind."""

    def __init__(
        self,
        path: str | Path,
        kinds: list[str] | dict[str, str],
        num_pages: int,
        page_elems: int,
        *,
        chunk_elems: int = 0,
        label: str = "",
        io_mode: str = IO_MODE,
        concurrency: int = IO_CONCURRENCY,
        verify: bool = True,
        stripes: Stripes | None = None,
    ):
        """``kinds``: names (float32 pages) or a dict name -> dtype name (e.g. the
        compute-dtype param pages, ``bfloat16``). ``chunk_elems``: elements per chunk
        along a row; 0: the whole row (one page, one chunk). ``label``: what the
        timeline's spans say the store holds (default: the parent directory's name).
        ``io_mode``, ``concurrency``: TensorStore's file I/O settings (benchmarks sweep
        them; the tier uses :data:`IO_MODE` and :data:`IO_CONCURRENCY`). ``verify``:
        sum every page written and check every page read (``checksums.py``; off only
        to measure what that costs, ``python -m hetjax.bench io``). ``stripes``: the
        drives the pages stripe over (``stripes.py``; a row with all its chunks)."""
        self.path = Path(path)
        self.stripes = stripes if stripes is not None and stripes.others else None
        if not isinstance(kinds, dict):
            kinds = {k: "float32" for k in kinds}
        self.dtypes = {k: np.dtype(jnp.dtype(d)) for k, d in kinds.items()}
        self.kinds = list(kinds)
        self.num_pages, self.page_elems = num_pages, page_elems
        self.chunk_elems = chunk_elems or page_elems
        self.label = label or self.path.parent.name
        self._context = io_context(mode=io_mode, concurrency=concurrency)
        self.arrays: dict[str, ts.TensorStore] = {}
        opened = [
            ts.open(self._spec(k), create=True, delete_existing=True, context=self._context)
            for k in self.kinds
        ]
        for kind, future in zip(self.kinds, opened, strict=True):
            self.arrays[kind] = future.result()
        if stripes is not None and stripes.others:
            # a row's chunks share its directory (c/<row>/<chunk>): striped with it
            for kind in self.kinds:
                stripes.lay_out(self.path / kind, num_pages)
        # every row written is summed and every row read checked (checksums.py)
        self.checksums = PageChecksums(self.kinds, num_pages, self.label, enabled=verify)
        # Reads and borrowed writes of whole pages bypass TensorStore where a chunk file
        # is the page's raw bytes (:class:`DirectIO`); another ``io_mode`` keeps its I/O.
        self._direct = io_mode == "direct" and all(
            self.chunk_elems == self.page_elems
            and self.page_elems * d.itemsize % DIRECT_ALIGN == 0
            and _raw_chunks(self.arrays[k])
            for k, d in self.dtypes.items()
        )

    def _spec(self, kind: str) -> dict:
        return page_array_spec(
            self.path / kind, self.num_pages, self.page_elems, self.dtypes[kind], self.chunk_elems
        )

    @property
    def nbytes(self) -> int:
        per_page = self.page_elems * sum(d.itemsize for d in self.dtypes.values())
        return self.num_pages * per_page

    def read(self, kind: str, first_page: int, num_pages: int) -> concurrent.futures.Future:
        """Starts reading pages ``[first_page, first_page + num_pages)``; the future's
        result is an array (num_pages, page_elems) of the kind's dtype, each page
        checked against the sum of what was written (else :class:`DamagedPageError`)."""
        self._fault_flip(kind, first_page, num_pages)
        future = self.arrays[kind][first_page : first_page + num_pages].read()
        future = _then(future, lambda pages: self._check(kind, first_page, pages))
        timeline.watch_future("nvme_read", self._span_name(kind, first_page, num_pages), future)
        return future

    def read_into(self, kind: str, first_page: int, out: np.ndarray) -> PageFutures:
        """Starts reading whole pages from ``first_page`` into ``out`` (a flat, writable
        array of the kind's dtype, a whole number of pages): no buffer allocated. Where
        ``out`` is aligned for O_DIRECT (``DIRECT_ALIGN``) each page's chunk file is read
        straight into it (:class:`DirectIO`); else through TensorStore, which reads
        each chunk into a buffer of its own and copies it over."""
        pages = out.reshape(-1, self.page_elems)
        n = len(pages)
        self._fault_flip(kind, first_page, n)
        if self._direct and out.ctypes.data % DIRECT_ALIGN == 0:
            rows = range(first_page, first_page + n)
            reads = [
                direct_io().submit(self._read_page, kind, r, p)
                for r, p in zip(rows, pages, strict=True)
            ]
            future = PageFutures(reads)
        else:
            target = ts.array(pages, copy=False, write=True)
            write = target.write(self.arrays[kind][first_page : first_page + n])

            def check(_) -> None:  # (its result is not the pages: the future keeps it)
                self._check(kind, first_page, pages)

            read = _then(_commit_future(write), check)
            future = PageFutures([read])
        timeline.watch_future("nvme_read", self._span_name(kind, first_page, n), future)
        return future

    @property
    def links(self) -> bool:
        """Whether a page's chunk file is its raw bytes, one file per page (what
        :meth:`link_from` needs)."""
        return self._direct

    def link_from(self, src: PageStore, kind: str, pages) -> PageFutures:
        """Starts making ``pages`` of ``kind`` here hard links to ``src``'s files of the
        same pages (a page ``src`` never wrote: removed here, read as zeros): they then
        hold ``src``'s bytes with no data read or written. Each goes under a temporary
        name renamed over the old file, as a write does, so a reader or a checkpoint's
        link of the old file keeps it."""
        futures = [direct_io().submit_write(self._link_page, src, kind, p) for p in pages]
        return PageFutures(futures)

    def _link_page(self, src: PageStore, kind: str, page: int) -> None:
        _link_page(src._chunk_file(kind, page), self._chunk_file(kind, page))
        self.checksums.copy(src.checksums, kind, page)

    def _read_page(self, kind: str, page: int, out: np.ndarray) -> None:
        """One page's chunk file read into ``out`` and checked (on an I/O thread)."""
        path = self._chunk_file(kind, page)
        direct_io()._read(path, out)
        self.checksums.check(kind, page, out, path)

    def _write_page(self, kind: str, page: int, data: np.ndarray) -> None:
        """One page written from ``data`` into its chunk file and summed (I/O thread)."""
        direct_io()._write(self._chunk_file(kind, page), data)
        self.checksums.record(kind, page, data)

    def _check(self, kind: str, first: int, rows: np.ndarray) -> np.ndarray:
        """``rows`` read from ``first`` on, checked against their sums; returned."""
        for i, row in enumerate(rows):
            self.checksums.check(kind, first + i, row, self._chunk_file(kind, first + i))
        return rows

    def _fault_flip(self, kind: str, first: int, n: int) -> None:
        """HETJAX_FAULTS ``nvme_bitflip``: a bit of the first file of the rows about to
        be read flipped on disk (a row never written has none: the fault waits)."""
        if faults.fire("nvme_bitflip"):
            files = [self._chunk_file(kind, r) for r in range(first, first + n)]
            faults.flip_bit(next((f for f in files if f.exists()), None))

    def _chunk_file(self, kind: str, page: int) -> Path:
        """The file of one page's chunk (:func:`page_file`)."""
        return page_file(self.path / kind, page)

    def write(
        self, kind: str, first_page: int, data: np.ndarray, borrowed: bool = False
    ) -> PageFutures:
        """Starts writing a flat slab of whole pages at ``first_page``. ``data`` must
        not change until the write completes. ``borrowed``: written from ``data`` itself
        instead of a copy of it (a pooled buffer, ``iopool.py``, kept unchanged until
        the write is done): where it is aligned for O_DIRECT, each page straight from
        it into its chunk file (:class:`DirectIO`), else by TensorStore."""
        pages = np.asarray(data, self.dtypes[kind]).reshape(-1, self.page_elems)
        if borrowed and self._direct and pages.ctypes.data % DIRECT_ALIGN == 0:
            rows = range(first_page, first_page + len(pages))
            submit = functools.partial(direct_io().submit_write, self._write_page, kind)
            future = PageFutures([submit(r, p) for r, p in zip(rows, pages, strict=True)])
        else:
            # summed now: ``data`` may change once handed over
            sums = [page_checksum(row) for row in pages] if self.checksums.enabled else []
            target = self.arrays[kind][first_page : first_page + len(pages)]
            write = target.write(pages, can_reference_source_data_indefinitely=borrowed)
            written = _then(_commit_future(write), lambda _: self._record(kind, first_page, sums))
            future = PageFutures([written])
        name = self._span_name(kind, first_page, len(pages))
        if faults.fire("nvme_write_fail"):
            what = f"NVMe write of {name} failed (HETJAX_FAULTS nvme_write_fail)"
            future = _fails_when_done(future, OSError(errno.EIO, what, str(self.path / kind)))
        timeline.watch_future("nvme_write", name, future)
        return future

    def _record(self, kind: str, first: int, sums: list[int]) -> None:
        self.checksums.sums[kind][first : first + len(sums)] = sums

    def _span_name(self, kind: str, first_page: int, num_pages: int) -> str:
        rows = "pages" if self.chunk_elems == self.page_elems else "rows"
        return f"{self.label} {kind} {rows} {first_page}+{num_pages}"

    @staticmethod
    def open_existing(path: str | Path, kind: str) -> ts.TensorStore:
        """Reopens one kind's array read-only (e.g. to inspect state after a run)."""
        spec = open_spec(Path(path) / kind)
        return ts.open(spec, read=True).result()


def _then(future, fn) -> concurrent.futures.Future:
    """A future of ``fn(future's result)``, run by whichever thread completes
    ``future`` (a TensorStore or ``concurrent.futures`` one); ``fn``'s error is its.

    The callback reads the future it is handed, not ``future``: a ``concurrent.futures``
    future keeps its callbacks after running them, so a callback naming it is a
    reference cycle, and what ``fn`` names (the buffer a read landed in) lived on until
    a full collection. The NVMe param store's slab pool reuses only slabs nothing else
    refers to, so meanwhile it allocated a fresh slab for every stage it read: host RAM
    grew every step where reads went through TensorStore (bf16 moments, whose pages are
    not whole O_DIRECT blocks)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def land(landed) -> None:
        try:
            done.set_result(fn(landed.result()))
        except BaseException as e:  # noqa: BLE001 — raised by result(), on the caller
            done.set_exception(e)

    future.add_done_callback(land)
    return done


def _raw_chunks(array: ts.TensorStore) -> bool:
    """Whether ``array``'s chunk files are its chunks' raw little-endian bytes (zarr3's
    ``bytes`` codec alone, little-endian or, for one-byte elements, of no endianness; a
    missing file is a chunk of the fill value, zero)."""
    codecs = array.codec.to_json().get("codecs", [])
    little = [{"name": "bytes", "configuration": {"endian": "little"}}]
    one_byte = array.dtype.numpy_dtype.itemsize == 1 and codecs == [{"name": "bytes"}]
    plain = codecs == little or one_byte
    return plain and float(array.fill_value) == 0


def _commit_future(write: ts.WriteFutures) -> concurrent.futures.Future:
    """A TensorStore write as a ``concurrent.futures`` future (its commit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def land(_) -> None:
        try:
            write.result()
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 — raised by result(), on the caller
            done.set_exception(e)

    write.commit.add_done_callback(land)
    return done


class PageFutures:
    """The reads or writes of a run of pages: a future of them all (``result`` raises the first
    failure; ``add_done_callback`` once every one is done)."""

    def __init__(self, futures: list[concurrent.futures.Future]):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> None:
        for f in self.futures:
            f.result()

    def add_done_callback(self, callback) -> None:
        # The futures keep ``one`` after running it, so it holds the call (and this
        # object, which holds them) only until it is made: no cycle outlives it (see
        # ``_then``).
        call = [functools.partial(callback, self)]
        left = [len(self.futures)]
        lock = threading.Lock()

        def one(_) -> None:
            with lock:
                left[0] -= 1
                last = call.pop() if left[0] == 0 else None
            if last is not None:
                last()

        if not self.futures:
            call.pop()()
        for f in self.futures:
            f.add_done_callback(one)


class DirectIO:
    """Reads and writes page chunk files straight from and into the caller's aligned
    buffers with O_DIRECT (no page cache), on :data:`IO_CONCURRENCY` threads (a disk
    serves many requests in flight faster than one). TensorStore's own read of a chunk
    allocates a buffer for the file's bytes and copies them into the target (a page
    fault per 4 KiB under a host budget's allocator), and its write costs several times
    the CPU time of a ``pwrite`` (docs/results/2026-11-25.md): CPU the device's dispatch
    and the host optimizer share. The files stay TensorStore's array's: a chunk file is
    the page's raw bytes (checked when the array opens), a missing file is a chunk of
    zeros, and a write goes to a new file renamed over the old one, as TensorStore
    writes, so a read sees one whole version and a checkpoint's hard link to the old
    file keeps the old page."""

    def __init__(self, threads: int = IO_CONCURRENCY):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "hetjax-nvme")
        self._buffered: set[Path] = set()  # directories without O_DIRECT (tmpfs)

    def read(self, files: list[Path], pages: np.ndarray) -> list[concurrent.futures.Future]:
        return [self._pool.submit(self._read, f, p) for f, p in zip(files, pages, strict=True)]

    def write(self, files: list[Path], pages: np.ndarray) -> list[concurrent.futures.Future]:
        return [self._pool.submit(self._write, f, p) for f, p in zip(files, pages, strict=True)]

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Runs ``fn(*args)`` on the I/O threads (a copy that stands in for a read)."""
        return self._pool.submit(fn, *args)

    def submit_write(self, fn, *args) -> concurrent.futures.Future:
        """Runs ``fn(*args)`` on the I/O threads, as a write (a hard link standing in for
        one)."""
        return self._pool.submit(fn, *args)

    def _write(self, path: Path, page: np.ndarray) -> None:
        view = memoryview(page.view(np.uint8))  # (bf16: no buffer format of its own)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        try:
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except FileNotFoundError:  # a page never written: no directory yet
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _read(self, path: Path, page: np.ndarray) -> None:
        view = memoryview(page.view(np.uint8))  # (bf16: no buffer format of its own)
        try:
            fd = self._open(path)
        except FileNotFoundError:
            page[:] = 0  # never written, or written as zeros: the fill value
            return
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    raise OSError(
                        errno.EIO, f"chunk file is {got} bytes, a page is {len(view)}", str(path)
                    )
                got += n
        finally:
            os.close(fd)

    def _open(self, path: Path, flags: int = os.O_RDONLY) -> int:
        array = path.parent.parent.parent  # <array>/c/<page>/<file>
        if array not in self._buffered:
            try:
                return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered.add(array)  # no O_DIRECT there (tmpfs)
        return os.open(path, flags, 0o644)


def _link_page(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard link to ``src`` (absent ``src``: ``dst`` is removed)."""
    if not src.exists():
        dst.unlink(missing_ok=True)
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{threading.get_ident()}.link")
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)
    os.replace(tmp, dst)


@functools.cache
def direct_io() -> DirectIO:
    """The process's I/O threads, shared by every store."""
    return DirectIO()


def _fails_when_done(write: ts.WriteFutures, error: OSError) -> ts.Future:
    """A future that completes with ``error`` once ``write`` is done: a write the disk
    failed, as its caller sees it (fault injection)."""
    promise, failed = ts.Promise.new()
    write.add_done_callback(lambda _: promise.set_exception(error))
    return failed


def forget_done(writes: list) -> None:
    """Forgets the completed ones of ``writes`` (``(future, data)`` pairs), raising a
    failed one's error: no write is dropped unchecked."""
    kept = []
    for future, data in writes:
        if future.done():
            future.result()
        else:
            kept.append((future, data))
    writes[:] = kept


def bound_writes(writes: list, window: int) -> None:
    """Forgets completed writes (raising a failed one's error) and waits for the oldest
    while more than ``window`` bytes of buffers are held for writes in flight, so a
    step's write-back holds about one stage in RAM (what the host plan counts), not the
    whole step's streamed state until the commit."""
    forget_done(writes)
    pending = sum(data.nbytes for _, data in writes)
    while writes and pending > window:
        future, data = writes.pop(0)
        future.result()
        pending -= data.nbytes


class BaseCounters:
    """The host, NVMe and I/O counters of a store split between the device and a
    ``base`` store (``SplitStateStore``, ``SplitParamStore``): the base store's, since
    the device part holds no host memory and does no I/O."""

    base: Any

    def host_bytes(self) -> int:
        return self.base.host_bytes()

    @property
    def nvme_bytes(self) -> int:
        return self.base.nvme_bytes

    @property
    def read_bytes(self) -> int:
        return self.base.read_bytes

    @property
    def write_bytes(self) -> int:
        return self.base.write_bytes
