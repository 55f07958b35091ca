"""Several NVMe drives (``memory.nvme_path`` naming one directory per drive): each page
array's pages stripe over them, page ``p`` on drive ``p % n`` (the activation swaps'
rows too, ``swap.py``: row ``s`` on drive ``s % n``, whatever its chunks).

An array lives where it always does, under drive 0's directory (its ``zarr.json``, and
the chunk files of pages ``0, n, 2n, ...``); the directory of every other page's chunk
files (``<array>/c/<p>/``, zarr3's default chunk keys: a row's chunks, one where a
chunk is a page) is a symbolic link to the same path
under drive ``p % n``'s directory. Everything that opens a page's file by its path (the
O_DIRECT reads and writes of ``nvme.DirectIO``, TensorStore's own I/O, the hard links
between copies) then reaches the drive that holds it, unchanged; a write's
temporary file is made in the page's directory, so its rename stays on that drive. A
checkpoint hard-links a page where the filesystems allow and copies the stage otherwise
(``checkpoint_state.py``).

Bandwidth adds up over drives, and so does capacity (each holds 1/n of every array, so
the smallest one bounds it): the planner measures each distinct device
(``planning/hardware.py``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Stripes:
    """The drives a run's NVMe pages stripe over: ``root``, drive 0's directory (every
    array's own path is under it), and ``others``, the directories of drives 1 .. n-1
    (the same layout below each)."""

    root: Path
    others: tuple[Path, ...] = ()

    @property
    def count(self) -> int:
        return 1 + len(self.others)

    def drive_of(self, page: int) -> int:
        return page % self.count

    def rows_share(self, nbytes: int, rows: int) -> int:
        """Bytes of an array of ``rows`` equal rows (``nbytes`` in all, row ``r`` on
        drive ``r % n``) that the drive holding the most of them (drive 0) keeps."""
        return -(-rows // self.count) * (nbytes // rows)

    def lay_out(self, array_dir: Path, num_pages: int) -> None:
        """Points the page directories of ``array_dir`` (under :attr:`root`) that belong
        on other drives at fresh, empty directories there (what was there before goes,
        as the array's own files do when it is created)."""
        if not self.others:
            return
        rel = Path(array_dir).relative_to(self.root)
        for other in self.others:
            shutil.rmtree(other / rel, ignore_errors=True)
        chunks = Path(array_dir) / "c"
        chunks.mkdir(parents=True, exist_ok=True)
        for page in range(num_pages):
            k = self.drive_of(page)
            if not k:
                continue
            target = self.others[k - 1] / rel / "c" / str(page)
            target.mkdir(parents=True)
            link = chunks / str(page)
            if link.is_symlink() or link.is_file():
                link.unlink()
            elif link.is_dir():
                shutil.rmtree(link)
            # absolute: a relative target would resolve against the link's directory
            link.symlink_to(target.absolute(), target_is_directory=True)


def stripes_of(dirs: list[Path], subdir: str = "") -> Stripes:
    """The stripes over ``dirs`` (one per drive; ``subdir`` below each)."""
    dirs = [Path(d) / subdir if subdir else Path(d) for d in dirs]
    return Stripes(dirs[0], tuple(dirs[1:]))
