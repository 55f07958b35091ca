"""Where each kind of state lives: the one module that maps state to memory.

Layer and model code never place arrays; the runtimes ask this module for shardings.

* ``device``: the accelerator's own memory (HBM): the streaming window, activations.
* ``host``: the ``pinned_host`` memory kind of the same device: param slabs and
  activation checkpoints waiting to be copied in; transfers are plain ``device_put``.
* ``optimizer``: where the host optimizer keeps and updates fp32 master state. On a
  GPU/TPU this is the CPU backend (host RAM, computed on by the CPU). On a CPU-only
  machine the CPU *is* the device, so it is the ``pinned_host`` kind of that device:
  XLA computes on host-kind operands there, and the device kind stays the streaming
  budget's alone, as it would on an accelerator.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


@dataclasses.dataclass(frozen=True)
class Placement:
    device: SingleDeviceSharding
    host: SingleDeviceSharding
    optimizer: SingleDeviceSharding

    @classmethod
    def single_device(cls, device: jax.Device | None = None) -> Placement:
        device = device or jax.devices()[0]
        host = SingleDeviceSharding(device, memory_kind="pinned_host")
        if device.platform == "cpu":
            optimizer = host
        else:
            optimizer = SingleDeviceSharding(jax.devices("cpu")[0])
        return cls(SingleDeviceSharding(device, memory_kind="device"), host, optimizer)


def live_bytes_by_kind() -> dict[str, int]:
    """Bytes of every live JAX array, grouped by memory kind (``device``,
    ``pinned_host``, ...): what the ledger is checked against."""
    totals: dict[str, int] = defaultdict(int)
    for a in jax.live_arrays():
        if a.is_deleted():
            continue
        totals[a.sharding.memory_kind or "device"] += a.nbytes
    return dict(totals)


@dataclasses.dataclass(frozen=True)
class ShardedPlacement:
    """ZeRO-3 (``zero.py``): a stage's slab is a ``(pages, page_elems)`` array whose
    pages are split evenly over the ``data`` axis of ``mesh``; the batch is split over
    the same axis. Storage layout (sharded) and compute layout (gathered) are separate
    shardings."""

    mesh: Mesh
    slab_host: NamedSharding  # each device's pages, in its host memory
    slab_device: NamedSharding  # the same shards copied to device memory
    gathered: NamedSharding  # replicated on every device: the all-gathered pages
    grad: NamedSharding  # gradient pages reduce-scattered back to their owners
    batch: NamedSharding  # rows of the batch over the data axis

    @classmethod
    def over(cls, mesh: Mesh, axis: str = "data") -> ShardedPlacement:
        pages = PartitionSpec(axis, None)
        return cls(
            mesh,
            NamedSharding(mesh, pages, memory_kind="pinned_host"),
            NamedSharding(mesh, pages, memory_kind="device"),
            NamedSharding(mesh, PartitionSpec(), memory_kind="device"),
            NamedSharding(mesh, pages, memory_kind="device"),
            NamedSharding(mesh, PartitionSpec(axis), memory_kind="device"),
        )
