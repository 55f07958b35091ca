"""Where fp32 master params and optimizer state live between updates.

Optimizer state (``offload.optimizer``): each stage's slabs by kind (``master``, ``mu``,
``nu``, ...; see ``optimizer/slab.py``) and its scalars.

* :class:`MemoryStateStore` keeps them as JAX arrays in one sharding: host RAM
  (``host``) or device memory (``device``).
* :class:`SplitStateStore` keeps the device-cached stages (``offload.
  optimizer_device_stages``) in a device :class:`MemoryStateStore` and the others in
  the ``host`` or ``nvme`` store, routing every call by stage.
* ``nvme_states.NvmeStateStore`` keeps them in TensorStore page arrays on disk
  (``nvme``), with a host RAM cache of the stages ``memory.host_budget`` allows.

Updates are *speculative* until committed: the loop may update a stage before the
global gradient norm is known (``optimizer/update_loop.py``), and if clipping then binds, or an
fp16 step overflows, the step's updates are thrown away. So a step never overwrites the
state it read: on disk there are two copies of every array, one holding the
committed state and one receiving the step's writes, and ``commit`` flips them; cached
stages keep their old slabs until ``commit``. A crash or a bad step leaves the committed
copy intact.

Where no written update can be dropped (``nvme_copies.py``) one copy is kept and
a step writes it in place (``copies=1``): half the files, the same bytes written.

Compute-dtype params follow the same pattern in ``params.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hetjax.storage.nvme import BaseCounters

MANIFEST = "manifest.json"


def copy_chunks(slab, out: np.ndarray) -> np.ndarray:
    """A kind's slab, given whole or as its list of chunks, copied into ``out`` (flat,
    its size); returns ``out``."""
    start = 0
    for chunk in slab if isinstance(slab, list) else [slab]:
        chunk = np.asarray(chunk).reshape(-1)
        out[start : start + chunk.size] = chunk
        start += chunk.size
    assert start == out.size, (start, out.size)
    return out


def flat(slab) -> np.ndarray:
    """A kind's slab, given whole or as its list of chunks, as one numpy array."""
    if isinstance(slab, list):
        return np.concatenate([np.asarray(c) for c in slab])
    return np.asarray(slab)


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
        self._spare: dict[str, dict] = {}  # dead copies, reused as output buffers
        self.read_bytes = self.write_bytes = 0
        self._bytes: dict[str, int] = {}  # committed slab bytes by stage
        self._pending_bytes: dict[str, int] = {}
        self._spare_bytes: dict[str, int] = {}
        self._held = 0  # their sum: one int, read from the runtime's thread
        self._frozen = Frozen()

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        self.slabs[stage] = jax.device_put(slabs, self.sharding)
        self.scalars[stage] = scalars
        self._bytes[stage] = _nbytes(self.slabs[stage])
        self._count()

    def wait_init(self) -> None:
        jax.block_until_ready(self.slabs)

    def prefetch(self, stage: str, skip: frozenset[int] = frozenset()) -> Any:
        return None  # (``skip``: never asked, see ``links``)

    def get(self, stage: str, handle: Any = None, skip: frozenset[int] = frozenset()) -> tuple:
        return self.slabs[stage], self.scalars[stage]

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        """Output buffers for a stage's next update (``SlabOptimizer.update``'s
        ``spare`` and ``in_place``): the copy its last commit or abort replaced.
        Speculative updates keep two copies of state anyway (the host plan counts
        them), so holding the dead one between steps costs no peak memory and saves
        the page faults of fresh buffers."""
        self._spare_bytes.pop(stage, None)  # counted again as pending by ``put``
        self._count()
        spare = self._spare.pop(stage, None)
        self._frozen.wait(stage, spare)
        return spare, False

    def put(
        self, stage: str, slabs: dict, scalars: list, skip: frozenset[int] = frozenset()
    ) -> None:
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

    def links(self, stage: str) -> bool:
        return False  # every page is updated every step (nothing to save in RAM)

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        """A stage's committed state as fresh host copies."""
        slabs = {k: np.array(flat(v)) for k, v in self.slabs[stage].items()}
        return slabs, [np.array(s) for s in self.scalars[stage]]

    def freeze(self, stage: str) -> tuple[Any, list, Callable[[], None]]:
        """A stage's committed slabs for a checkpoint to write from, unchanged until the
        returned release is called (:meth:`recycle` waits for that before handing them
        out as output buffers, the step after next), and its scalars."""
        slabs = self.slabs[stage]
        return slabs, [np.array(s) for s in self.scalars[stage]], self._frozen.add(stage, slabs)

    def flush(self) -> None:
        pass

    def host_bytes(self) -> int:
        if self.on_device:
            return 0
        return sum(a.nbytes for a in jax.tree.leaves((self.slabs, self._spare)))

    def device_bytes(self) -> int:
        """Device bytes held now: the committed slabs, a step's speculative ones and the
        dead copies kept for reuse (the ledger's count, kept as a sum: no walk over
        every chunk at each dispatch)."""
        return self._held if self.on_device else 0

    @property
    def nvme_bytes(self) -> int:
        return 0


def _nbytes(tree) -> int:  # on each device: a slab sharded over N devices 1/N of it
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in leaves)


class SplitStateStore(BaseCounters):
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

    def prefetch(self, stage: str, skip: frozenset[int] = frozenset()) -> Any:
        return self._of(stage).prefetch(stage, skip)

    def get(self, stage: str, handle: Any = None, skip: frozenset[int] = frozenset()) -> tuple:
        return self._of(stage).get(stage, handle, skip)

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        return self._of(stage).recycle(stage)

    def put(
        self, stage: str, slabs: dict, scalars: list, skip: frozenset[int] = frozenset()
    ) -> None:
        self._of(stage).put(stage, slabs, scalars, skip)

    def commit(self) -> None:
        self.device.commit()
        self.base.commit()

    def abort(self) -> None:
        self.device.abort()
        self.base.abort()

    def master(self, stage: str) -> np.ndarray:
        return self._of(stage).master(stage)

    def links(self, stage: str) -> bool:
        return stage not in self.stages and self.base.links(stage)

    def read_pages(self, stage: str, pages: list[int]) -> dict[str, np.ndarray]:
        return self.base.read_pages(stage, pages)

    def write_pages(self, stage: str, pages: list[int], slabs: dict[str, np.ndarray]) -> None:
        self.base.write_pages(stage, pages, slabs)

    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]:
        return self._of(stage).committed(stage)

    def freeze(self, stage: str) -> tuple[Any, list, Callable[[], None]]:
        return self._of(stage).freeze(stage)

    def flush(self) -> None:
        self.base.flush()

    def device_bytes(self) -> int:
        return self.device.device_bytes()


class Frozen:
    """State a checkpoint writes from, by stage: the slabs (or the copy) and an
    event set once written. Reusing frozen buffers waits for their event."""

    def __init__(self):
        self._entries: dict[str, tuple[Any, threading.Event]] = {}

    def add(self, stage: str, what: Any) -> Callable[[], None]:
        done = threading.Event()
        self._entries[stage] = (what, done)
        return done.set

    def wait(self, stage: str, what: Any) -> None:
        """Waits until ``what`` (slabs or a copy) of ``stage`` is released."""
        entry = self._entries.get(stage)
        same = entry is not None and (
            entry[0] is what or (isinstance(what, int) and entry[0] == what)
        )
        if same:
            entry[1].wait()
            if self._entries.get(stage) is entry:
                del self._entries[stage]
