"""Block-boundary activations (*boundaries*) swapped to NVMe
(``offload.activations=nvme``).

Fuyou's SSD-CPU-GPU activation swap, at block granularity: when host RAM cannot hold a
micro-batch's boundaries, they go through it to disk. The streaming runtime
(``runtime/streaming.py``) hands over each boundary as its copy to host RAM is
dispatched; a worker thread waits for the copy to land and writes it to one row of a
TensorStore array (zarr3 over the ``file`` kvstore, ``nvme.PageStore``), shape ``(slots,
B*T*D)`` in the compute dtype, one chunk per page. Backward takes the boundaries back in
reverse order, and each ``get`` starts the reads of the next ``depth`` ones, so a read
overlaps the backward of the blocks before it.

Host RAM is bounded by :func:`hetjax.memory_host.swap_staging_bytes`: forward waits for the
oldest write while ``depth`` boundaries are in flight or held, and backward holds the
boundary it takes plus ``depth`` read ahead. The last ``depth`` boundaries of a forward
(slots ``slots - depth`` and up) are never written: they stay in RAM and backward, which
needs them first, takes them from there. The rows are reused by every micro-batch: a
forward first waits for the previous one's writes.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.storage.nvme import PageStore
from hetjax.storage.stripes import Stripes

KIND = "boundaries"


def index_key(index: tuple[slice, ...]) -> tuple:
    """A shard's index (a tuple of slices) as a hashable key."""
    return tuple((s.start, s.stop, s.step) for s in index)


def distinct_devices(sharding, shape: tuple[int, ...]) -> list:
    """This process's devices of ``sharding`` that hold a distinct part of an array of
    ``shape``, in device order: of the devices holding the same part (tensor
    parallelism's model axis: a model group's devices hold the same rows) the first."""
    seen, devices = set(), []
    indices = sharding.addressable_devices_indices_map(shape)
    for d in sorted(indices, key=lambda d: d.id):
        key = index_key(indices[d])
        if key not in seen:
            seen.add(key)
            devices.append(d)
    return devices


def host_pieces(host) -> list[np.ndarray]:
    """A host copy as this process's numpy pieces (waits for the copy to land): a numpy
    array itself; a JAX array its addressable shards in device order (one device: the
    whole array; ZeRO-3 over a mesh: this process's rows, or its devices' stacked
    values, never another process's, which ``np.asarray`` of the whole would need),
    each distinct part once (:func:`distinct_devices`: written once per model group)."""
    if isinstance(host, np.ndarray):
        return [host]
    shards = {s.device: s for s in host.addressable_shards}
    return [np.asarray(shards[d].data) for d in distinct_devices(host.sharding, host.shape)]


def _to_host(host) -> np.ndarray:
    """A boundary's host copy as one numpy row of this process's rows (waits for the
    copy to land; the rows of its devices, in order, as ``put_batch`` takes them)."""
    pieces = host_pieces(host)
    return (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)).reshape(1, -1)


class BoundarySwap:
    """One micro-batch's block-boundary boundaries (``slots`` of them, each of
    ``shape`` and ``dtype``) on disk under ``path``, with write-behind and read-ahead
    ``depth``."""

    def __init__(
        self,
        path: Path,
        slots: int,
        shape: tuple[int, ...],
        dtype,
        *,
        chunk_elems: int,
        depth: int,
        stage_to=None,
        stripes: Stripes | None = None,
    ):
        """``stage_to``: the device's ``pinned_host`` memory, where boundaries read from
        disk are copied on a worker thread (``Shardings.pinned_staging``; None: numpy).
        ``stripes``: the drives the rows stripe over, row ``s`` on drive ``s % n``
        (``stripes.py``): backward's read-ahead and forward's write-behind then keep
        consecutive slots on different drives at once."""
        self.shape, self.depth, self.slots = tuple(shape), max(depth, 1), slots
        self.stage_to = stage_to
        elems = math.prod(self.shape)
        self.boundary_bytes = elems * np.dtype(dtype).itemsize
        self.disk = PageStore(
            path,
            {KIND: np.dtype(dtype).name},
            num_pages=slots,
            page_elems=elems,
            chunk_elems=min(chunk_elems, elems),
            label="activations",
            stripes=stripes,
        )
        self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="hetjax-boundaries")
        # slot -> future of its data (host numpy), resolved when the write is complete
        self._writes: collections.OrderedDict[int, Future] = collections.OrderedDict()
        self._held: dict[int, Any] = {}  # the last slots: kept in RAM, never written
        self._reads: dict[int, tuple[Any, bool]] = {}  # slot -> (future, read from disk)
        self.read_bytes = self.write_bytes = 0
        self.peak_host_bytes = 0  # since the last reset_peak

    # -- forward ------------------------------------------------------------------------

    def begin(self) -> None:
        """Before a micro-batch's forward: the rows are free to overwrite."""
        self.wait()

    def put(self, slot: int, host) -> None:
        """Swaps out boundary ``slot``: ``host`` is its copy to host RAM, dispatched (a
        JAX array). Waits for the oldest write while ``depth`` are in flight or held.
        One of the last ``depth`` slots is only held (backward takes it first)."""
        while self._writes and len(self._writes) + len(self._held) >= self.depth:
            self._writes.popitem(last=False)[1].result()
        if slot >= self.slots - self.depth:
            self._held[slot] = host
        else:
            self._writes[slot] = self._pool.submit(self._write, slot, host)
            self.write_bytes += self.boundary_bytes
        self._note_peak()

    def _pack(self, host) -> np.ndarray:
        """What is swapped out, as the row written (waits for the copy to land)."""
        return _to_host(host)

    def _unpack(self, data):
        """A row read back (numpy), as ``get`` returns it; staged data is already."""
        return data.reshape(self.shape) if isinstance(data, np.ndarray) else data

    def _write(self, slot: int, host):  # on a worker thread
        data = self._pack(host)
        self.disk.write(KIND, slot, data).result()
        # what a get of the slot before its read from disk takes: with ``stage_to`` the
        # host copy itself (pinned already), else the row written
        return host if self.stage_to is not None else data

    # -- backward -----------------------------------------------------------------------

    def get(self, slot: int):
        """Checkpoint ``slot`` (host numpy of ``shape``, or pinned with ``stage_to``,
        whether read from disk or kept in RAM), waiting for it; starts reading
        slots ``slot - 1 .. slot - depth``, which backward needs next."""
        for k in range(slot, max(slot - self.depth, 0) - 1, -1):
            self._prefetch(k)
        self._note_peak()
        future, from_disk = self._reads.pop(slot)
        data = future.result()
        if from_disk:
            self.read_bytes += self.boundary_bytes
        return self._unpack(data)

    def _prefetch(self, slot: int) -> None:
        if slot in self._reads:
            return
        if slot in self._held:  # never written
            self._reads[slot] = (self._pool.submit(self._in_ram, self._held.pop(slot)), False)
        elif slot in self._writes:  # still in RAM: taken from there once written
            self._reads[slot] = (self._writes.pop(slot), False)
        elif self.stage_to is not None:
            self._reads[slot] = (self._pool.submit(self._staged_read, slot), True)
        else:
            self._reads[slot] = (self.disk.read(KIND, slot, 1), True)

    def _in_ram(self, host):
        """A slot never written, as ``get`` returns it: with ``stage_to`` its host copy
        (a ``pinned_host`` array, or a list of them: the device takes it from pinned
        memory, not through a numpy view), else numpy."""
        return jax.block_until_ready(host) if self.stage_to is not None else self._pack(host)

    def _staged_read(self, slot: int):  # on a worker thread
        data = self._unpack(self.disk.read(KIND, slot, 1).result())
        return jax.block_until_ready(jax.device_put(data, self.stage_to))

    # -- accounting and shutdown ----------------------------------------------------------

    def host_bytes(self) -> int:
        """Host RAM held now: boundaries waiting for their write or read ahead."""
        return (len(self._writes) + len(self._held) + len(self._reads)) * self.boundary_bytes

    def _note_peak(self) -> None:
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes())

    def reset_peak(self) -> None:
        self.peak_host_bytes = self.host_bytes()

    @property
    def nvme_bytes(self) -> int:
        return self.disk.nbytes

    def wait(self) -> None:
        """Completes every write and read in flight (raising a failed one's error)."""
        pending = [*self._writes.values(), *(f for f, _ in self._reads.values())]
        self._writes.clear()
        self._reads.clear()
        self._held.clear()
        for future in pending:
            future.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


class ResidualSwap(BoundarySwap):
    """The swapped blocks' in-block activations on NVMe (``offload.swap_tier=nvme``):
    one row per swapped block, its residuals (arrays of several shapes and dtypes, on
    their way from ``pinned_host``) packed as ``nbytes`` bytes, with the boundaries'
    write-behind and read-ahead (``get`` returns this process's shards of the arrays,
    flat, in the order ``host_pieces`` took them: numpy views of the row read, or pinned
    copies with ``stage_to``; one device: the arrays themselves)."""

    def __init__(self, path: Path, slots: int, nbytes: int, *, chunk_bytes: int, depth: int,
                 stage_to=None, stripes: Stripes | None = None):  # fmt: skip
        super().__init__(
            path, slots, (nbytes,), np.uint8, chunk_elems=chunk_bytes, depth=depth,
            stage_to=stage_to, stripes=stripes,
        )  # fmt: skip
        self._layout: list[tuple[tuple[int, ...], np.dtype]] | None = None

    def _pack(self, host) -> np.ndarray:
        # each residual as this process's shards (one on one device): get returns them
        # so, flat, and the runtime puts each back on its device (SwappedResiduals)
        arrays = [piece for a in host for piece in host_pieces(a)]
        if self._layout is None:
            self._layout = [(a.shape, a.dtype) for a in arrays]
        row = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
        if row.size != self.boundary_bytes:
            raise ValueError(
                f"residuals of {row.size} bytes, the swap's rows hold {self.boundary_bytes}"
            )
        return row.reshape(1, -1)

    def _unpack(self, data):
        if not isinstance(data, np.ndarray):
            return data
        row, arrays, start = data.reshape(-1), [], 0
        for shape, dtype in self._layout:
            end = start + math.prod(shape) * dtype.itemsize
            arrays.append(row[start:end].view(dtype).reshape(shape))
            start = end
        return arrays
