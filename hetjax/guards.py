"""What the training loop guards against besides a non-finite step.

**Loss spikes** (``train.spike_factor``): a step whose finite loss exceeds the factor
times the median loss of the last ``train.spike_window`` steps that updated the state is
handled as a non-finite one: the runtime updates nothing (the limit goes into its step,
like the finiteness check) and ``train.on_nonfinite`` skips, rolls back or stops.

**Damaged state**: a live NVMe page that fails its checksum (``storage/checksums.py``)
stops the step; the newest good copy is the newest checkpoint that does not hold the
damaged file itself (a hard-linked checkpoint shares the live files' blocks). A
checkpoint whose pages fail their CRC-32 as they are restored is set aside and the one
before it restored instead."""

from __future__ import annotations

import collections
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hetjax.checkpoint import Checkpointer
from hetjax.types import CheckpointDamaged, DamagedPageError


class SpikeGuard:
    """The running median of the last ``window`` losses of steps that updated the state
    (spikes and non-finite steps are not added), and the limit it gives the next step:
    ``factor`` times that median, or infinity while the window is not full or with
    ``factor`` 0 (off)."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.spikes = 0  # steps held back as spikes so far

    def limit(self) -> float:
        """The loss above which the next step is a spike."""
        if not self.factor or len(self.losses) < self.losses.maxlen:
            return math.inf
        return self.factor * self.median()

    def median(self) -> float:
        return float(np.median(self.losses))

    def add(self, loss: float) -> None:
        """A step that updated the state, with its loss."""
        self.losses.append(loss)


# -- damaged state: the newest good copy ----------------------------------------------------


def damaged_page(error: BaseException) -> DamagedPageError | None:
    """The :class:`DamagedPageError` that caused ``error`` (itself, or one in its chain
    of causes), if any: a step stopped by a live NVMe page that fails its checksum."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DamagedPageError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def checkpoints_sharing(ckpt: Checkpointer, path: Path) -> list[int]:
    """The complete checkpoints holding ``path``'s file itself (a hard link: the same
    blocks on disk, so the same damage), oldest first."""
    try:
        target = path.stat()
    except FileNotFoundError:
        return []
    sharing = []
    for step in ckpt.steps():
        # following links: pages striped over drives are on those (checkpoint_drives.py)
        for top, _, files in os.walk(ckpt.directory / str(step), followlinks=True):
            if any(_same_file(Path(top) / f, target) for f in files):
                sharing.append(step)
                break
    return sharing


def _same_file(path: Path, target: os.stat_result) -> bool:
    st = path.stat()
    return (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev)


def set_aside(ckpt: Checkpointer, step: int) -> Path:
    """Moves checkpoint ``step`` out of the checkpoints (into ``damaged/<step>``, kept
    for inspection): a run resuming or rolling back past it can save that step again."""
    ckpt.wait()
    where = ckpt.directory / "damaged" / str(step)
    where.parent.mkdir(exist_ok=True)
    if where.exists():
        shutil.rmtree(where)
    os.replace(ckpt.directory / str(step), where)
    ckpt.manager.reload()
    return where


def fall_back(
    ckpt: Checkpointer, step: int, error: CheckpointDamaged, log: Callable[[str], None]
) -> tuple[Any, dict[str, Any], int]:
    """Checkpoint ``step`` is damaged (``error``): it is set aside, with a warning, and
    the one before it restored (``(state, meta, its step)``). Raises ``error`` when there
    is none before it."""
    older = [s for s in ckpt.steps() if s < step]
    if not older:
        raise error
    where = set_aside(ckpt, step)
    log(f"warning: {error}")
    log(f"warning: checkpoint step {step} moved to {where}; resuming from step {older[-1]}")
    return restore_good(ckpt, older[-1], log)


def restore_good(
    ckpt: Checkpointer, step: int, log: Callable[[str], None]
) -> tuple[Any, dict[str, Any], int]:
    """``ckpt.restore(step)``, falling back to older checkpoints while the one tried is
    damaged (its pages are checked as they are read: loading the state can raise
    :class:`CheckpointDamaged` too, for :func:`fall_back`)."""
    try:
        state, meta = ckpt.restore(step)
    except CheckpointDamaged as e:
        return fall_back(ckpt, step, e, log)
    return state, meta, step
