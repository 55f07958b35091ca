"""``python -m hetjax.bench io``: the TensorStore tier's read/write GB/s vs the raw
sequential disk (O_DIRECT), then a sweep of TensorStore's file I/O settings
(``file_io_mode`` default / direct / memmap, concurrency, page size) against it, and
the tier's reads and writes with and without the live page checksums.

``--nvme-path /a,/b`` (several drives, as ``memory.nvme_path``): each distinct device
probed once, as the planner probes it, and the bandwidths summed by the planner's own
function (``planning/hardware.py:drives_bandwidth``), so the sum printed is the NVMe
lane the planner prices; then pages striped over all the directories, written and read
at once, against that sum."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from hetjax.bench.common import _scratch_dir
from hetjax.planning import hardware
from hetjax.planning.hardware import drop_page_cache
from hetjax.storage.nvme import IO_CONCURRENCY, IO_MODE
from hetjax.storage.pages import DIRECT_ALIGN, aligned_empty
from hetjax.storage.stripes import Stripes


def _raw_disk_bandwidth(directory: Path, nbytes: int, block: int = 4 << 20) -> tuple[float, float]:
    """Write and read GB/s of one file with O_DIRECT (no page cache) in ``block``-sized
    requests, sequential (one in flight) and with ``IO_CONCURRENCY`` in flight; the
    better of the two each way: the disk's raw bandwidth as this process can get it (a
    virtual or NVMe disk serves a queue of requests faster than one at a time: measured
    here 1.17 GB/s read one at a time, 2.37 with 16, docs/results/2026-11-25.md)."""
    import concurrent.futures
    import mmap

    path = directory / "raw.bin"
    bufs = [mmap.mmap(-1, block) for _ in range(IO_CONCURRENCY)]  # page-aligned
    for buf in bufs:
        buf.write(np.random.default_rng(0).bytes(block))
    direct = getattr(os, "O_DIRECT", 0)
    n = nbytes // block
    pool = concurrent.futures.ThreadPoolExecutor(IO_CONCURRENCY)
    best_w = best_r = 0.0

    def run(call, fd: int, in_flight: int) -> float:  # GB/s of n requests, in_flight at once
        t0 = time.perf_counter()
        if in_flight == 1:
            for i in range(n):
                call(fd, bufs[0], i)
        else:
            list(pool.map(lambda i: call(fd, bufs[i % in_flight], i), range(n)))
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t0) / 1e9

    write = lambda fd, buf, i: os.pwrite(fd, buf, i * block)
    read = lambda fd, buf, i: os.preadv(fd, [buf], i * block)
    try:
        for in_flight in (1, IO_CONCURRENCY):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | direct, 0o600)
            try:
                best_w = max(best_w, run(write, fd, in_flight))
                best_r = max(best_r, run(read, fd, in_flight))
            finally:
                os.close(fd)
    finally:
        pool.shutdown()
        path.unlink(missing_ok=True)
    return best_w, best_r


def _tensorstore_bandwidth(
    directory: Path,
    nbytes: int,
    page: int,
    io_mode: str = IO_MODE,
    concurrency=IO_CONCURRENCY,
    others: tuple[Path, ...] = (),
) -> tuple[float, float, float]:
    """Write (until on disk: ``os.sync`` included) and cold-read GB/s of whole pages
    through :class:`PageStore`, all requests in flight at once as the loop issues them;
    and the write GB/s of the process's first pass.

    The write is timed in the steady state of training, which rewrites pages that exist:
    one untimed pass first writes every page, as start-up does. The first pass of a
    process is slower (0.43-0.65 GB/s against 0.97-1.31 for the passes after it, same
    files, measured here): glibc serves its first large buffers from fresh mmaps, a
    page fault per 4 KiB, and reuses them afterwards. ``others``: the pages striped
    over ``directory`` and these (``storage/stripes.py``), as the tier stripes them."""

    from hetjax.storage.nvme import PageStore

    elems = page // 4
    pages = nbytes // page
    stripes = Stripes(directory, tuple(others)) if others else None
    store = PageStore(
        directory / "ts", ["master"], pages, elems, io_mode=io_mode, concurrency=concurrency,
        stripes=stripes,
    )  # fmt: skip
    data = np.random.default_rng(0).random(pages * elems, dtype=np.float32)
    stage = 4  # pages per request, as a stage of a few pages

    def write_all() -> None:
        futures = [
            store.write("master", p, data[p * elems : (p + stage) * elems])
            for p in range(0, pages, stage)
        ]
        for f in futures:
            f.result()
        os.sync()

    t0 = time.perf_counter()
    write_all()  # start-up's pass: the files exist from here on
    first = nbytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    write_all()
    write = nbytes / (time.perf_counter() - t0) / 1e9
    drop_page_cache(directory / "ts")
    t0 = time.perf_counter()
    reads = [store.read("master", p, min(stage, pages - p)) for p in range(0, pages, stage)]
    for r in reads:
        r.result()
    read = nbytes / (time.perf_counter() - t0) / 1e9
    del reads
    # the tier's read: whole pages into its aligned buffers (``DirectIO`` where the
    # store allows it), as the optimizer state and param reads run
    out = aligned_empty(pages * elems, np.float32, DIRECT_ALIGN)
    drop_page_cache(directory / "ts")
    t0 = time.perf_counter()
    ahead = [
        store.read_into("master", p, out[p * elems : min(p + stage, pages) * elems])
        for p in range(0, pages, stage)
    ]
    for r in ahead:
        r.result()
    tier_read = nbytes / (time.perf_counter() - t0) / 1e9
    if not np.array_equal(out, data):
        raise RuntimeError("bench io: the tier's read returned other data than was written")
    for d in (directory, *others):
        shutil.rmtree(d / "ts", ignore_errors=True)
    return write, read, first, tier_read


TIER = (IO_MODE, IO_CONCURRENCY, 4 << 20)  # the tier's settings (4 MiB pages at most)


def _sweep(directory: Path, quick: bool, raw_w: float, raw_r: float) -> list[dict]:
    """TensorStore's file I/O settings against the raw disk, one at a time from the
    tier's (``IO_MODE``, ``IO_CONCURRENCY``, 4 MiB pages): each ``file_io_mode``, then
    the concurrency and the page size in the tier's mode."""
    disk_bytes = (64 if quick else 1024) << 20
    settings = [(mode, IO_CONCURRENCY, 4 << 20) for mode in ("default", "direct", "memmap")]
    settings += [(IO_MODE, c, 4 << 20) for c in (4, 64)]
    settings += [(IO_MODE, IO_CONCURRENCY, p) for p in (1 << 20, 16 << 20)]
    print(f"TensorStore settings, {disk_bytes >> 20} MiB   GB/s write   GB/s read   (x raw)")
    rows = []
    for mode, concurrency, page in settings:
        w, r, _, _ = _tensorstore_bandwidth(directory, disk_bytes, page, mode, concurrency)
        name = f"{mode}, concurrency {concurrency}, {page >> 20} MiB pages"
        tier = (
            " (the tier's)"
            if (mode, concurrency, page) == (IO_MODE, IO_CONCURRENCY, 4 << 20)
            else ""
        )
        print(f"  {name + tier:<44}{w:>6.2f} ({w / raw_w:.2f}){r:>7.2f} ({r / raw_r:.2f})")
        rows.append(dict(mode=mode, concurrency=concurrency, page=page, write=w, read=r))
    return rows


def _disk_rows(directory: Path, quick: bool, label: str = "") -> dict:
    """The TensorStore tier's page write / cold read GB/s against the raw disk's
    sequential O_DIRECT bandwidth, measured one after the other on ``directory``."""
    disk_bytes = (64 if quick else 1024) << 20
    page = 4 << 20
    raw_w, raw_r = _raw_disk_bandwidth(directory, disk_bytes)
    ts_w, ts_r, first_w, tier_r = _tensorstore_bandwidth(directory, disk_bytes, page)
    pad = " " * len(label)
    print(f"{label}disk, {disk_bytes >> 20} MiB in 4 MiB pages   GB/s write   GB/s read")
    print(f"{pad}raw O_DIRECT, sequential        {raw_w:>10.2f} {raw_r:>10.2f}")
    print(f"{pad}  (the better of 1 and {IO_CONCURRENCY} requests in flight)")
    print(f"{pad}TensorStore PageStore            {ts_w:>10.2f} {ts_r:>10.2f}")
    print(f"{pad}achieved / raw                   {ts_w / raw_w:>10.2f} {ts_r / raw_r:>10.2f}")
    tier = f"{'-':>10} {tier_r:>10.2f} ({tier_r / raw_r:.2f} x raw)"
    print(f"{pad}the tier's read, direct           {tier}")
    print(f"{pad}(the process's first write pass, new files: {first_w:.2f} GB/s)")
    return {
        "disk_bytes": disk_bytes,
        "raw_write": raw_w,
        "raw_read": raw_r,
        "ts_write": ts_w,
        "ts_read": ts_r,
        "ts_first_write": first_w,
        "tier_read": tier_r,  # O_DIRECT pread into the tier's buffers (nvme.DirectIO)
        "write_vs_raw": ts_w / raw_w,
        "read_vs_raw": ts_r / raw_r,
    }


def _checksum_rows(directory: Path, quick: bool, repeats: int = 5) -> dict:
    """The tier's page reads (O_DIRECT into aligned buffers) and borrowed writes with
    the live page checksums (``storage/checksums.py``: a CRC-32C of every page written,
    checked on every read) and without (``PageStore(verify=False)``): GB/s and the
    process's CPU seconds per GB, the median of ``repeats`` passes each."""
    from hetjax.storage.nvme import PageStore

    nbytes, page = (64 if quick else 256) << 20, 4 << 20
    elems, pages = page // 4, nbytes // page
    data = aligned_empty(pages * elems, np.float32, DIRECT_ALIGN)
    data[:] = np.random.default_rng(0).random(pages * elems, dtype=np.float32)
    out = aligned_empty(pages * elems, np.float32, DIRECT_ALIGN)
    cpu = lambda: sum(os.times()[:2])
    rows = {}
    print(f"live page checksums, {nbytes >> 20} MiB in 4 MiB pages   GB/s   CPU s/GB")
    for verify in (True, False):
        store = PageStore(directory / f"sums{verify}", ["master"], pages, elems, verify=verify)
        runs: dict[str, list[tuple[float, float]]] = {"write": [], "read": []}
        for _ in range(repeats):
            for what in ("write", "read"):
                os.sync()
                wall, busy = time.perf_counter(), cpu()
                if what == "write":
                    store.write("master", 0, data, borrowed=True).result()
                else:
                    store.read_into("master", 0, out).result()
                runs[what].append((time.perf_counter() - wall, cpu() - busy))
        if not np.array_equal(out, data):
            raise RuntimeError("bench io: the tier's read returned other data than was written")
        for what, times in runs.items():
            wall = float(np.median([t for t, _ in times]))
            busy = float(np.median([c for _, c in times]))
            name = f"{what}, {'checked' if verify else 'unchecked'}"
            rows[name] = {"GBps": nbytes / wall / 1e9, "cpu_s_per_GB": busy / (nbytes / 1e9)}
            print(f"  {name:<36}{rows[name]['GBps']:>7.2f}{rows[name]['cpu_s_per_GB']:>10.3f}")
        shutil.rmtree(directory / f"sums{verify}")
    return rows


def _checksum_cost(rows: dict) -> dict:
    """Checked over unchecked GB/s of the tier's writes and reads (issue #58's goal:
    within 3%, i.e. >= 0.97), from :func:`_checksum_rows`' rows."""
    ratios = {}
    for what in ("write", "read"):
        ratios[what] = rows[f"{what}, checked"]["GBps"] / rows[f"{what}, unchecked"]["GBps"]
        print(f"  {what + ', checked / unchecked':<36}{ratios[what]:>7.3f}   (goal >= 0.97)")
    return ratios


def _sum_rates(quick: bool, repeats: int = 5) -> dict:
    """GB/s of one core summing ``pages`` one page at a time: the tier's CRC-32C
    (``checksums.page_checksum``), zlib's CRC-32 (the sum before 2026-11-29) and a plain
    copy of each page (the memory-speed bound), the median of ``repeats`` passes each."""
    from hetjax.storage.checksums import legacy_checksum, page_checksum

    elems = 1 << 20  # 4 MiB pages of fp32
    pages = np.random.default_rng(1).random(((16 if quick else 64), elems), dtype=np.float32)
    scratch = np.empty_like(pages[0])
    ways = {
        "CRC-32C (storage/checksums.py)": page_checksum,
        "zlib CRC-32 (before)": legacy_checksum,
        "page copy (memory bound)": lambda p: np.copyto(scratch, p),
    }
    rates = {}
    for name, way in ways.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for p in pages:
                way(p)
            times.append(time.perf_counter() - t)
        rates[name] = pages.nbytes / float(np.median(times)) / 1e9
        print(f"  {name:<36}{rates[name]:>7.2f} GB/s, one core")
    return rates


def _disk_sweep(directory: Path, quick: bool) -> dict:
    rows = _disk_rows(directory, quick)
    rows["settings"] = _sweep(directory, quick, rows["raw_write"], rows["raw_read"])
    rows["checksums"] = _checksum_rows(directory, quick)
    rows["checksum_cost"] = _checksum_cost(rows["checksums"])
    rows["checksum_rates"] = _sum_rates(quick)
    return rows


def _drives(dirs: list[Path], quick: bool) -> dict:
    """Several drives: each distinct device's probe (the planner's, ``measure_nvme``)
    and raw O_DIRECT bandwidth, their sum as the planner takes it (``drives_bandwidth``),
    and the tier's pages striped over all of them, measured at once."""
    drives: list[dict] = []

    def probe(d: Path) -> tuple[float, float]:  # once per device: drives_bandwidth's choice
        read, write = hardware.measure_nvme(d)
        raw_w, raw_r = _raw_disk_bandwidth(d, (64 if quick else 1024) << 20)  # GB/s
        drives.append(
            dict(dir=str(d), read=read, write=write, raw_read=raw_r * 1e9, raw_write=raw_w * 1e9)
        )  # bytes/s each
        return read, write

    read, write, _ = hardware.drives_bandwidth(dirs, probe)
    row = lambda name, w, r: print(f"{name:<38}{w:>10.2f} {r:>10.2f}")  # noqa: E731
    print(f"{len(dirs)} directories, {len(drives)} distinct devices     GB/s write   GB/s read")
    for i, d in enumerate(drives):
        print(f"drive {i}: {d['dir']}")
        row("  the planner's probe (measure_nvme)", d["write"] / 1e9, d["read"] / 1e9)
        row("  raw O_DIRECT", d["raw_write"] / 1e9, d["raw_read"] / 1e9)
    measured = {Path(d["dir"]) for d in drives}
    for d in dirs:
        if d not in measured:
            print(f"({d}: on a device already measured, counted once)")
    row("sum (the planner's NVMe lane)", write / 1e9, read / 1e9)
    nbytes = (64 if quick else 1024) << 20
    work = [Path(tempfile.mkdtemp(prefix=".hetjax-io-", dir=d)) for d in dirs]
    try:
        st_w, _, _, st_r = _tensorstore_bandwidth(work[0], nbytes, 4 << 20, others=tuple(work[1:]))
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)
    row("pages striped over all, at once", st_w, st_r)
    row("striped / sum", st_w / (write / 1e9), st_r / (read / 1e9))
    return {
        "drives": drives,
        "drives_read": read,  # bytes/s, as the planner sums them
        "drives_write": write,
        "striped_write": st_w,  # GB/s, as the rows above
        "striped_read": st_r,
    }


def bench_io(quick: bool, nvme_path: str = "") -> dict:
    """TensorStore tier read/write GB/s vs the raw sequential disk bandwidth, one run;
    ``nvme_path`` naming several directories (``memory.nvme_path``'s form): per drive
    and summed instead (:func:`_drives`)."""
    dirs = [Path(d.strip()) for d in nvme_path.split(",") if d.strip()]
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(f"bench io: --nvme-path names {d}, which is not a directory")
    if len(dirs) > 1:
        return _drives(dirs, quick)
    if dirs:
        with tempfile.TemporaryDirectory(prefix=".hetjax-io-", dir=dirs[0]) as tmp:
            return _disk_sweep(Path(tmp), quick)
    with tempfile.TemporaryDirectory(dir=_scratch_dir()) as tmp:  # the disk hetjax would use
        return _disk_sweep(Path(tmp), quick)
