"""Deferred updates: the optimizer state of experts that got no token stays on disk.

A streamed mixture-of-experts block copies only its routed experts to the device
(``runtime/experts/routed.py``); the other experts' gradient is zero. With AdamW an expert with a
zero gradient still moves (its moments decay, its momentum and weight decay change its
params), so skipping its update would change training. Deferring it does not: the update
of a page whose gradient is zero depends only on the page's state and the step's
coefficients, so the updates a page missed can be applied later, one after the other
with the coefficients each step had (:meth:`SlabOptimizer.catch_up`: the same kernel on a
zero gradient), and the page ends bit for bit where it would have been. A page is
caught up before anything reads it:

* the forward of a micro-batch that routes a token to its expert (the host learns the
  routing from the router, then catches the routed experts' pages up before copying
  them in: ``runtime/loop/blocks.py``'s ``Routed._route``);
* its stage's next update that touches it (in RAM, before the update);
* a checkpoint, the final params, an export (``StreamingRuntime.flush_deferred``).

What the step saves: the pages wholly in experts without a token in any of the step's
micro-batches (``ExpertFetcher.zero_pages``) are not read (but their master, which the
params come from), not updated and not written: the step's copy of the NVMe state
gets hard links to their committed files (``NvmeStateStore``). A page skipped over k
steps is read and written once when caught up, instead of k times.

Where: streamed stages of a routed block with their state on NVMe (not cached in RAM),
the native Adam/AdamW kernel, ``optimizer.mode=sync``, one device, data, expert or tensor
parallelism (each process defers its own pages: ``runtime/experts/routed_zero.py``).
Elsewhere every page is updated every step, as before.

:class:`Deferred` is the bookkeeping, kept by the optimizer loop's thread (the runtime's
thread only calls :meth:`Deferred.defer`): how many updates each stage has committed, how
many of them each deferred page has had, and the scalars (step counts) each committed
update started from, as far back as a deferred page needs. :class:`DeferredCatchUps` is
the update loop's strategy over it: the pages each update leaves alone (handed to the
state store with each read and write of the stage), and the catch-ups.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

from hetjax.optimizer import native


def deferred_updates(config) -> bool:
    """Whether ``config`` defers the updates of experts without a token: routed
    experts, optimizer state on NVMe and :func:`deferrable` (the loop further needs a
    streamed stage, ``UpdateLoop``)."""
    off = config.offload
    return off.expert_fetch == "routed" and off.optimizer == "nvme" and deferrable(config)


def deferrable(config) -> bool:
    """Whether ``config`` would defer them wherever the state is on NVMe and the experts
    routed (the planner's question, which chooses both):
    ``offload.expert_updates=deferred``, sync mode, the native host kernel."""
    opt = config.optimizer
    return (
        config.offload.expert_updates == "deferred"
        and opt.mode == "sync"
        and native.use_native(opt.host_kernel, opt.name, "cpu")
    )


class Deferred:
    """The bookkeeping of deferred updates (module docstring), kept by the loop's thread."""

    def __init__(self, stages=()):
        """``stages``: those whose pages may be deferred (the routed blocks)."""
        self.stages = frozenset(stages)
        self._lock = threading.Lock()
        self.updates: dict[str, int] = defaultdict(int)  # committed updates per stage
        # stage -> {page: the updates it has had}, for the pages behind
        self.behind: dict[str, dict[int, int]] = defaultdict(dict)
        # stage -> {update index: the scalars that update started from}
        self.inputs: dict[str, dict[int, list]] = defaultdict(dict)
        self._skip: dict[str, frozenset[int]] = {}  # this step's, from the runtime
        self._updated: dict[str, tuple[frozenset[int], list]] = {}  # the step's updates
        # pages the updates left alone, and pages caught up, since the last take
        self.deferred_pages = self.caught_up_pages = 0

    # -- the runtime's ----------------------------------------------------------------

    def defer(self, stage: str, pages: frozenset[int]) -> None:
        """This step leaves ``pages`` of ``stage`` (indices within it) alone: their
        gradient is zero in every micro-batch."""
        with self._lock:
            self._skip[stage] = frozenset(pages)

    # -- the loop's ------------------------------------------------------------------

    def skip_of(self, stage: str) -> frozenset[int]:
        with self._lock:
            return self._skip.get(stage, frozenset())

    def catch_up_groups(self, stage: str, pages=None) -> list[tuple[list[int], list]]:
        """The pages of ``stage`` behind (of ``pages``, or all), grouped by the updates
        they have had: ``(pages, the scalars of each update they missed)``."""
        behind = self.behind.get(stage, {})
        wanted = behind if pages is None else [p for p in pages if p in behind]
        by_done: dict[int, list[int]] = defaultdict(list)
        for p in sorted(wanted):
            by_done[behind[p]].append(p)
        inputs = self.inputs[stage]
        return [
            (group, [inputs[u] for u in range(done, self.updates[stage])])
            for done, group in sorted(by_done.items())
        ]

    def behind_among(self, stage: str, pages=None, keep=frozenset()) -> list[int]:
        """The pages of ``stage`` behind, of ``pages`` (None: all) but those in ``keep``
        (read by the runtime while the loop is idle: between steps, or in a forward)."""
        behind = self.behind.get(stage)
        if not behind:
            return []
        wanted = behind if pages is None else pages
        return sorted(p for p in wanted if p in behind and p not in keep)

    def updated(self, stage: str, skip: frozenset[int], scalars: list) -> None:
        """The step updated ``stage`` from ``scalars``, all its pages but ``skip`` (the
        pages behind among the others caught up first)."""
        self._updated[stage] = (skip, scalars)
        self.deferred_pages += len(skip)

    def caught_up(self, stage: str, pages) -> None:
        behind = self.behind.get(stage, {})
        for p in pages:
            self.caught_up_pages += behind.pop(p, None) is not None
        self._prune(stage)

    def take(self) -> dict[str, int]:
        """The counts since the last call (a step's metrics): pages left alone by the
        updates (a redo's too: each reads and writes the others), pages caught up on
        their own (read and written back: a forward's, a flush's; not those caught up in
        RAM by their stage's update), and pages behind now."""
        out = {
            "expert_pages_deferred": self.deferred_pages,
            "expert_pages_caught_up": self.caught_up_pages,
            "expert_pages_behind": sum(len(b) for b in self.behind.values()),
        }
        self.deferred_pages = self.caught_up_pages = 0
        return out

    def commit(self) -> None:
        """The step's updates are committed."""
        for stage, (skip, scalars) in self._updated.items():
            n = self.updates[stage]
            behind = self.behind[stage]
            for p in list(behind):
                if p not in skip:  # caught up and updated
                    del behind[p]
            for p in skip:
                behind.setdefault(p, n)
            if behind:
                self.inputs[stage][n] = scalars
            self.updates[stage] = n + 1
            self._prune(stage)
        self._updated.clear()

    def abort(self) -> None:
        """The step's updates are dropped (a redo may update again)."""
        self._updated.clear()

    def end_step(self) -> None:
        with self._lock:
            self._skip.clear()

    def reset(self) -> None:
        """The state was replaced (a restore): nothing is behind."""
        self.behind.clear()
        self.inputs.clear()
        self._updated.clear()
        self.end_step()

    def pending(self) -> dict[str, list[int]]:
        """Every stage's pages behind."""
        return {s: sorted(b) for s, b in self.behind.items() if b}

    def _prune(self, stage: str) -> None:
        """Forgets the scalars no page behind needs."""
        behind = self.behind.get(stage)
        oldest = min(behind.values()) if behind else self.updates[stage]
        inputs = self.inputs[stage]
        for u in [u for u in inputs if u < oldest]:
            del inputs[u]


class DeferredCatchUps:
    """The update loop's side of deferred updates: which pages of a stage its update
    leaves alone, the missed updates caught up in RAM by a stage's next update, and the
    pages caught up on their own (read, updated and written back as committed).
    ``deferred``: the bookkeeping; the other arguments are the loop's."""

    def __init__(self, deferred: Deferred, optimizer, states, *, layout_of, device_stages=()):
        self.deferred = deferred
        self.opt, self.states, self.layout_of = optimizer, states, layout_of
        self.device_stages = frozenset(device_stages)

    def defers(self, stage: str) -> bool:
        """Whether ``stage``'s pages may be deferred: a routed block streamed from NVMe
        through the native kernel."""
        if stage not in self.deferred.stages or stage in self.device_stages:
            return False
        return self.opt.native and self.states.links(stage)

    def skip_of(self, stage: str) -> frozenset[int]:
        """The pages of ``stage`` this step leaves behind: those the runtime deferred,
        where the stage's state streams from NVMe through the native kernel."""
        return self.deferred.skip_of(stage) if self.defers(stage) else frozenset()

    def in_update(self, stage: str, skip: frozenset[int], scalars: list) -> list:
        """A stage's update from ``scalars`` leaving ``skip`` alone: the pages behind
        among the others, caught up first in RAM (``SlabOptimizer.update``'s
        ``catch_up``), recorded as this step's update."""
        groups = self.deferred.catch_up_groups(stage)
        groups = [(p, inputs) for p, inputs in groups if not set(p) <= skip]
        groups = [([q for q in p if q not in skip], inputs) for p, inputs in groups]
        self.deferred.updated(stage, skip, scalars)
        return groups

    def apply(self, stage: str, pages) -> dict[int, np.ndarray]:
        """Applies the updates the deferred ``pages`` of ``stage`` missed (those behind;
        the others are current) and writes them back as committed; each page's new
        params (compute dtype), none when none was behind."""
        groups = self.deferred.catch_up_groups(stage, pages)
        wanted = sorted(p for group, _ in groups for p in group)
        if not wanted:
            return {}
        slabs = self.states.read_pages(stage, wanted)
        flat = {k: v.reshape(-1) for k, v in slabs.items()}
        at = {p: i for i, p in enumerate(wanted)}
        fresh = {}
        layout = self.layout_of(stage)
        for group, inputs in groups:
            params = self.opt.catch_up(layout, flat, group, [at[p] for p in group], inputs)
            fresh.update(zip(group, params, strict=True))
        self.states.write_pages(stage, wanted, slabs)
        self.deferred.caught_up(stage, wanted)
        return fresh

    def commit(self) -> None:
        self.deferred.commit()
        self.deferred.end_step()

    def abort(self) -> None:
        self.deferred.abort()

    def end_step(self) -> None:
        self.deferred.end_step()

    def reset(self) -> None:
        self.deferred.reset()
