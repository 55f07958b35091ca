"""Checksums of the NVMe tier's live pages, kept in RAM beside the files.

A page the tier reads back is the page it wrote: nothing else writes its files. So each
:class:`~hetjax.storage.nvme.PageStore` keeps the CRC-32 of every row (page) it writes
(:meth:`PageChecksums.record`, on the I/O thread that wrote it) and checks every row it
reads (:meth:`PageChecksums.check`): a flipped bit on the SSD stops the run with
:class:`~hetjax.types.DamagedPageError` naming the file and the page, instead of being
trained on. A hard link standing in for a write copies the source's sum with the file.

Why not TensorStore's own ``crc32c`` codec (zarr3): it detects a damaged chunk (its read
fails with ``DATA_LOSS: ... Digest mismatch``), but it appends the digest to each chunk
file, so a file is no longer the page's raw bytes: the O_DIRECT reads and writes
(``nvme.DirectIO``) and the checkpoint's hard links of raw pages would all have to go.
A sum in RAM costs 8 bytes a page and one CRC-32 pass over each page read and written
(zlib's, about 4 GB/s a core, on the I/O threads; ``python -m hetjax.bench io``). The
sums live as long as the process: a restarted run rewrites its pages from a checkpoint,
whose files carry CRC-32s of their own (``checkpoint_state.py``)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from hetjax.types import DamagedPageError

UNKNOWN = -1  # a row this store never wrote (read as zeros): nothing to check


def crc32(row: np.ndarray) -> int:
    """CRC-32 of an array's bytes (as bytes: bfloat16 has no buffer format of its own)."""
    return zlib.crc32(memoryview(np.ascontiguousarray(row).reshape(-1).view(np.uint8)))


class PageChecksums:
    """The CRC-32 of each row of each kind of one store, as last written (``enabled``
    False: none kept, nothing checked)."""

    def __init__(self, kinds: list[str], num_rows: int, label: str, enabled: bool = True):
        self.label, self.enabled = label, enabled
        self.sums = {k: np.full(num_rows, UNKNOWN, np.int64) for k in kinds}

    def record(self, kind: str, row: int, data: np.ndarray) -> None:
        """Row ``row`` of ``kind`` now holds ``data`` (its write is complete)."""
        if self.enabled:
            self.sums[kind][row] = crc32(data)

    def check(self, kind: str, row: int, data: np.ndarray, path: Path) -> None:
        """Raises :class:`DamagedPageError` when ``data``, just read from ``path``, is
        not what row ``row`` of ``kind`` was written with."""
        want = int(self.sums[kind][row])
        if want == UNKNOWN:
            return
        got = crc32(data)
        if got != want:
            raise DamagedPageError(path, row, f"{self.label} {kind}", got, want)

    def expected(self, kind: str, first: int, n: int) -> list[int]:
        """The sums of rows ``[first, first + n)`` (``UNKNOWN`` where never written)."""
        return [int(v) for v in self.sums[kind][first : first + n]]

    def copy(self, src: PageChecksums, kind: str, row: int) -> None:
        """Row ``row`` is now a hard link to ``src``'s file of the same row."""
        self.sums[kind][row] = src.sums[kind][row]
