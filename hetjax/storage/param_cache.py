"""The copies in RAM of an NVMe param store's stages (``params.NvmeParamStore``): one
named map per reason a stage's params are in RAM besides the committed files, and the
rules that move a stage between them (:class:`ParamCache`)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


class ParamCache:
    """Where a stage's compute-dtype params are in RAM besides the committed files of a
    ``params.NvmeParamStore``, one named map per reason, and the rules that move them:

    * ``reads``: read ahead from the committed copy (in flight or landed), taken by
      the stage's next ``get``; dropped where a newer copy is in RAM.
    * ``kept``: what a ``get`` with ``keep`` handed out, for the stage's next ``get`` (a
      block's backward after its forward, ``memory_host.kept_param_blocks``), which
      takes it; forgotten at the commit.
    * ``published``: this step's published pages, ``(write, data)``, held while the write
      is in flight, or to the commit for the ``keep_published`` stages
      (``memory_host.kept_published``); a landed write's data is let go.
    * ``landing``: what ``published`` held at the last commit, now committed: ``get``
      serves the stage from this data (no read) until the next commit, which waits for
      these writes; a ``keep_published`` stage is served once and handed over.
    * ``handed``: a ``keep_published`` stage's write, once its landing data was handed
      out: a read of the stage from disk waits for it first.

    A lock-free loop commits while the runtime gets: the commit and a publish replace
    their maps whole, and ``get`` looks at ``landing`` once."""

    def __init__(self, keep_published=()):
        self.keep_published = frozenset(keep_published)
        self.reads: dict[str, Any] = {}
        self.kept: dict[str, Any] = {}
        self.published: dict[str, tuple] = {}
        self.landing: dict[str, tuple] = {}
        self.handed: dict[str, Any] = {}

    def holds(self, stage: str, written: tuple) -> bool:
        """Whether a published stage's ``(write, data)`` stays in RAM: its write is in
        flight, or it is one of ``keep_published``."""
        return stage in self.keep_published or not written[0].done()

    def publish(self, stage: str, future, data: np.ndarray) -> None:
        """This step's write of ``stage``: held while :meth:`holds` says so (and the
        other stages' landed writes let go)."""
        published = {s: w for s, w in self.published.items() if self.holds(s, w)}
        if self.holds(stage, (future, data)):
            published[stage] = (future, data)
        self.published = published

    def in_ram(self, stage: str) -> bool:
        """Whether ``get(stage)`` is served from RAM (kept, or landing)."""
        return stage in self.kept or stage in self.landing

    def serve_landing(self, stage: str) -> np.ndarray | None:
        """The data of a landing stage for a ``get`` (None: not landing); a read issued
        before the commit is stale, and dropped."""
        landing = self.landing.get(stage)  # (one look: a lock-free loop commits)
        if landing is None:
            return None
        self.reads.pop(stage, None)
        if stage in self.keep_published:  # handed over: later gets read the disk
            self.landing.pop(stage, None)
            self.handed[stage] = landing[0]
        return landing[1]

    def before_read(self, stage: str) -> None:
        """A read of ``stage`` from disk is about to start: its handed write lands first
        (long landed, as a rule)."""
        if stage in self.handed:
            self.handed.pop(stage).result()

    def drop(self, stage: str) -> None:
        """``stage``'s committed params changed outside an update (a catch-up): its copies
        in RAM go (the last update's writes landed first: they are written over) and its
        read ahead (waited for: an old read, nobody wants it)."""
        self.kept.pop(stage, None)
        landing, handed = self.landing.pop(stage, None), self.handed.pop(stage, None)
        for write in (landing[0] if landing else None, handed):
            if write is not None:
                write.result()
        read = self.reads.pop(stage, None)
        if read is not None:
            with contextlib.suppress(Exception):
                read.result()

    def commit(self) -> None:
        """The step's published stages become the landing ones (the previous step's
        landed first)."""
        self.kept.clear()  # the step's; a failed one may leave some
        self.land()  # the previous step's: long done
        self.landing = {s: w for s, w in self.published.items() if self.holds(s, w)}
        self.published = {}

    def land(self) -> None:
        """Waits for the landing and handed writes; forgets them."""
        for future, _ in self.landing.values():
            future.result()
        for future in self.handed.values():
            future.result()
        self.landing, self.handed = {}, {}

    def forget(self) -> None:
        """Drops what this step kept and published (its writes were waited for) and
        lands the rest."""
        self.kept.clear()
        self.published = {}
        self.land()
