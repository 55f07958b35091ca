"""Where optimizer state and compute-dtype params live between updates.

Optimizer state (``offload.optimizer``): each stage's slabs by kind (``master``, ``mu``,
``nu``, ...; see ``host_optimizer.py``) and its scalars.

* :class:`MemoryStateStore` keeps them as JAX arrays in one sharding: host RAM
  (``host``) or device memory (``device``).
* :class:`SplitStateStore` keeps the device-cached stages (``offload.
  optimizer_device_stages``) in a device :class:`MemoryStateStore` and the others in
  the ``host`` or ``nvme`` store, routing every call by stage.
* :class:`NvmeStateStore` keeps them in TensorStore page arrays on disk (``nvme``), with
  a host RAM cache for as many stages as ``memory.host_budget`` allows. The access
  order is known and cyclic (backward order, every step), so the cache is chosen by
  Belady's rule (evict the stage whose next use is furthest) simulated over that order
  at start-up (:func:`belady_cache`); the other stages stream from disk every step,
  with read-ahead and delayed write-back (writes complete while later stages update).

Updates are *speculative* until committed: the loop may update a stage before the
global gradient norm is known (``update_loop.py``), and if clipping then binds, or an
fp16 step overflows, the step's updates are thrown away. So a step never overwrites the
state it read: on disk there are two generations of every array, one holding the
committed state and one receiving the step's writes, and ``commit`` flips them; cached
stages keep their old slabs until ``commit``. A crash or a bad step leaves the committed
generation intact.

Compute-dtype params for the forward (``offload.params``) follow the same pattern:
:class:`HostParamStore` (``host``) and :class:`NvmeParamStore` (``nvme``, two
generations, read ahead by the executor's window); the device-cached stages' params
stay on the device (:class:`DeviceParamStore`, routed by :class:`SplitParamStore`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.config import ConfigError, format_bytes
from hetjax.gradients import GradientPlan, plan_gradients
from hetjax.nvme import PageStore, bound_writes

MANIFEST = "manifest.json"


def flat(slab) -> np.ndarray:
    """A kind's slab, given whole or as its list of chunks, as one numpy array."""
    if isinstance(slab, list):
        return np.concatenate([np.asarray(c) for c in slab])
    return np.asarray(slab)


def belady_cache(order: list[str], sizes: dict[str, int], capacity: int) -> list[str]:
    """The stages a cache of ``capacity`` bytes holds in steady state when ``order``
    repeats forever and eviction follows Belady's rule (furthest next use first;
    a stage whose own next use is the furthest is not cached at all). Simulated over
    two cycles: the second starts from the first one's end state."""
    n = len(order)
    trace = order * 2
    cache: set[str] = set()
    for t, stage in enumerate(trace):
        if stage in cache:
            continue
        cache.add(stage)
        while sum(sizes[s] for s in cache) > capacity:

            def next_use(s, t=t):
                for d in range(1, n + 1):
                    if trace[(t + d) % len(trace)] == s:
                        return d
                return n + 1

            cache.discard(max(cache, key=lambda s: (next_use(s), s == stage)))
    return [s for s in order if s in cache]


class MemoryStateStore:
    """All stages' optimizer state as JAX arrays in ``sharding`` (host RAM or device).
    ``on_device``: that is the accelerator's memory, not host RAM (the memory kind does
    not tell: the CPU backend, where a GPU machine's host optimizer lives, reports
    ``device`` too)."""

    def __init__(self, sharding: jax.sharding.Sharding, on_device: bool = False):
        self.sharding = sharding
        self.on_device = on_device
        self.slabs: dict[str, dict[str, jax.Array]] = {}
        self.scalars: dict[str, list] = {}
        self._pending: dict[str, tuple[dict, list]] = {}
        self._spare: dict[str, dict] = {}  # dead generations, reused as output buffers
        self.read_bytes = self.write_bytes = 0
        self._bytes: dict[str, int] = {}  # committed slab bytes by stage
        self._pending_bytes: dict[str, int] = {}
        self._spare_bytes: dict[str, int] = {}
        self._held = 0  # their sum: one int, read from the executor's thread

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        self.slabs[stage] = jax.device_put(slabs, self.sharding)
        self.scalars[stage] = scalars
        self._bytes[stage] = _nbytes(self.slabs[stage])
        self._count()

    def wait_init(self) -> None:
        jax.block_until_ready(self.slabs)

    def prefetch(self, stage: str) -> Any:
        return None

    def get(self, stage: str, handle: Any = None) -> tuple[dict, list]:
        return self.slabs[stage], self.scalars[stage]

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        """Output buffers for a stage's next update (``SlabOptimizer.update``'s
        ``spare`` and ``in_place``): the generation its last commit or abort replaced.
        Speculative updates keep two generations of state anyway (the host plan counts
        them), so holding the dead one between steps costs no peak memory and saves
        the page faults of fresh buffers."""
        self._spare_bytes.pop(stage, None)  # counted again as pending by ``put``
        self._count()
        return self._spare.pop(stage, None), False

    def put(self, stage: str, slabs: dict, scalars: list) -> None:
        self._pending[stage] = (slabs, scalars)
        self._pending_bytes[stage] = _nbytes(slabs)
        self._count()

    def commit(self) -> None:
        for stage, (slabs, scalars) in self._pending.items():
            self._spare[stage] = self.slabs[stage]
            self._spare_bytes[stage] = self._bytes[stage]
            self.slabs[stage], self.scalars[stage] = slabs, scalars
        self._bytes.update(self._pending_bytes)
        self._pending.clear()
        self._pending_bytes.clear()
        self._count()

    def abort(self) -> None:
        for stage, (slabs, _) in self._pending.items():
            self._spare[stage] = slabs
            self._spare_bytes[stage] = self._pending_bytes[stage]
        self._pending.clear()
        self._pending_bytes.clear()
        self._count()

    def _count(self) -> None:
        held = (self._bytes, self._pending_bytes, self._spare_bytes)
        self._held = sum(sum(d.values()) for d in held)

    def master(self, stage: str) -> np.ndarray:
        return flat(self.slabs[stage]["master"])

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        """A stage's committed state as fresh host copies (for a checkpoint)."""
        slabs = {k: np.array(flat(v)) for k, v in self.slabs[stage].items()}
        return slabs, [np.array(s) for s in self.scalars[stage]]

    def flush(self) -> None:
        pass

    def host_bytes(self) -> int:
        if self.on_device:
            return 0
        return sum(a.nbytes for a in jax.tree.leaves((self.slabs, self._spare)))

    def device_bytes(self) -> int:
        """Device bytes held now: the committed slabs, a step's speculative ones and the
        dead generations kept for reuse (the ledger's count, kept as a sum: no walk over
        every chunk at each dispatch)."""
        return self._held if self.on_device else 0

    @property
    def nvme_bytes(self) -> int:
        return 0


def _nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


class NvmeStateStore:
    """Optimizer state in TensorStore arrays under ``path``, two generations, with a
    host cache of the stages in ``cached``."""

    def __init__(
        self,
        path: Path,
        kinds: list[str],
        stage_pages: dict[str, tuple[int, int]],
        page_elems: int,
        cached: list[str],
        sharding: jax.sharding.Sharding,
    ):
        self.path = Path(path)
        self.kinds = kinds
        self.stage_pages = stage_pages  # stage -> (first page, number of pages)
        self.page_elems = page_elems
        self.cached = set(cached)
        self.sharding = sharding  # where cached slabs live (host RAM)
        num_pages = sum(n for _, n in stage_pages.values())
        self.disk = [PageStore(self.path / f"gen{g}", kinds, num_pages, page_elems) for g in (0, 1)]
        self.gen = 0  # the generation holding the committed state
        self.cache: dict[str, dict[str, jax.Array]] = {}
        self.scalars: dict[str, list] = {}
        self._pending_cache: dict[str, dict] = {}
        self._pending_scalars: dict[str, list] = {}
        self._spare: dict[str, dict] = {}  # cached stages' dead generations (recycle)
        self._writes: list = []  # (future, data kept alive until the write completes)
        # stage -> its write futures into the committed generation that a commit did not
        # wait for (the step's tail: see ``commit``); a read of the stage waits for them
        self._landing: dict[str, list] = {}
        self._by_stage: dict[str, list] = {}  # the step's writes, by stage
        self._manifest_due = False
        # Write-back in flight: the biggest stage's state, as the host plan counts it.
        self._write_window = max(n for _, n in stage_pages.values()) * page_elems * 4 * len(kinds)
        self.read_bytes = self.write_bytes = 0
        self._write_manifest()

    # -- start-up -----------------------------------------------------------------------

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        self.scalars[stage] = scalars
        if stage in self.cached:
            self.cache[stage] = jax.device_put(slabs, self.sharding)
        else:
            self._wait_writes()  # one stage in flight: start-up RAM stays bounded
            self._write(self.gen, stage, slabs)

    def wait_init(self) -> None:
        self._wait_writes()

    # -- the loop's API -----------------------------------------------------------------

    def prefetch(self, stage: str) -> Any:
        """Starts reading a streamed stage's slabs; None for cached stages."""
        if stage in self.cached:
            return None
        self._land(stage)
        first, n = self.stage_pages[stage]
        return {k: self.disk[self.gen].read(k, first, n) for k in self.kinds}

    def get(self, stage: str, handle: Any = None) -> tuple[dict, list]:
        """A stage's committed state (waits for its read)."""
        if stage in self.cached:
            return self.cache[stage], self.scalars[stage]
        handle = handle if handle is not None else self.prefetch(stage)
        slabs = {k: f.result().reshape(-1) for k, f in handle.items()}
        self.read_bytes += sum(a.nbytes for a in slabs.values())
        return slabs, self.scalars[stage]

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        """Output buffers for a stage's next update (see ``MemoryStateStore``): a cached
        stage's dead generation; a streamed stage's own fresh read (updated in place)."""
        if stage in self.cached:
            return self._spare.pop(stage, None), False
        return None, True

    def put(self, stage: str, slabs: dict, scalars: list) -> None:
        """A stage's updated state: kept in the cache, or written (asynchronously) to
        the generation that ``commit`` will make current."""
        self._pending_scalars[stage] = scalars
        if stage in self.cached:
            self._pending_cache[stage] = slabs
        else:
            self._write(1 - self.gen, stage, slabs, stage)

    def commit(self) -> None:
        """Makes the step's state current. Does not wait for the write-back still in
        flight (the last stages the step updated): the next step's forward needs none
        of it, so the writes land while it runs, and a later read of such a stage
        waits for its own writes first. The manifest follows once they have landed."""
        self._land_all()  # the previous step's tail: long done (its stages were read)
        self._landing = {stage: [f for f, _ in writes] for stage, writes in self._by_stage.items()}
        self._by_stage = {}
        self._writes = [(f, d) for f, d in self._writes if not f.done()]
        for stage in self._pending_cache:
            self._spare[stage] = self.cache[stage]
        self.cache.update(self._pending_cache)
        self.scalars.update(self._pending_scalars)
        self._pending_cache.clear()
        self._pending_scalars.clear()
        self.gen = 1 - self.gen
        self._manifest_due = True
        if not self._writes:
            self._land_all()

    def abort(self) -> None:
        self._wait_writes()  # into the uncommitted generation; then forgotten
        self._spare.update(self._pending_cache)
        self._pending_cache.clear()
        self._pending_scalars.clear()

    # -- inspection and durability -------------------------------------------------------

    def master(self, stage: str) -> np.ndarray:
        """A stage's committed fp32 master slab (only that kind is read from disk)."""
        if stage in self.cached:
            return flat(self.cache[stage]["master"])
        self._land(stage)
        first, n = self.stage_pages[stage]
        return self.disk[self.gen].read("master", first, n).result().reshape(-1)

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        """A stage's committed state as fresh host copies (for a checkpoint)."""
        if stage in self.cached:
            slabs = {k: np.array(flat(v)) for k, v in self.cache[stage].items()}
        else:
            self._land(stage)
            first, n = self.stage_pages[stage]
            reads = {k: self.disk[self.gen].read(k, first, n) for k in self.kinds}
            slabs = {k: f.result().reshape(-1) for k, f in reads.items()}
        return slabs, [np.array(s) for s in self.scalars[stage]]

    def flush(self) -> None:
        """Writes the cached stages into the committed generation too, so the files
        alone hold the whole state (``manifest.json`` says which generation)."""
        for stage, slabs in self.cache.items():
            self._write(self.gen, stage, slabs)
        self._wait_writes()
        self._write_manifest()

    def host_bytes(self) -> int:
        live = [self.cache, self._pending_cache, self._spare, [d for _, d in self._writes]]
        return sum(a.nbytes for a in jax.tree.leaves(live))

    def device_bytes(self) -> int:
        return 0

    @property
    def nvme_bytes(self) -> int:
        return sum(d.nbytes for d in self.disk)

    # -- internals ----------------------------------------------------------------------

    def _write(self, gen: int, stage: str, slabs: dict, speculative: str = "") -> None:
        """Starts writing a stage's slabs (whole, or chunk by chunk as they come);
        ``speculative``: the stage, when these are a step's writes that commit may
        leave in flight."""
        first, _ = self.stage_pages[stage]
        for k in self.kinds:
            page = first
            for chunk in slabs[k] if isinstance(slabs[k], list) else [slabs[k]]:
                data = np.asarray(chunk)  # waits for this chunk's update only
                future = self.disk[gen].write(k, page, data)
                self._writes.append((future, data))
                if speculative:
                    self._by_stage.setdefault(speculative, []).append((future, data))
                self.write_bytes += data.nbytes
                page += data.size // self.page_elems
                bound_writes(self._writes, self._write_window)

    def _land(self, stage: str) -> None:
        """Waits for the writes of ``stage`` the last commit left in flight."""
        for future in self._landing.pop(stage, []):
            future.result()

    def _land_all(self) -> None:
        for stage in list(self._landing):
            self._land(stage)
        if self._manifest_due:
            self._manifest_due = False
            self._write_manifest()

    def _wait_writes(self) -> None:
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self._by_stage = {}
        self._land_all()

    def _write_manifest(self) -> None:
        manifest = {
            "generation": self.gen,
            "kinds": self.kinds,
            "page_elems": self.page_elems,
            "stages": {s: list(r) for s, r in self.stage_pages.items()},
            "note": "state of stage s, kind k: gen{generation}/k pages [first, first + n)",
        }
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.path / MANIFEST)


class HostParamStore:
    """Compute-dtype param pages of every stage in the host memory kind."""

    def __init__(self, sharding: jax.sharding.Sharding):
        self.sharding = sharding
        self.pages: dict[str, list[jax.Array]] = {}

    def publish(self, stage: str, pages: list) -> None:
        self.pages[stage] = jax.device_put(pages, self.sharding)

    def prefetch(self, stage: str) -> None:
        pass

    def get(self, stage: str) -> list:
        return self.pages[stage]

    def commit(self) -> None:
        pass

    def abort(self) -> bool:
        """Returns True: pages are published in place, so dropping a step's updates
        needs them republished from the committed masters."""
        return True

    def host_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.pages))

    nvme_bytes = 0


class DeviceParamStore(HostParamStore):
    """Compute-dtype param pages of the device-cached stages, in device memory: their
    update runs there and publishes in place; the executor reads them as resident
    stages without a copy."""

    def host_bytes(self) -> int:
        return 0


class SplitStateStore:
    """Optimizer state of the device-cached stages (``stages``) in ``device`` (a
    :class:`MemoryStateStore` on the device), of the others in ``base`` (host RAM or
    NVMe); every call goes to the store holding its stage."""

    def __init__(self, device: MemoryStateStore, base, stages):
        self.device, self.base, self.stages = device, base, frozenset(stages)

    def _of(self, stage: str):
        return self.device if stage in self.stages else self.base

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        self._of(stage).init_stage(stage, slabs, scalars)

    def wait_init(self) -> None:
        self.device.wait_init()
        self.base.wait_init()

    def prefetch(self, stage: str) -> Any:
        return self._of(stage).prefetch(stage)

    def get(self, stage: str, handle: Any = None) -> tuple[dict, list]:
        return self._of(stage).get(stage, handle)

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        return self._of(stage).recycle(stage)

    def put(self, stage: str, slabs: dict, scalars: list) -> None:
        self._of(stage).put(stage, slabs, scalars)

    def commit(self) -> None:
        self.device.commit()
        self.base.commit()

    def abort(self) -> None:
        self.device.abort()
        self.base.abort()

    def master(self, stage: str) -> np.ndarray:
        return self._of(stage).master(stage)

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        return self._of(stage).committed(stage)

    def flush(self) -> None:
        self.base.flush()

    def host_bytes(self) -> int:
        return self.base.host_bytes()

    def device_bytes(self) -> int:
        return self.device.device_bytes()

    @property
    def nvme_bytes(self) -> int:
        return self.base.nvme_bytes

    @property
    def read_bytes(self) -> int:
        return self.base.read_bytes

    @property
    def write_bytes(self) -> int:
        return self.base.write_bytes


class SplitParamStore:
    """Compute-dtype params of the device-cached stages in ``device`` (a
    :class:`DeviceParamStore`), of the others in ``base`` (host RAM or NVMe)."""

    def __init__(self, device: DeviceParamStore, base, stages):
        self.device, self.base, self.stages = device, base, frozenset(stages)

    def _of(self, stage: str):
        return self.device if stage in self.stages else self.base

    def publish(self, stage: str, pages: list) -> None:
        self._of(stage).publish(stage, pages)

    def prefetch(self, stage: str) -> None:
        self._of(stage).prefetch(stage)

    def get(self, stage: str) -> list:
        return self._of(stage).get(stage)

    def commit(self) -> None:
        self.device.commit()
        self.base.commit()

    def abort(self) -> bool:
        """True: the device pages are published in place, so a dropped step's updates
        need them republished (the loop republishes every stage; for ``base`` on NVMe
        that rewrites the uncommitted generation, which the next step overwrites)."""
        self.base.abort()
        return self.device.abort()

    def device_arrays(self) -> list:
        return list(self.device.pages.values())

    def host_bytes(self) -> int:
        return self.base.host_bytes()

    @property
    def nvme_bytes(self) -> int:
        return self.base.nvme_bytes

    @property
    def read_bytes(self) -> int:
        return getattr(self.base, "read_bytes", 0)

    @property
    def write_bytes(self) -> int:
        return getattr(self.base, "write_bytes", 0)


class NvmeParamStore:
    """Compute-dtype param pages on disk (two generations, like the state), read ahead
    for the forward and backward by the executor's window."""

    def __init__(
        self,
        path: Path,
        dtype: Any,
        stage_pages: dict[str, tuple[int, int]],
        page_elems: int,
    ):
        self.stage_pages = stage_pages
        num_pages = sum(n for _, n in stage_pages.values())
        kinds = {"params": np.dtype(dtype).name}
        self.disk = [
            PageStore(Path(path) / f"gen{g}", kinds, num_pages, page_elems) for g in (0, 1)
        ]
        self.gen = 0
        self._target = 0  # the generation publish writes into (the first commit keeps 0)
        self._writes: list = []
        self._write_window = max(n for _, n in stage_pages.values()) * page_elems * 4
        self._reads: dict[str, Any] = {}
        self._published: dict[str, tuple] = {}  # stage -> (future, data): this step's
        # stage -> (future, data): writes into the committed generation a commit left in
        # flight; ``get`` serves these stages from that data, no read needed
        self._landing: dict[str, tuple] = {}
        self.read_bytes = self.write_bytes = 0

    def publish(self, stage: str, pages: list) -> None:
        data = np.concatenate([np.asarray(p) for p in pages])
        first, _ = self.stage_pages[stage]
        future = self.disk[self._target].write("params", first, data)
        self._writes.append((future, data))
        self._published[stage] = (future, data)
        self.write_bytes += data.nbytes
        bound_writes(self._writes, self._write_window)

    def prefetch(self, stage: str) -> None:
        if stage not in self._reads and stage not in self._landing:
            first, n = self.stage_pages[stage]
            self._reads[stage] = self.disk[self.gen].read("params", first, n)

    def get(self, stage: str) -> list:
        if stage in self._landing:  # written last step, maybe still in flight: in RAM
            self._reads.pop(stage, None)  # one issued before the commit: stale
            data = self._landing[stage][1]
            return list(data.reshape(-1, self.disk[0].page_elems))
        self.prefetch(stage)
        pages = self._reads.pop(stage).result()
        self.read_bytes += pages.nbytes
        return list(pages)

    def commit(self) -> None:
        """Makes the step's params current without waiting for the writes still in
        flight (the stages updated last, which the next forward needs first): those
        stages are served from the written data until the next commit."""
        self._land()  # the previous step's: long done
        self._landing = {s: w for s, w in self._published.items() if not w[0].done()}
        self._published = {}
        self._writes = [(f, d) for f, d in self._writes if not f.done()]
        if self._target != self.gen:
            self.gen = self._target
        self._target = 1 - self.gen
        # Reads still in flight were of the old generation: a consistent snapshot, one
        # update old (sync mode has none outstanding at a commit).

    def abort(self) -> bool:
        """Drops the step's writes: the generation stays; the next publish overwrites
        them. Returns False: the committed generation was never touched."""
        self.wait()
        return False

    def wait(self) -> None:
        for future, _ in self._writes:
            future.result()
        self._writes.clear()
        self._published = {}
        self._land()

    def _land(self) -> None:
        for future, _ in self._landing.values():
            future.result()
        self._landing = {}

    def host_bytes(self) -> int:
        held = {id(d): d.nbytes for _, d in [*self._writes, *self._landing.values()]}
        return sum(held.values())

    @property
    def nvme_bytes(self) -> int:
        return sum(d.nbytes for d in self.disk)


# -- the host RAM plan --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    """What the streaming runtime holds in host RAM, in bytes, and the state cache."""

    budget: int  # 0: no limit
    param_slabs: int  # compute-dtype params (all stages, or the NVMe read-ahead window)
    gradients: int  # gradient buffers in RAM (``grads`` says which, and what spills)
    optimizer_state: int  # state kept in RAM (offload.optimizer=host), x2 while speculative
    optimizer_io: int  # NVMe read-ahead, the stage updating and its write-back
    cache: int  # NVMe state cached in RAM
    cached_stages: tuple[str, ...]
    required: int  # the total
    grads: GradientPlan
    checkpoints: int = 0  # activation checkpoints (host) or their NVMe staging (nvme)

    def describe(self) -> str:
        parts = [f"param slabs {format_bytes(self.param_slabs)}", self.grads.describe()]
        if self.optimizer_state:
            parts.append(f"optimizer state {format_bytes(self.optimizer_state)}")
        if self.checkpoints:
            parts.append(f"activation checkpoints {format_bytes(self.checkpoints)}")
        if self.optimizer_io:
            parts.append(f"optimizer I/O buffers {format_bytes(self.optimizer_io)}")
            parts.append(
                f"state cache {format_bytes(self.cache)} ({len(self.cached_stages)} stages)"
            )
        limit = f" of budget {format_bytes(self.budget)}" if self.budget else " (no budget)"
        return f"host plan: {', '.join(parts)}; total {format_bytes(self.required)}{limit}"


def plan_host_memory(
    budget: int,
    tier: str,
    param_slabs: int,
    grad_sizes: dict[str, int],
    grad_policy: str,
    stage_state: dict[str, int],
    order: list[str],
    readahead: int,
    spill_grads: bool = False,
    checkpoints: int = 0,
    activations: str = "device",
) -> HostMemoryPlan:
    """Plans host RAM for optimizer tier ``tier`` (device | host | nvme) of the stages
    in ``stage_state`` (state bytes by stage; ``order``: those stages in backward order;
    device-cached stages are neither). Speculative
    updates keep a stage's old and new state until the step commits, so state held in
    RAM counts twice. ``checkpoints``: host bytes of activation checkpoints in tier
    ``activations`` (all of a micro-batch's on ``host``, the staging on ``nvme``).
    Gradient buffers (slab bytes ``grad_sizes`` by stage reaching the host, in backward
    order; policy ``grad_policy``,
    ``spill_grads``: kept ones may go to NVMe) get the RAM they need next, bounded when
    all of them do not fit (``gradients.plan_gradients``). With ``nvme`` the RAM left
    after that caches whole stages of state, chosen by
    :func:`belady_cache`; no budget means no cache. Raises ``ConfigError`` naming the
    shortfall when the minimum does not fit."""
    state = 2 * sum(stage_state.values()) if tier == "host" else 0
    biggest = max(stage_state.values(), default=0)
    io = (readahead + 2) * biggest if tier == "nvme" else 0
    others = param_slabs + state + io + checkpoints
    grads = plan_gradients(
        grad_sizes, list(grad_sizes), grad_policy, budget - others if budget else None, spill_grads
    )
    required = others + grads.ram_bytes
    if budget and required > budget:
        hints = {
            "host": "set offload.optimizer=nvme",
            "nvme": "set offload.params=nvme" if param_slabs > io else "lower memory.page_size",
            "device": "set offload.optimizer=nvme",
        }
        hint = hints[tier]
        if grad_policy == "keep" and not grads.bounded and not spill_grads:
            hint += " (gradients kept for clipping then spill to NVMe) or optimizer.grad_clip=0"
        if activations == "host" and checkpoints >= max(param_slabs, io, state):
            hint = "set offload.activations=nvme"
        raise ConfigError(
            f"memory.host_budget {format_bytes(budget)} is too small for the minimum host "
            f"working set {format_bytes(required)} (param slabs {format_bytes(param_slabs)}, "
            f"gradient buffers {format_bytes(grads.ram_bytes)}"
            + (f", optimizer state {format_bytes(state)}" if state else "")
            + (f", optimizer I/O buffers {format_bytes(io)}" if io else "")
            + (f", activation checkpoints {format_bytes(checkpoints)}" if checkpoints else "")
            + f"); host is short by {format_bytes(required - budget)}. Raise "
            f"memory.host_budget or {hint}"
        )
    cached: list[str] = []
    cache = 0
    if tier == "nvme" and budget:
        sizes = {s: 2 * n for s, n in stage_state.items()}
        cached = belady_cache(order, sizes, budget - required)
        cache = sum(sizes[s] for s in cached)
    return HostMemoryPlan(
        budget,
        param_slabs,
        grads.ram_bytes,
        state,
        io,
        cache,
        tuple(cached),
        required + cache,
        grads,
        checkpoints,
    )
