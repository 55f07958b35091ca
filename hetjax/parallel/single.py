"""Where each kind of state lives: the one module that maps state to memory.

Layer and model code never place arrays; the runtimes ask this module for shardings.
:class:`Shardings` names the memory spaces of one device:

* ``device``: the accelerator's own memory (HBM): the streaming window, activations.
* ``host``: the ``pinned_host`` memory kind of the same device: param slabs and
  boundary activations waiting to be copied in; transfers are plain ``device_put``.
* ``optimizer``: where the host optimizer keeps and updates fp32 master state. On a
  GPU/TPU this is the CPU backend (host RAM, computed on by the CPU). On a CPU-only
  machine the CPU *is* the device, so it is the ``pinned_host`` kind of that device:
  XLA computes on host-kind operands there, and the device kind stays the streaming
  budget's alone, as it would on an accelerator.

``HETJAX_HOST_CLIENT=separate`` emulates a GPU's topology on a CPU-only machine: the
optimizer gets a device of a second CPU client, so every array between the host
optimizer and the "device" crosses JAX clients as it does on a GPU (``gpucheck
--emulate`` and the two-client tests run the runtimes that way).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from hetjax.config import ConfigError
from hetjax.parallel.grouped import GroupPages
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.rules import rules_for
from hetjax.storage.pages import GradPages, SlabLayout
from hetjax.storage.states import flat
from hetjax.types import ParamStore, StageSignature

HOST_CLIENT_ENV = "HETJAX_HOST_CLIENT"


@functools.cache
def separate_host_device() -> jax.Device:
    """The device of a second CPU client, made once per process: the host optimizer's
    side of the emulated GPU topology (a GPU's host optimizer runs on the CPU client)."""
    from jax._src.lib import xla_client  # no public way to make a second client

    return xla_client.make_cpu_client(asynchronous=True).devices()[0]


def cpu_device() -> jax.Device:
    """The CPU backend's device, where the host optimizer runs beside an accelerator."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        raise ConfigError(
            f"the host optimizer runs on JAX's CPU backend, which is not available ({e}); "
            f"JAX_PLATFORMS={platforms!r} must include cpu: set JAX_PLATFORMS="
            f"{platforms.split(',')[0] or 'cuda'},cpu or unset it"
        ) from e


def _numpy_view(a):
    """A CPU array in a host memory kind -> a numpy view of its buffer (no copy)."""
    if isinstance(a, jax.Array) and a.sharding.memory_kind != "device":
        return np.asarray(a)
    return a


@dataclasses.dataclass(frozen=True)
class Shardings:
    device: SingleDeviceSharding
    host: SingleDeviceSharding
    optimizer: SingleDeviceSharding
    # optimizer state on the device: ``device``, or under ZeRO-3 with several devices in
    # a process each device's pages on it (``optimizer/sharded_slab.py``)
    device_state: jax.sharding.Sharding | None = None

    @property
    def state_on_device(self) -> jax.sharding.Sharding:
        return self.device_state or self.device

    @classmethod
    def single_device(cls, device: jax.Device | None = None) -> Shardings:
        device = device or jax.local_devices()[0]  # (this process's first)
        host = SingleDeviceSharding(device, memory_kind="pinned_host")
        if device.platform == "cpu" and os.environ.get(HOST_CLIENT_ENV) == "separate":
            optimizer = SingleDeviceSharding(separate_host_device())
        elif device.platform == "cpu":
            optimizer = host
        else:
            optimizer = SingleDeviceSharding(cpu_device())
        return cls(SingleDeviceSharding(device, memory_kind="device"), host, optimizer)

    def pinned_staging(self) -> SingleDeviceSharding | None:
        """Where pages read from disk wait for the copy to the device: its pinned_host
        memory on an accelerator (a DMA, not a copy from pageable memory); on a CPU,
        where the two are one memory, nowhere (None), except under the two-client
        emulation, so that the tests run the accelerator's path."""
        (device,) = self.device.device_set
        emulated = os.environ.get(HOST_CLIENT_ENV) == "separate"
        return self.host if device.platform != "cpu" or emulated else None


class SingleDevice:
    """The streaming runtime's parallelism on one device (``hetjax.types.Parallelism``):
    every stage whole, in this process, every argument and result of a stage function on
    the one device, of whatever kind it declares. The mesh's (``zero.py``) has the same
    members; the runtime is handed one and never asks which."""

    nvme_subdir = ""  # this process's directory under the NVMe path ("": the path)
    expert_axis = None  # the mesh axis a MoE's experts are split over (zero.py)
    axis_rules = rules_for(1)  # no mesh: nothing is split by them
    local_share = 1  # the fraction of a batch's rows (and per-device values) held here
    degree = 1  # devices a stage's pages split over
    batch_degree = 1  # devices a micro-batch's rows split over
    local_degree = 1  # this process's devices, each holding its own pages of state
    tensor_parallel = 1  # devices splitting a stage's compute
    on_mesh = False  # a block's compute needs no mesh

    def __init__(self, device: jax.Device | None = None):
        self.shardings = Shardings.single_device(device)
        (device,) = self.shardings.device.device_set
        self._host_is_device = device.platform == "cpu"  # one RAM, two memory kinds

    def stage_layouts(self, model, page_size: int) -> dict[str, SlabLayout]:
        """The stages' slab layouts (``layouts.stage_layouts``): whole slabs, which the
        device takes leaf by leaf (``pages.LeafBuffers``: every weight a buffer of its
        own, none cut out of the pages it spans at each use)."""
        return stage_layouts(model, page_size, leaf_buffers=True)

    def swap_staging(self):
        """Where the NVMe swaps' reads wait for their copy to the device
        (``Shardings.pinned_staging``)."""
        return self.shardings.pinned_staging()

    def constrain(self, stage: str, params):
        """Inside a stage function: its params as it computes with them (one device:
        as they are; tensor parallelism splits them, ``zero.Zero3.constrain``)."""
        del stage
        return params

    def state_layouts(self, layouts: dict[str, SlabLayout]) -> dict[str, SlabLayout]:
        """Layouts of the slabs this process's optimizer and stores hold: whole slabs."""
        return layouts

    def own_pages(self, layout: SlabLayout) -> tuple[int, int]:
        """(first page, number of pages) of a stage slab that this process holds."""
        return 0, layout.num_pages

    def own_slab(self, layout: SlabLayout, slab):
        """A whole stage slab (fp32) -> the part this process holds: all of it."""
        return slab

    def whole_slab(self, slab) -> np.ndarray:
        """This process's part of a stage slab -> the whole slab (host numpy)."""
        return flat(slab)

    def jit(self, fn, signature: StageSignature):
        """A stage function compiled for the device: its results there, whatever
        ``signature`` declares them (one device has nothing to split or reduce)."""
        del signature
        return jax.jit(fn, out_shardings=self.shardings.device)

    def grad_slab(self, pages: list[jax.Array], dtype=jnp.float32):
        """Inside a stage's jit: the gradient of its pages as it leaves the device."""
        return [p.astype(dtype) for p in pages]

    def to_device(self, pages, layout=None):
        """A stage's params from the param store (its leaf buffers) -> on the device for
        compute (``layout``: the stage's, which a sharded placement gathers by).

        On the CPU backend the host memory kinds are the device's RAM: an array in one is
        handed over as its numpy view, which the device aliases (as it does the NVMe
        tier's numpy reads), where a ``device_put`` of the array copies it (with params in
        RAM the copies kept the host-to-device lane busy, docs/results/2026-11-26.md). On a GPU the
        copy is a DMA and stays."""
        if self._host_is_device:
            pages = jax.tree.map(_numpy_view, pages)
        return jax.device_put(pages, self.shardings.device)

    def put_batch(self, rows: np.ndarray) -> jax.Array:
        return jax.device_put(rows, self.shardings.device)

    def put_scalar(self, value: float) -> jax.Array:
        """An fp32 scalar argument of the stage functions, put explicitly (passed as a
        Python number it would be an implicit transfer, a sync copy on a GPU)."""
        return jax.device_put(np.float32(value), self.shardings.device)

    def host_grad(self, grad) -> GradPages:
        """A gradient copied to the host (its pages) -> this process's pages as numpy
        views, no copy (waits for the copy)."""
        return GradPages.of(grad)

    def host_sq(self, sq: jax.Array) -> float:
        """A gradient's per-page squared norms (``stages.page_squared_norms``, on the
        device) -> the sum over this process's pages (waits for the backward)."""
        return float(np.sum(np.asarray(sq), dtype=np.float64))

    def sum_over_processes(self, value: float) -> float:
        return value

    def param_store(
        self, store: ParamStore, nvme_store, layouts: dict[str, SlabLayout], device_stages
    ) -> ParamStore:
        """The param store the runtime reads stages from: ``store`` itself."""
        return store

    def per_device(self, fn, signature: StageSignature, args: tuple):
        """``fn(*args)``: one device's part is the whole."""
        return fn(*args)

    def device_pages(self, layout: SlabLayout, dtype):
        """A stage's abstract pages (or leaves) on the device."""
        sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.shardings.device)
        return jax.tree.map(sds, layout.device_pages(dtype))

    def abstract_rows(self, x):
        """A ``BATCH`` argument's abstract value: on the device."""
        return self.as_called(x)

    def as_called(self, args: tuple) -> tuple:
        """Abstract arguments of a stage function (shapes and dtypes) as its calls pass
        them: every one on the device. A start-up measurement that compiles the function
        from these compiles the program the first call then finds in JAX's caches (one
        trace, one compile: issue #59 item 13)."""
        sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.shardings.device)
        return jax.tree.map(sds, args)

    def sent_grad(self, grad: jax.Array, layout=None) -> None:
        """A gradient slab of a stage with ``layout`` left the device (ZeRO-3 counts its
        reduce-scatter)."""

    def describe(self, layouts: dict[str, SlabLayout]) -> list[str]:
        return []

    def step_metrics(self) -> dict[str, int]:
        """This step's collective traffic, for the step's report (none here)."""
        return {}


def live_bytes_by_kind() -> dict[str, int]:
    """Bytes of every live JAX array, grouped by memory kind (``device``,
    ``pinned_host``, ...): what the ledger is checked against."""
    totals: dict[str, int] = defaultdict(int)
    for a in jax.live_arrays():
        if a.is_deleted():
            continue
        totals[a.sharding.memory_kind or "device"] += a.nbytes
    return dict(totals)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageShardings:
    """ZeRO-3 (``zero.py``): a stage's slab is a ``(pages, page_elems)`` array whose
    pages are split evenly over the ``axes`` of ``mesh`` (every device); the batch is
    split over the same axes. Storage layout (sharded) and compute layout (gathered)
    are separate shardings."""

    mesh: Mesh
    slab_host: NamedSharding  # each device's pages, in its host memory
    slab_device: NamedSharding  # the same shards copied to device memory
    gathered: NamedSharding  # replicated on every device: the all-gathered pages
    grad: NamedSharding  # gradient pages reduce-scattered back to their owners
    batch: NamedSharding  # rows of the batch over the data axis

    @classmethod
    def over(
        cls, mesh: Mesh, axes: str | tuple[str, ...] = "data", batch_axes=None
    ) -> PageShardings:
        """Pages split over ``axes``; the batch's rows over ``batch_axes`` (None: the
        same; tensor parallelism: the data axes only, the model axis's devices share
        their rows)."""
        pages = PartitionSpec(axes, None)
        batch_axes = axes if batch_axes is None else batch_axes
        return cls(
            mesh=mesh,
            slab_host=NamedSharding(mesh, pages, memory_kind="pinned_host"),
            slab_device=NamedSharding(mesh, pages, memory_kind="device"),
            gathered=NamedSharding(mesh, PartitionSpec(), memory_kind="device"),
            grad=NamedSharding(mesh, pages, memory_kind="device"),
            batch=NamedSharding(mesh, PartitionSpec(batch_axes), memory_kind="device"),
        )

    def group_pages(self, dense_pages: int, groupings: tuple) -> GroupPages:
        """Shardings of a grouped stage's pages on the device (``grouped.GroupPages``: the
        dense pages gathered, each part's groups over its grouping's axes)."""
        on = lambda axis: NamedSharding(self.mesh, PartitionSpec(axis, None), memory_kind="device")
        group = lambda grouping: on(grouping.axis)
        return GroupPages([self.gathered] * dense_pages, map(group, groupings), groupings)
