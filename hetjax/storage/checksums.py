"""Checksums of the NVMe tier's live pages, kept in RAM beside the files, and the one
page checksum (:func:`page_checksum`) that the tier and checkpoints use.

**The sum**: CRC-32C (Castagnoli), computed by the ``crc32c`` package with the CPU's CRC
instructions (SSE4.2 on x86-64, the CRC extension on Arm): about 14 GB/s a core here,
faster than a page copy, against zlib's CRC-32 at about 3 GB/s (issue #58; the figures
are in ``docs/results/2026-11-29.md``). Where the CPU has no CRC instructions the package
falls back to software, and the first sum says so once (:func:`page_checksum`).
Checkpoints written before 2026-11-29 carry zlib CRC-32s (their index's ``crc32`` key):
:data:`LEGACY_ALGORITHM` still checks them.

A page the tier reads back is the page it wrote: nothing else writes its files. So each
:class:`~hetjax.storage.nvme.PageStore` keeps the CRC-32C of every row (page) it writes
(:meth:`PageChecksums.record`, on the I/O thread that wrote it) and checks every row it
reads (:meth:`PageChecksums.check`): a flipped bit on the SSD stops the run with
:class:`~hetjax.types.DamagedPageError` naming the file and the page, instead of being
trained on. A hard link standing in for a write copies the source's sum with the file.

Why not TensorStore's own ``crc32c`` codec (zarr3): it detects a damaged chunk (its read
fails with ``DATA_LOSS: ... Digest mismatch``), but it appends the digest to each chunk
file, so a file is no longer the page's raw bytes: the O_DIRECT reads and writes
(``nvme.DirectIO``) and the checkpoint's hard links of raw pages would all have to go.
A sum in RAM costs 8 bytes a page and one CRC-32C pass over each page read and written
(on the I/O threads; ``python -m hetjax.bench io``). The
sums live as long as the process: a restarted run rewrites its pages from a checkpoint,
whose files carry checksums of their own (``checkpoint_state.py``)."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from hetjax.types import DamagedPageError

UNKNOWN = -1  # a row this store never wrote (read as zeros): nothing to check

ALGORITHM = "crc32c"  # the sum of every page written now (a checkpoint index's key)
LEGACY_ALGORITHM = "crc32"  # zlib's, in checkpoints written before 2026-11-29
SOFTWARE_WARNING = (
    "hetjax: this CPU has no CRC-32C instructions (SSE4.2 / Arm CRC): page checksums run "
    "in software, several times slower (docs/guide/checkpoints.md)"
)
_warned = False


def _bytes(row: np.ndarray) -> memoryview:
    # as bytes: a buffer of bfloat16 (ml_dtypes) has no format memoryview can cast
    return memoryview(np.ascontiguousarray(row).reshape(-1).view(np.uint8))


def page_checksum(row: np.ndarray) -> int:
    """CRC-32C of an array's bytes: the sum of every NVMe page and checkpoint page."""
    global _warned
    if not _warned and not crc32c.hardware_based:
        _warned = True
        warnings.warn(SOFTWARE_WARNING, stacklevel=2)
    return crc32c.crc32c(_bytes(row))


def legacy_checksum(row: np.ndarray) -> int:
    """zlib's CRC-32 of an array's bytes: the sums of checkpoints written before
    2026-11-29 (their index's ``crc32`` key)."""
    return zlib.crc32(_bytes(row))


CHECKSUMS: dict[str, Callable[[np.ndarray], int]] = {
    ALGORITHM: page_checksum,
    LEGACY_ALGORITHM: legacy_checksum,
}


class PageChecksums:
    """The CRC-32C of each row of each kind of one store, as last written (``enabled``
    False: none kept, nothing checked)."""

    def __init__(self, kinds: list[str], num_rows: int, label: str, enabled: bool = True):
        self.label, self.enabled = label, enabled
        self.sums = {k: np.full(num_rows, UNKNOWN, np.int64) for k in kinds}

    def record(self, kind: str, row: int, data: np.ndarray) -> None:
        """Row ``row`` of ``kind`` now holds ``data`` (its write is complete)."""
        if self.enabled:
            self.sums[kind][row] = page_checksum(data)

    def check(self, kind: str, row: int, data: np.ndarray, path: Path) -> None:
        """Raises :class:`DamagedPageError` when ``data``, just read from ``path``, is
        not what row ``row`` of ``kind`` was written with."""
        want = int(self.sums[kind][row])
        if want == UNKNOWN:
            return
        got = page_checksum(data)
        if got != want:
            raise DamagedPageError(path, row, f"{self.label} {kind}", got, want)

    def expected(self, kind: str, first: int, n: int) -> list[int]:
        """The sums of rows ``[first, first + n)`` (``UNKNOWN`` where never written)."""
        return [int(v) for v in self.sums[kind][first : first + n]]

    def copy(self, src: PageChecksums, kind: str, row: int) -> None:
        """Row ``row`` is now a hard link to ``src``'s file of the same row."""
        self.sums[kind][row] = src.sums[kind][row]
