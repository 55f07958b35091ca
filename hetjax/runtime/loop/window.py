"""The prefetch window: device copies of block slabs for a known order of uses."""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax

from hetjax import memory, timeline
from hetjax.types import ParamStore


class PrefetchWindow:
    """Prefetches the next ``depth`` uses of ``uses`` (stage names, in the order the
    step computes them) to the device, and drops a slab after a use unless it is used
    again within the window. Stages in ``resident`` are served from there and never
    dropped. With params on NVMe, disk reads start ``IO_READAHEAD`` uses before the
    device copies, and the ``keep`` stages whose device copy is dropped between two uses
    soonest get their first read kept in host RAM for the second (the host plan's
    ``kept_param_blocks``): read once. ``to_device(stage, slab)`` copies a stage's slab
    in.

    The device runs at most ``lag`` uses behind (``memory.window_wait_lag``, the device
    plan's ``wait_lag``): :meth:`get` of use j waits for use j - lag's result
    (``done``'s ``after``) before it copies anything more in. Lag 1 (the CPU backend):
    the previous use's. Lag 2 (an accelerator): the one before, so use j - 1 is still
    queued on the device while the thread dispatches j, and the device's queue never
    runs dry at a block boundary; the device plan counts the slab that holds. JAX dispatches
    asynchronously, and a slab the window drops lives on until the computations queued
    on it have run, so without the wait a dispatching thread that runs ahead of the
    device (NVMe reads faster than a block computes) holds every block of the pass at
    once: device memory beyond the plan's ``prefetch_depth + 1`` slabs, and on the CPU
    backend, where the device array is the host slab it was put from, host slabs beyond
    the host plan (docs/results/2026-11-26.md#figures-moved-from-docstrings)."""

    def __init__(
        self,
        uses: list[str],
        depth: int,
        resident: dict[str, jax.Array],
        params: ParamStore,
        to_device: Callable,
        keep: int = 0,
        *,
        lag: int = memory.WAIT_LAG_HOST,
    ):
        self.uses, self.depth, self.lag = uses, depth, lag
        self.resident, self.params, self.to_device = resident, params, to_device
        self.cache: dict[str, jax.Array] = {}
        self.kept = self._kept(keep)
        # the last ``lag`` uses' results (None: not given): the device is at most that behind
        self._behind: collections.deque = collections.deque()

    def _kept(self, keep: int) -> frozenset[str]:
        """The ``keep`` stages fetched again after their device copy was dropped (a use
        farther than the window ahead), the nearest second uses first."""
        first: dict[str, int] = {}
        gaps = []
        for j, name in enumerate(self.uses):
            if name in self.resident:
                continue
            if name in first and j - first[name] > max(self.depth, 1):
                gaps.append((j - first[name], name))
            first[name] = j
        return frozenset(name for _, name in sorted(gaps)[:keep])

    def _fetch(self, name: str) -> jax.Array:
        if name in self.resident:
            return self.resident[name]
        if name not in self.cache:
            got = self.params.get(name, keep=name in self.kept)
            self.cache[name] = self.to_device(name, got)
            timeline.watch("host_to_device", name, self.cache[name])
        return self.cache[name]

    def get(self, j: int) -> jax.Array:
        """The slab of use ``j``, on the device (copied by :meth:`done` of the use
        before, unless the window is shallower)."""
        end = min(j + 1 + self.depth + memory.IO_READAHEAD, len(self.uses))
        for k in range(j, end):
            if self.uses[k] not in self.resident and self.uses[k] not in self.cache:
                self.params.prefetch(self.uses[k])
        while len(self._behind) >= self.lag:  # (the disk reads above are issued first)
            behind = self._behind.popleft()
            if behind is not None:
                jax.block_until_ready(behind)
        return self._fetch(self.uses[j])

    def done(self, j: int, after=None) -> None:
        """Use ``j`` is dispatched: its slab goes unless the window needs it again, and,
        while the device computes ``j``, the next use's copy is dispatched (waiting for
        its read if it is still landing, as at a step's start) and those of the
        ``depth - 1`` after it whose reads have landed (the others: when they have, or
        are next). A read landing late thus delays the dispatching thread, never the
        device's use ``j``, nor use ``j + 1`` for a read behind it. ``after``: a result
        of its computation, which the :meth:`get` ``lag`` uses on waits for."""
        self._behind.append(after)
        name = self.uses[j]
        if name not in self.uses[j + 1 : j + 1 + max(self.depth, 1)]:
            self.cache.pop(name, None)
        for k in range(j + 1, min(j + 1 + self.depth, len(self.uses))):
            stage = self.uses[k]
            if k == j + 1 or stage in self.resident or self.params.ready(stage):
                self._fetch(stage)
