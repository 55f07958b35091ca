"""A checkpoint's NVMe pages on several drives (``memory.nvme_path`` naming several,
``storage/stripes.py``): each drive's pages hard-linked on that drive.

A hard link cannot cross filesystems, and a checkpoint directory is on one. So a save
that links a striped run's committed page files links each into a directory on the
drive that holds it, one per save::

    <drive k>/checkpoints/<namespace>/<step>.<nonce>/<kind>/c/<page>/0

(``<drive k>``: that drive's directory of the run's pages, this process's; the
namespace: a hash of the checkpoint directory's path, so two runs' checkpoints on
shared drives never touch each other's.) In the checkpoint's own array
(``<step>/state/proc<p>/<kind>``) the directory of such a page, ``c/<page>``, is a
symbolic link to the drive's, as the tier's arrays are (``stripes.py``): every read of
the checkpoint, TensorStore's by path, reaches it unchanged. ``index.json`` lists the
drive directories (:data:`DRIVES`, absolute paths):

- a restore checks each is there before reading anything (:func:`check_present`); a
  checkpoint directory moved or copied keeps pointing at them, and one whose drive
  directory is missing fails naming it;
- the per-drive directories of a checkpoint go with it (:class:`DriveRetention`): those
  of checkpoints no longer complete (retired by ``checkpoint.keep``, deleted, set
  aside) and those no complete checkpoint names (a save that crashed) are removed after
  each save, while no save is in flight.

Drive 0's pages are treated like the others' (linked in its own checkpoint directory),
so a checkpoint directory on none of the drives still links every page. A save that
copies (``checkpoint.link_nvme=false``, ``copy_every``) writes every page into the
checkpoint itself, as with one drive.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from hetjax.storage.nvme import page_dir, page_file
from hetjax.storage.stripes import Stripes
from hetjax.types import CheckpointError

DRIVES = "drives"  # index.json: the drive directories this process's pages link into
ROOT = "checkpoints"  # under each drive's directory


def namespace(checkpoint_dir: Path) -> str:
    """The folder of ``checkpoint_dir``'s saves under each drive's :data:`ROOT`."""
    return hashlib.sha1(str(Path(checkpoint_dir).absolute()).encode()).hexdigest()[:12]


def drive_dirs(stripes: Stripes) -> list[Path]:
    """Each drive's directory of a run's pages, drive 0 first."""
    return [stripes.root, *stripes.others]


class DriveLinks:
    """One save's per-drive directories (``<step>.<nonce>``, the nonce unique to the
    save: a step saved again, after a rollback, gets new ones). :meth:`chunk_file`
    gives where a page links; :attr:`used` the directories made, for the index."""

    def __init__(self, checkpoint_dir: Path, step: int):
        self.folder = Path(ROOT) / namespace(checkpoint_dir)
        self.name = f"{step}.{time.time_ns():x}"
        self.used: set[Path] = set()

    def chunk_file(self, proc: Path, stripes: Stripes, page: int, kind: str, at: int) -> Path:
        """The file of the checkpoint's page ``at`` of ``kind`` (its array under
        ``proc``), for the tier's page ``page``: on that page's drive, in this save's
        directory there; the checkpoint's page directory made a link to it."""
        drive = drive_dirs(stripes)[stripes.drive_of(page)]
        directory = (drive / self.folder / self.name).absolute()
        real = page_dir(directory / kind, at)
        real.mkdir(parents=True, exist_ok=True)
        self.used.add(directory)
        link = page_dir(proc / kind, at)
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(real, target_is_directory=True)
        return page_file(directory / kind, at)


def check_present(index: dict, proc: Path, checkpoint: Path) -> None:
    """Raises :class:`CheckpointError` naming each drive directory ``index`` (of
    ``proc``, in ``checkpoint``) lists that is not there."""
    missing = [d for d in index.get(DRIVES, []) if not Path(d).is_dir()]
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint} cannot be read: its NVMe pages of {proc.name} are "
            f"hard-linked on their drives, and {', '.join(missing)} is missing (a "
            "checkpoint of pages striped over drives, memory.nvme_path, keeps each drive's "
            "on that drive). Make the directory available at that path, or resume from "
            "another checkpoint"
        )


def _drives_of(step_dir: Path) -> set[Path]:
    """The drive directories a checkpoint's indexes list (none where unreadable)."""
    found: set[Path] = set()
    for index in step_dir.glob("state/proc*/index.json"):
        try:
            found.update(Path(d) for d in json.loads(index.read_text()).get(DRIVES, []))
        except (OSError, ValueError):
            continue
    return found


class DriveRetention:
    """Removes the per-drive directories no complete checkpoint of ``directory``
    needs. :meth:`collect` runs with no save in flight."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.folder = Path(ROOT) / namespace(self.directory)
        self.roots: set[Path] = set()  # <drive>/checkpoints/<namespace> of this run's saves
        self.held: set[Path] = set()  # what the complete checkpoints listed last time

    def note(self, source) -> None:
        """A save's drives (of the NVMe pages among ``source``'s parts, a
        ``StateSource``): their folders of this directory's saves are swept."""
        for part in source.parts:
            stripes = part.pages[0].stripes if part.pages is not None else None
            if stripes is not None:
                self.roots.update((d / self.folder).absolute() for d in drive_dirs(stripes))

    def collect(self, steps: list[int]) -> list[Path]:
        """Removes the drive directories of checkpoints no longer among ``steps`` (the
        complete ones) and those in this directory's folders that none of them lists.
        Returns what it removed."""
        keep: set[Path] = set()
        for step in steps:
            keep |= _drives_of(self.directory / str(step))
        stale = self.held - keep
        for root in self.roots:
            if root.is_dir():
                stale |= {d for d in root.iterdir() if d not in keep}
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        self.held = keep
        return sorted(stale)
