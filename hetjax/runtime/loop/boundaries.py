"""A micro-batch's block-boundary activations (*boundaries*: each block's input, kept
from forward for the block's recompute in backward), where ``offload.activations``
puts them: on the device, in host RAM, or swapped through host RAM to NVMe
(:class:`~hetjax.storage.swap.BoundarySwap`)."""

from __future__ import annotations

from typing import Any

import jax

from hetjax import timeline
from hetjax.runtime.loop.ledger import Ledger, device_bytes
from hetjax.storage.swap import distinct_devices, index_key


class Boundaries:
    """Block i's input from its forward to its backward, for ``num_layers`` blocks.
    ``tier``: ``offload.activations``; ``swap``: the NVMe swap (tier ``nvme`` only);
    ``put_batch``: places a host array on the device like a batch; ``ledger``: holds
    what is kept (``ledger.Ledger``), where one counts it."""

    def __init__(self, tier: str, num_layers: int, swap, put_batch, ledger: Ledger | None = None):
        self.tier, self.swap, self.put_batch = tier, swap, put_batch
        self.ledger = ledger or Ledger()
        self.held: list[Any] = [None] * num_layers
        self._host = 0  # boundaries in host RAM (tier host) now ...
        self._peak = 0  # ... and at their peak

    def begin(self) -> None:
        """A micro-batch starts: the previous one's boundaries are gone (and its writes
        to NVMe done)."""
        for i in range(len(self.held)):
            self.drop(i)
        if self.swap is not None:
            self.swap.begin()

    @property
    def peak_host_bytes(self) -> int:
        """Host RAM the boundaries held at their peak since ``reset_peak``."""
        return self.swap.peak_host_bytes if self.swap is not None else self._peak

    def reset_peak(self) -> None:
        self._peak = self._host
        if self.swap is not None:
            self.swap.reset_peak()

    def store(self, i: int, x: jax.Array) -> None:
        """Keeps block i's input ``x``: as is on the device, as its copy in host RAM, or
        handed to the swap (which holds it until written)."""
        if self.tier == "device":
            self.held[i] = x
            self.ledger.hold(("boundary", i), x)
            return
        host = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        timeline.watch("device_to_host", "boundary", host, after=x)
        if self.tier == "nvme":
            self.swap.put(i, host)
        else:
            self.held[i] = host
            self.ledger.hold(("boundary", i), host)
            self._host += device_bytes(host)
            self._peak = max(self._peak, self._host)

    def load(self, i: int) -> jax.Array:
        """Block i's input on the device (for its backward); dispatched early, the copy
        overlaps the block before it."""
        if self.swap is not None:
            x = self.put_batch(self.swap.get(i))  # waits for its read from NVMe
            timeline.watch("host_to_device", "boundary", x)
            return x
        held = self.held[i]
        x = jax.device_put(held, held.sharding.with_memory_kind("device"))  # no-op if there
        if x is not held:
            timeline.watch("host_to_device", "boundary", x, after=held)
        return x

    def drop(self, i: int) -> None:
        if self.held[i] is not None:
            self.ledger.release(("boundary", i))
            if self.tier == "host":
                self._host -= device_bytes(self.held[i])
        self.held[i] = None

    def arrays(self) -> list[jax.Array]:
        """The JAX arrays held (device or pinned host), for the ledger."""
        return [b for b in self.held if b is not None]

    def staged_bytes(self) -> int:
        """Host bytes held outside JAX (the swap's buffers), for the ledger."""
        return self.swap.host_bytes() if self.swap is not None else 0


class SwappedResiduals:
    """The swapped blocks' in-block residuals (``offload.swap_blocks``): copied to host
    memory (``pinned_host``) as forward made them, into the NVMe swap's rows where
    ``offload.swap_tier=nvme`` (``swap``), and back to the device ahead of backward,
    each with the sharding it left with (one device, or ZeRO-3's: split over the
    mesh, or stacked per device)."""

    def __init__(self, swap=None):
        self.swap = swap
        self._shardings: dict[int, list] = {}  # slot -> its residuals' device shardings

    def out(self, i: int, slot: int, residuals: list) -> list | None:
        """Block ``i``'s residuals to the host; the device's copies go once the copy
        has them. With the NVMe swap it takes the host copy (row ``slot``) and this
        returns None."""
        host = [a.sharding.with_memory_kind("pinned_host") for a in residuals]
        out = jax.device_put(residuals, host)
        timeline.watch("device_to_host", f"block{i} swap out", out, after=residuals)
        if self.swap is not None:
            self._shardings[slot] = [(a.shape, a.sharding) for a in residuals]
            self.swap.put(slot, out)
            return None
        return out

    def back(self, i: int, slot: int, residuals: list | None) -> list:
        """Block ``i``'s residuals back on the device (from the NVMe swap's row
        ``slot`` when it holds them: read ahead there)."""
        if residuals is None:
            pieces = iter(self.swap.get(slot))  # waits for its read
            residuals = [
                _sharded(shape, sharding, pieces) for shape, sharding in self._shardings[slot]
            ]
            out, held = residuals, None
        else:
            device = [a.sharding.with_memory_kind("device") for a in residuals]
            out, held = jax.device_put(residuals, device), residuals
        timeline.watch("host_to_device", f"block{i} swap in", out, after=held)
        return out


def _sharded(shape: tuple[int, ...], sharding, pieces) -> jax.Array:
    """A residual of global ``shape`` and device ``sharding`` from the next of
    ``pieces`` (this process's distinct shards as the swap packed them, in device
    order: ``swap.host_pieces``), each on every device that holds its part."""
    on = lambda d: jax.sharding.SingleDeviceSharding(d, memory_kind="device")
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(next(pieces), on(next(iter(sharding.device_set))))
    parts = {index_key(sharding.addressable_devices_indices_map(shape)[d]): next(pieces)
             for d in distinct_devices(sharding, shape)}  # fmt: skip
    indices = sharding.addressable_devices_indices_map(shape)
    devices = sorted(indices, key=lambda d: d.id)
    # (pinned pieces too: put on the device)
    shards = [jax.device_put(parts[index_key(indices[d])], on(d)) for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
