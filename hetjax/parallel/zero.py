"""ZeRO-3 data parallelism on the streaming runtime (``distributed.data_parallel != 1``).

The streaming runtime's loop (``streaming.py``) runs unchanged; what changes is where
its arrays live: the runtime is handed this placement strategy (:class:`Zero3`)
instead of :class:`~hetjax.parallel.single.SingleDevice`, and calls the same methods:

* **Sharded pages.** Every stage's slab pads to a multiple of N pages (N devices on the
  ``data`` axis) and is held as a ``(pages, page_elems)`` array sharded over that axis
  (``PageShardings``): each device owns 1/N of the pages, in its host memory, or on
  its process's NVMe directory (``<nvme_path>/proc<k>``).
* **All-gather per stage, prefetched.** When the window fetches a stage, each device
  copies its own pages to device memory and a jitted all-gather makes them whole on
  every device; both are dispatched ahead of use like streaming's copies.
* **Declared compute layout.** Each stage function runs per device on its rows of
  the global batch (``shard_map``), its arguments and results placed as its signature
  declares (``stages.SIGNATURES``, ``hetjax.types.Kind``), by the axis rules
  (``parallel/rules.py``: ``batch`` over ``data`` x ``expert``, a MoE's
  ``expert`` axis over ``expert``), never by an array's rank.
* **Tensor parallelism** (``distributed.tensor_parallel`` M > 1): the mesh's third
  axis, ``model``, has M devices that share their rows; the pages split over every
  device of the mesh (data x model), and inside the stage functions, which are manual
  over the data axes only, each stage's params are constrained by their logical axes
  under ``rules.RULES`` (:meth:`Zero3.constrain`: attention by
  heads, the MLP by its hidden units, the vocabulary), so XLA splits the block's
  compute as Megatron does and adds the all-reduces; no layer code knows. The split
  weights are laid out by slice (``layouts.py``, ``grouped.py``): a device fetches the
  dense pages whole and only its slice of each split weight (gathered over ``data``),
  and its gradient of that slice is reduce-scattered over ``data`` only, as are the
  dense pages' (the model axis's devices hold the same gradient of them). A checkpoint
  records each piece's split axis and resumes at any data x tensor split
  (``tests/test_tensor.py``).
* **Reduce-scatter of gradients.** A stage function's gradient slab is ``psum_scatter``-ed
  (``grad_slab``), so each device keeps only the summed gradient of its own pages, which
  go to the host as before, with their squared norms taken on the device. (Left to
  XLA's automatic partitioner, the CPU backend lowers both collectives as all-reduces,
  twice the bytes.)
* **One optimizer per process, on its shards.** A process holds the pages of its own
  devices, a contiguous page range of every stage (devices of a process are
  contiguous in the mesh); its host optimizer loop (``update_loop.py``) updates only
  that range (``SlabLayout.shard``: the decay split point moves with it). Optimizer
  state on the device (``offload.optimizer=device``, the device cache) is each
  device's own pages, held and updated on it (``optimizer/sharded_slab.py``). The global
  gradient norm for clipping is the sum of every process's part.

* **Expert parallelism** (``distributed.expert_parallel`` G > 1). The mesh is
  ``data`` x ``expert`` (x ``model`` 1): S x G devices; pages and batch rows split over
  both axes as above, but a mixture of experts' block slab is laid out so that each device's share
  holds a share of its own group of experts (``layouts.py``): its gather all-gathers
  the dense pages over every device and the experts over ``data`` only, so a device
  computes with E/G experts, and its tokens reach the other experts by all-to-all
  inside the block (``models/llama.py``). The experts' gradients are reduce-scattered
  over ``data`` only (the devices holding the same experts). With tensor parallelism
  too (data x expert x model), each device's group is its experts' slice on the model
  axis (``groupings.ExpertTensorGrouping``: manual over ``expert``, XLA's over
  ``model``), and a MoE block's other split weights (attention) and the other stages'
  arrive as their model slice, shared over data x expert (``layouts.py``). Each part's
  group is gathered and its gradient reduce-scattered over its grouping's
  ``share_axes``, which the pages carry (``grouped.GroupPages``).

A stage group's context (``models/staged.py``; T5's decoder reads the encoder's output
and a position-bias table) is declared ``Kind.CONTEXT``: its activations are split by
rows like x; a param in it (the table) is a result of the group's input function on
every device, so it is held once per device, stacked on the data axis, and handed back
split: each device reads its own copy, and its gradient stays each device's partial
sum until the group input's backward turns it into the embed stage's gradient slab,
reduce-scattered with the rest of that stage (``tests/test_t5.py``).

The mean over the global batch is computed as the mean of the devices' means, the sum
single-device training with ``train.grad_accum = N`` micro-batches does (tested at
1e-5 in ``tests/test_zero.py``). A block's auxiliary-loss statistics (a mixture of
experts' router statistics, declared ``Kind.MEAN``) are means over the
devices too, so the auxiliary loss pools the whole micro-batch, as one device running
it does (``tests/test_moe.py``). Per step and device the all-gathers move
(N-1)/N of the stage slabs fetched and the reduce-scatters (N-1)/N of the gradient
slabs: PatrickStar's 6(p-1)/p M bytes with fp16 params and gradients. With tensor
parallelism the reduce-scatters move (S-1)/S of what a device computes with (S devices
on the data axis; :meth:`Zero3.scattered_size`).
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hetjax.config import Config, ConfigError
from hetjax.optimizer.sharded_slab import device_state_sharding
from hetjax.parallel.grouped import (
    DENSE_SCATTER_AXES,
    GroupedSlabLayout,
    GroupPages,
    axes_of,
    scattered_elements,
)
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.rules import (
    BATCH_AXES,
    EXPERT_AXIS,
    MODEL_AXIS,
    Split,
    data_mesh,
    param_specs,
)
from hetjax.parallel.single import PageShardings, Shardings
from hetjax.storage.pages import GradPages, SlabLayout
from hetjax.storage.states import flat
from hetjax.types import Kind, ParamStore, StageSignature, is_block, stage_layout

F32 = jnp.float32


AXES = BATCH_AXES  # batch rows split over the data axes (and pages, but for the model axis)


class Zero3:
    """The streaming runtime's placement strategy with every stage's pages sharded over
    the ``distributed.data_parallel`` x ``distributed.expert_parallel`` devices of the
    mesh (a MoE block's experts split over the ``expert`` axis). Its compute layout
    (``hetjax.types.Parallelism``) places by ``axis_rules``; with
    ``distributed.tensor_parallel`` > 1 the mesh's ``model`` axis splits each stage's
    compute (:meth:`constrain`)."""

    def __init__(self, config: Config):
        dist = config.distributed
        self.mesh = data_mesh(dist.data_parallel, dist.expert_parallel, dist.tensor_parallel)
        self.split = Split.of_mesh(self.mesh)  # the rules' mappings on this mesh
        self.tensor_parallel = self.split.model
        self.axis_rules = self.split.rules
        self.rules = dict(self.axis_rules)
        self.degree = self.mesh.size  # devices sharing the pages: data x expert x model
        self.batch_degree = self.degree // self.tensor_parallel  # splitting the rows
        self.page_axes = self.split.page_axes
        self.expert_parallel = dist.expert_parallel
        self.expert_axis = self.split.expert_axis
        if config.train.micro_batch_size % self.batch_degree:  # data_parallel 0: known now
            raise ConfigError(
                f"config key 'train.batch_size' ({config.train.batch_size}): its "
                f"micro-batches of {config.train.micro_batch_size} rows must divide evenly "
                f"over the mesh's {self.batch_degree} devices; make batch_size / grad_accum "
                "a multiple of it"
            )
        self.sharded = PageShardings.over(self.mesh, self.page_axes, batch_axes=AXES)
        me = jax.process_index()
        slots = [i for i, d in enumerate(self.mesh.devices.flat) if d.process_index == me]
        self.local_devices = [self.mesh.devices.flat[i] for i in slots]
        self.local_degree = len(slots)  # each holding its own pages of device state
        self.first_slot = slots[0]  # this process's first device in the mesh's flat order
        # the fraction of a batch's rows (and of the per-device values) this process holds
        self.local_share = fractions.Fraction(len(slots), self.degree)
        self.nvme_subdir = f"proc{me}"
        # this process's host optimizer and stores, on its first device's host side;
        # optimizer state on the device, each device's pages on it (``sharded_slab.py``)
        shardings = Shardings.single_device(self.local_devices[0])
        if len(self.local_devices) > 1:
            state = device_state_sharding(self.local_devices)
            shardings = dataclasses.replace(shardings, device_state=state)
        self.shardings = shardings
        self.comm = collections.Counter()  # bytes per device moved by collectives
        self._gathers: dict[tuple, object] = {}
        self._param_specs: dict[str, object] = {}  # stage -> its params' split (tensor)

    def stage_layouts(self, model, page_size: int) -> dict[str, SlabLayout]:
        """The stages' slab layouts: one equal share of pages per device; with expert
        parallelism, the block's experts in groups (``layouts.py``)."""
        # how each stage's params split for compute (none: a model axis of 1)
        self._param_specs = param_specs(model, self.tensor_parallel)
        # pages split over every device (ZeRO-3); with tensor parallelism a stage's split
        # weights by slice, each device's slice in its model index's pages
        return stage_layouts(
            model,
            page_size,
            self.degree,
            self.expert_parallel,
            tensor_parallel=self.tensor_parallel,
        )

    def constrain(self, stage: str, params):
        """Inside a stage function: ``stage``'s params as it computes with them: as they
        are, or with tensor parallelism split over the ``model`` axis by their logical
        axes (``rules.RULES``: attention by heads, the MLP by its
        hidden units, the vocabulary), so XLA splits the block's compute as Megatron
        does and adds the all-reduces; no layer code knows."""
        specs = self._param_specs.get(stage_layout(stage))
        if specs is None:
            return params
        if jax.sharding.get_abstract_mesh().empty:
            # traced outside the stage functions' shard_map (a kept block's levels and
            # residual bytes, ``remat.py``, from abstract shapes): on the whole mesh
            specs = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        return jax.tree.map(
            lambda a, spec: jax.lax.with_sharding_constraint(a, spec), params, specs
        )

    def swap_staging(self):
        """None: the NVMe swaps' reads are this process's shards, put each on its own
        device (``boundaries.SwappedResiduals``), not staged in one device's pinned
        memory."""
        return None

    def own_pages(self, layout: SlabLayout) -> tuple[int, int]:
        """(first page, number of pages) of a stage slab that this process holds."""
        per_device = layout.num_pages // self.degree
        return self.first_slot * per_device, len(self.local_devices) * per_device

    def state_layouts(self, layouts: dict[str, SlabLayout]) -> dict[str, SlabLayout]:
        return {name: lay.shard(*self.own_pages(lay)) for name, lay in layouts.items()}

    def own_slab(self, layout: SlabLayout, slab):
        first, n = self.own_pages(layout)
        if n == layout.num_pages:
            return slab
        P = layout.page_elems
        part = np.asarray(slab)[first * P : (first + n) * P]
        return (
            part if isinstance(slab, np.ndarray) else jax.device_put(part, self.shardings.optimizer)
        )

    def whole_slab(self, slab) -> np.ndarray:
        local = flat(slab)
        if jax.process_count() == 1:
            return local
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))

    def jit(self, fn, signature: StageSignature):
        """A stage function run per device on its rows of the batch (``shard_map``), its
        arguments and results placed as ``signature`` declares (``hetjax.types.Kind``),
        by the axis rules' ``batch`` and ``expert`` mesh axes: pages whole (a block's
        experts, its group's), batch rows, contexts and gradients split over the batch
        axes (a gradient slab reduce-scattered by :meth:`grad_slab` inside), means
        averaged over the devices and whole on each, a device's local values (a kept
        block's vjp) stacked on a new leading axis and handed back to their device."""
        batch, whole = PartitionSpec(self.rules["batch"]), PartitionSpec()
        # tensor parallelism: the model axis is XLA's to split (``constrain``)
        manual = set(self.split.manual_axes)
        split = {Kind.BATCH: batch, Kind.CONTEXT: batch, Kind.GRAD: batch, Kind.LOCAL: batch}
        out_specs = jax.tree.map(lambda kind: split.get(kind, whole), signature.results)
        assert Kind.PAGES not in jax.tree.leaves(signature.results), signature

        def spec_in(kind: str, arg):
            if kind == Kind.PAGES and isinstance(arg, GroupPages):
                # a part's groups split over those of its grouping's axes that are manual
                # (the experts'); tensor parallelism's model axis is XLA's, the array
                # global over it
                def group(grouping):
                    axes = tuple(a for a in axes_of(grouping.axis) if a in manual)
                    return PartitionSpec(axes) if axes else whole

                groups = map(group, arg.groupings)
                return GroupPages([whole] * len(arg.dense), groups, arg.groupings)
            return jax.tree.map(lambda _: split.get(kind, whole), arg)

        def finish(kind: str, result):  # on each device: a result as its kind leaves
            if kind == Kind.MEAN:  # the global batch's mean is the mean of the means
                return jax.tree.map(lambda r: jax.lax.pmean(r, self.rules["batch"]), result)
            if kind == Kind.LOCAL:
                return jax.tree.map(lambda r: r[None], result)
            return result

        def run(*args):
            kinds = signature.args[: len(args)]
            assert len(args) <= len(signature.args), (fn, signature)

            def per_device(*args):
                args = [
                    jax.tree.map(lambda a: a[0], a) if kind == Kind.LOCAL else a
                    for kind, a in zip(kinds, args, strict=True)
                ]
                return jax.tree.map(finish, signature.results, fn(*args))

            return jax.shard_map(
                per_device,
                mesh=self.mesh,
                in_specs=tuple(spec_in(k, a) for k, a in zip(kinds, args, strict=True)),
                out_specs=out_specs,
                axis_names=manual,
                check_vma=False,
            )(*args)

        return jax.jit(run)

    def per_device(self, fn, signature: StageSignature, args: tuple):
        """``fn(*args)`` traced (from abstract shapes) on one device's part of ``args``
        (global, of ``signature``'s kinds) inside the mesh, as a stage function runs:
        for the start-up measurements of a block (its keep levels, its residuals' bytes,
        ``stages.StageFunctions``) whose all-to-all needs the mesh (expert
        parallelism). Returns ``fn``'s (Python) result."""
        results = []

        def body(*part):
            results.append(fn(*part))
            return jnp.zeros((), F32)

        jax.eval_shape(self.jit(body, StageSignature(signature.args, Kind.WHOLE)), *args)
        return results[0]

    def grad_slab(self, pages: list[jax.Array] | GroupPages, dtype=F32) -> jax.Array:
        """Inside a stage function (per device): this device's gradient of the pages it
        computed with -> the summed gradient of its own pages, ``(pages / N,
        page_elems)``. A grouped stage's (``GroupPages``: a block's experts, a stage's
        tensor-parallel slices) gradient of each part's group is summed over the devices
        holding the same group (its grouping's ``share_axes``, which the pages carry) and
        the parts make the first pages of its share, in order, as they are laid out
        (``grouped.py``)."""

        # Seeded with the local mean, each device's gradient is N x its share of the
        # global mean's (exact for a power-of-two N).
        scatter = lambda g, axes: jax.lax.psum_scatter(g, axes, scatter_dimension=0, tiled=True)
        M = self.tensor_parallel

        def parts(groups):  # each part's group over its devices, its grouping's share_axes
            return [scatter(g, p.share_axes) for g, p in zip(groups, pages.groupings, strict=True)]

        if isinstance(pages, GroupPages) and M > 1:
            # each part's group global over the automatic model axis, (M x group pages,
            # P), its row block m on model device m; the dense gradient whole on each.
            # Scattered manual over the model axis too (XLA's partitioner would gather
            # the group first): device m keeps its groups' sums and part m of the dense.
            assert all(MODEL_AXIS in axes_of(p.axis) for p in pages.groupings), pages

            def own(groups, dense):
                groups = parts(groups)
                if not dense.shape[0]:
                    return jnp.concatenate(groups)
                dense = scatter(dense, DENSE_SCATTER_AXES)
                part = dense.shape[0] // M
                m = jax.lax.axis_index(MODEL_AXIS)
                mine = jax.lax.dynamic_slice_in_dim(dense, m * part, part)
                return jnp.concatenate([*groups, mine])

            P = pages.groups[0].shape[-1]  # (a stage of split weights only has no dense pages)
            dense = jnp.stack([p.astype(dtype) for p in pages.dense] or [jnp.zeros((0, P), dtype)])
            dense = dense.reshape(-1, P)
            model = PartitionSpec(MODEL_AXIS)
            groups = tuple(g.astype(dtype) for g in pages.groups)
            summed = jax.shard_map(
                own, in_specs=((model,) * len(groups), PartitionSpec()), out_specs=model,
                axis_names={MODEL_AXIS}, check_vma=False,
            )(groups, dense)  # fmt: skip
        elif isinstance(pages, GroupPages):
            dense = jnp.stack([p.astype(dtype) for p in pages.dense])  # (pages, page_elems)
            groups = parts([g.astype(dtype) for g in pages.groups])
            summed = jnp.concatenate([*groups, scatter(dense, DENSE_SCATTER_AXES)])
        else:
            summed = scatter(jnp.stack([p.astype(dtype) for p in pages]), DENSE_SCATTER_AXES)
            if M > 1:  # the model axis's devices keep a part each
                summed = jax.lax.with_sharding_constraint(summed, PartitionSpec(MODEL_AXIS))
        return summed / self.batch_degree

    def gather(self, num_pages: int, layout: GroupedSlabLayout | None = None):
        """The jitted all-gather of a ``num_pages``-page stage slab (sharded over every
        device, in device memory) into its pages whole on every device; with a grouped
        ``layout`` (a block's experts, a stage's tensor-parallel slices), into its
        :class:`GroupPages` (the dense pages whole, a group whole on each device of it)."""
        key = (num_pages, layout)
        if key in self._gathers:
            return self._gathers[key]
        # shard_map: XLA's CPU partitioner would lower an automatic gather as an
        # all-reduce of zero-padded copies, twice the bytes on the wire.
        per_device = functools.partial(
            jax.shard_map,
            mesh=self.mesh,
            in_specs=PartitionSpec(self.page_axes, None),
            check_vma=False,  # all_gather's output is replicated
        )
        if layout is None:
            all_gather = per_device(
                lambda s: jax.lax.all_gather(s, self.page_axes, tiled=True),
                out_specs=PartitionSpec(),
            )
            gather = jax.jit(lambda s: list(all_gather(s)), out_shardings=self.sharded.gathered)
        else:

            def split(share):  # (share, page_elems): each part's group's pages, the dense
                groups, at = [], 0
                for part in layout.parts:  # over its devices, its grouping's share_axes
                    mine = share[at : at + part.share]
                    groups.append(jax.lax.all_gather(mine, part.grouping.share_axes, tiled=True))
                    at += part.share
                dense = share[at:]
                if not layout.dense_share:  # a stage of grouped leaves only
                    return tuple(groups), dense
                return tuple(groups), jax.lax.all_gather(dense, self.page_axes, tiled=True)

            groups = tuple(PartitionSpec(g.axis) for g in layout.groupings)
            split = per_device(split, out_specs=(groups, PartitionSpec()))

            def gather(s):
                groups, dense = split(s)
                return layout.pages(list(dense), *groups)

            out = self.sharded.group_pages(layout.dense.num_pages, layout.groupings)
            gather = jax.jit(gather, out_shardings=out)
        self._gathers[key] = gather
        return gather

    @property
    def on_mesh(self) -> bool:
        """Whether a block's compute needs the mesh (expert parallelism's all-to-all,
        tensor parallelism's split weights)."""
        return self.expert_axis is not None or self.tensor_parallel > 1

    def as_called(self, args: tuple) -> tuple:
        """Abstract arguments of a stage function for a start-up measurement: as given
        (global, unplaced). The measurement compiles the function for one device's rows
        where the calls compile it over the mesh (``single.py``'s places them as called:
        one compile)."""
        return args

    def abstract_rows(self, x):
        """A ``BATCH`` argument's abstract value: its rows split over the batch axes."""
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharded.batch)

    def device_pages(self, layout: SlabLayout | GroupedSlabLayout, dtype) -> object:
        """The abstract pages of a stage as its gather hands them to a stage function:
        ``ShapeDtypeStruct``s with their shardings (to lower a stage function with)."""
        pages = layout.device_pages(dtype)
        if isinstance(pages, GroupPages):
            shardings = self.sharded.group_pages(layout.dense.num_pages, layout.groupings)
        else:
            shardings = [self.sharded.gathered] * len(pages)
        sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        return jax.tree.map(sds, pages, shardings)

    def to_device(self, slab: jax.Array, layout: SlabLayout | GroupedSlabLayout):
        """A stage's sharded host slab (of ``layout``) -> its pages on every device as
        the stage computes with them (whole; a grouped stage's group, the device's):
        each device copies its own pages in, then all-gathers (both
        asynchronous)."""
        self.comm["all_gather"] += layout.gathered_size * slab.dtype.itemsize
        grouped = layout if isinstance(layout, GroupedSlabLayout) else None
        return self.gather(slab.shape[0], grouped)(jax.device_put(slab, self.sharded.slab_device))

    def scattered_size(self, layout: SlabLayout | GroupedSlabLayout) -> int:
        """Elements of a stage's gradient one device sends in :meth:`grad_slab`'s
        reduce-scatters (:func:`~hetjax.parallel.grouped.scattered_elements`)."""
        return scattered_elements(layout, self.mesh.shape)

    def sent_grad(self, grad: jax.Array, layout: SlabLayout | GroupedSlabLayout) -> None:
        """A gradient of a stage of ``layout`` left the device: count the bytes its
        reduce-scatters sent (:meth:`scattered_size`)."""
        self.comm["reduce_scatter"] += self.scattered_size(layout) * grad.dtype.itemsize

    def put_batch(self, rows: np.ndarray) -> jax.Array:
        """This process's rows of a batch -> the global batch, rows over ``data``."""
        return jax.make_array_from_process_local_data(self.sharded.batch, rows)

    def put_scalar(self, value: float) -> jax.Array:
        """An fp32 scalar argument, replicated on every device of the mesh: put on this
        process's devices only (``jax.device_put`` of a host value to a sharding over
        every process checks it is equal everywhere, a collective of its own each call)."""
        scalar = np.float32(value)
        here = [jax.device_put(scalar, d) for d in self.local_devices]  # explicit copies
        return jax.make_array_from_single_device_arrays((), self.sharded.gathered, here)

    def host_grad(self, grad: jax.Array) -> GradPages:
        """A gradient slab copied to the host -> this process's pages (its devices'
        shards, in page order) as numpy views, no copy."""
        shards = sorted(grad.addressable_shards, key=lambda s: s.index[0].start or 0)
        return GradPages.of([s.data for s in shards])

    def host_sq(self, sq: jax.Array) -> float:
        """Per-page squared norms (sharded as the pages) -> the sum over this
        process's pages."""
        return float(
            sum(np.sum(np.asarray(s.data), dtype=np.float64) for s in sq.addressable_shards)
        )

    def sum_over_processes(self, value: float) -> float:
        if jax.process_count() == 1:
            return value
        parts = multihost_utils.process_allgather(np.float32(value))
        return float(np.sum(np.asarray(parts, np.float64)))

    def param_store(
        self, store: ParamStore, nvme_store, layouts: dict[str, SlabLayout], device_stages
    ) -> ParamStore:
        """Pages of this process's shards, handed out as global sharded slabs; kept in
        ``nvme_store`` when params are on NVMe; the device cache's stages
        (``device_stages``) in device memory."""
        cached = frozenset(device_stages)
        return ShardedParamStore(self, layouts, nvme_store, device_stages=cached)

    def describe(self, layouts: dict[str, SlabLayout]) -> list[str]:
        lay = max((v for k, v in layouts.items() if is_block(k)), key=lambda v: v.num_pages)
        first, n = self.own_pages(lay)
        lines = [
            f"zero-3: {self.degree} devices ({jax.process_count()} processes); a block's "
            f"{lay.num_pages} pages split {lay.num_pages // self.degree} per device; this "
            f"process holds pages [{first}, {first + n}) of each stage"
        ]
        if isinstance(lay, GroupedSlabLayout):
            for part in lay.parts:
                axes = axes_of(part.grouping.axis)
                what = "experts" if EXPERT_AXIS in axes else "split weights"
                what += "' slices" if MODEL_AXIS in axes else ""
                lines.append(
                    f"{part.groups} groups of {what} over the {' x '.join(axes)} axes x "
                    f"{part.shares} on the {' x '.join(part.grouping.share_axes)} axes: a "
                    f"device fetches its group's {part.layout.num_pages} pages"
                )
            lines.append(f"and every device the {lay.dense.num_pages} dense pages")
        return lines

    def step_metrics(self) -> dict[str, int]:
        """This step's collective traffic (called by the step, on its own thread)."""
        metrics = {
            "all_gather_bytes": int(self.comm["all_gather"]),
            "reduce_scatter_bytes": int(self.comm["reduce_scatter"]),
        }
        self.comm.clear()
        return metrics


class ShardedParamStore:
    """Compute-dtype pages of this process's shards, handed to the streaming runtime as the
    global ``(pages, page_elems)`` slab sharded over ``data`` in host memory. Pages are
    kept here (``offload.params=host``) or in ``inner`` (an ``NvmeParamStore`` of this
    process's page ranges); the device cache's stages (``device_stages``, each device's
    pages updated on it) here, each device's shard in its device memory."""

    def __init__(
        self, zero: Zero3, layouts: dict[str, SlabLayout], inner=None, device_stages=frozenset()
    ):
        self.zero, self.layouts, self.inner = zero, layouts, inner
        self.device_stages = device_stages
        self.slabs: dict[str, jax.Array] = {}
        self._host = [
            SingleDeviceSharding(d, memory_kind="pinned_host") for d in zero.local_devices
        ]
        self._device = [SingleDeviceSharding(d, memory_kind="device") for d in zero.local_devices]

    def _assemble(self, stage: str, pages: list) -> jax.Array:
        layout = self.layouts[stage_layout(stage)]
        shape = (layout.num_pages, layout.page_elems)
        if stage in self.device_stages:  # each device's pages, where it updated them
            n = len(pages) // len(self._device)
            arrays = [
                jax.device_put(jnp.stack(pages[i * n : (i + 1) * n]), s)
                for i, s in enumerate(self._device)
            ]
            return jax.make_array_from_single_device_arrays(
                shape, self.zero.sharded.slab_device, arrays
            )
        rows = np.stack([np.asarray(p) for p in pages])  # (own pages, page_elems)
        per_device = np.split(rows, len(self._host))
        arrays = jax.device_put(per_device, self._host)
        return jax.make_array_from_single_device_arrays(shape, self.zero.sharded.slab_host, arrays)

    def _here(self, stage: str) -> bool:
        return self.inner is None or stage in self.device_stages

    def publish(self, stage: str, pages: list) -> None:
        if self._here(stage):
            self.slabs[stage] = self._assemble(stage, pages)
        else:
            self.inner.publish(stage, pages)

    def refresh(self, stage: str, pages_of) -> None:
        """A stage's committed params changed outside an update (deferred updates caught
        up): ``pages_of()`` gives this process's new pages."""
        if self._here(stage):
            self.publish(stage, pages_of())
        else:
            self.inner.refresh(stage, pages_of)

    def prefetch(self, stage: str) -> None:
        if not self._here(stage):
            self.inner.prefetch(stage)

    def ready(self, stage: str) -> bool:
        """Whether ``stage`` can be copied in without waiting. The prefetch window
        dispatches a stage's gather (a collective) when it is ready, and processes must
        dispatch their collectives in one order (else they pair the wrong ones and hang,
        or fail on a size mismatch): across processes, a read's landing, which is timing,
        never decides it, only what holds on every process."""
        if self._here(stage):
            return True
        return jax.process_count() == 1 and self.inner.ready(stage)

    def get(self, stage: str, keep: bool = False) -> jax.Array:
        if self._here(stage):
            return self.slabs[stage]
        return self._assemble(stage, self.inner.get(stage, keep))

    def device_arrays(self) -> list[jax.Array]:
        """The device cache's param slabs (in device memory), for the ledger."""
        return [self.slabs[s] for s in self.device_stages if s in self.slabs]

    def commit(self) -> None:
        if self.inner is not None:
            self.inner.commit()

    def abort(self) -> bool:
        """True: pages here are published in place (a dropped step's are republished)."""
        if self.inner is None:
            return True
        return self.inner.abort() or bool(self.device_stages)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def host_bytes(self) -> int:
        host = [a for stage, a in self.slabs.items() if stage not in self.device_stages]
        own = sum(s.data.nbytes for a in host for s in a.addressable_shards)
        return own + (self.inner.host_bytes() if self.inner is not None else 0)

    @property
    def nvme_bytes(self) -> int:
        return self.inner.nvme_bytes if self.inner is not None else 0

    @property
    def read_bytes(self) -> int:
        return self.inner.read_bytes if self.inner is not None else 0

    @property
    def write_bytes(self) -> int:
        return self.inner.write_bytes if self.inner is not None else 0
