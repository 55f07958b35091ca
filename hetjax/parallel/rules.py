"""The mesh and its logical-axis rules: how ``config.distributed`` splits every array.

The mesh has three axes, ``data``, ``expert`` and ``model`` (:func:`data_mesh`). Models
name a logical axis per dimension of every param leaf (``models/staged.py``'s
``logical_axes``) and of activations (``batch``); :data:`RULES`, the one table
(MaxText's ``logical_axis_rules``), maps each name to the mesh axis it is split over:
the batch over data x expert, a mixture of experts' experts over ``expert``, and
Megatron's split (attention by heads, the MLP by its hidden units, the vocabulary) over
``model``. An axis of size 1 is a no-op: with ``distributed.tensor_parallel`` 1 the
``model`` axis splits nothing, and the rules read as if its names were whole.

Two mappings are derived from the one table and the mesh's sizes (Levanter's compute
vs parameter axis mappings), both here:

* the compute mapping (:class:`Split`'s ``rules`` and :meth:`Split.param_specs`): how a
  stage function holds each param while it computes (the stage functions are manual
  over the batch axes, XLA's partitioner splits the ``model`` axis);
* the storage mapping (:attr:`Split.page_axes`): the mesh axes a stage's pages split
  over (ZeRO-3: every device of the mesh), a grouped part's pages over its grouping's
  share axes (``parallel/grouped.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.config import ConfigError

DATA_AXIS = "data"
EXPERT_AXIS = "expert"  # the mesh axis a mixture of experts' experts are split over
MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits weights over
MESH_AXES = (DATA_AXIS, EXPERT_AXIS, MODEL_AXIS)
BATCH_AXES = (DATA_AXIS, EXPERT_AXIS)  # the batch split over both
PAGE_AXES = (*BATCH_AXES, MODEL_AXIS)  # ZeRO-3's pages: over every device of the mesh

Rules = tuple[tuple[str, Any], ...]

# The one rule table: logical axis name -> the mesh axis it is split over (a tuple: over
# several; None: whole on every device). A name the table does not know is an error.
RULES: Rules = (
    ("batch", BATCH_AXES),
    ("expert", EXPERT_AXIS),  # expert parallelism: a group of experts per expert row
    # tensor parallelism (Megatron's split); the model axis of size 1: whole
    ("vocab", MODEL_AXIS),
    ("heads", MODEL_AXIS),
    ("kv_heads", MODEL_AXIS),
    ("mlp", MODEL_AXIS),
    # never split: the model width, a group's stacked layers, fused q|k|v columns (not
    # head-major), learned positions, T5's position buckets, a router's expert scores
    ("embed", None),
    ("layers", None),
    ("qkv", None),
    ("position", None),
    ("buckets", None),
    ("router", None),
    ("head_dim", None),  # a head's features (Qwen3's q/k norms, shared by every head)
)


def rules_for(tensor_parallel: int) -> Rules:
    """:data:`RULES` on a mesh whose ``model`` axis has ``tensor_parallel`` devices: of
    size 1 the axis is a no-op, and the names it would split are whole. (The batch axes
    stay named at any size: the stage functions are manual over them.)"""
    if tensor_parallel > 1:
        return RULES
    return tuple((name, None if axis == MODEL_AXIS else axis) for name, axis in RULES)


def mesh_axes(logical: tuple[str | None, ...], rules: Rules = RULES) -> tuple:
    """Logical axis names (one per dimension; None: unnamed) -> the mesh axis each
    dimension is split over under ``rules`` (None: whole), the entries of a
    ``PartitionSpec``. A name the rules do not know is an error, not replicated."""
    table = dict(rules)
    unknown = [name for name in logical if name is not None and name not in table]
    if unknown:
        raise KeyError(f"logical axes {unknown} have no rule (known: {sorted(table)})")
    return tuple(None if name is None else table[name] for name in logical)


def leaf_specs(model, shapes: Any, tensor_parallel: int = 1) -> Any:
    """The ``PartitionSpec`` of each param leaf of ``model`` (``shapes``: its ``init``
    tree, abstract) on a mesh of ``tensor_parallel`` devices a model group: its logical
    axes under :func:`rules_for`. The in-memory runtime places its state by them
    (``parallel/in_memory.py``) and the planner counts what a device holds from them
    (``planning/in_memory.py``); no mesh is needed."""
    import jax
    from jax.sharding import PartitionSpec

    from models.staged import logical_axes

    rules = rules_for(tensor_parallel)
    names = logical_axes(model, shapes)
    is_names = lambda n: isinstance(n, tuple)
    return jax.tree.map(lambda n: PartitionSpec(*mesh_axes(n, rules)), names, is_leaf=is_names)


def param_specs(model, tensor_parallel: int, shapes=None) -> dict[str, Any]:
    """The compute mapping of the streaming runtime's stages: each stage's params'
    ``PartitionSpec``s over the ``model`` axis only (the stage functions are manual over
    the others), a group's blocks without their stacked layer axis, by stage (``embed``,
    each group's name, ``head``). Empty with a ``model`` axis of size 1: nothing splits."""
    if tensor_parallel <= 1:
        return {}
    import jax
    from jax.sharding import PartitionSpec

    from models.staged import logical_axes

    is_names = lambda n: isinstance(n, tuple)
    on_model = lambda axis: MODEL_AXIS if axis == MODEL_AXIS else None
    spec = lambda names: PartitionSpec(*map(on_model, mesh_axes(names, RULES)))
    names = logical_axes(model, shapes)
    specs = {"embed": jax.tree.map(spec, names["embed"], is_leaf=is_names)}
    for g in model.groups:
        specs[g.name] = jax.tree.map(lambda n: spec(n[1:]), names[g.key], is_leaf=is_names)
    specs["head"] = jax.tree.map(spec, names["head"], is_leaf=is_names)
    return specs


@dataclasses.dataclass(frozen=True)
class Split:
    """How a mesh of ``data`` x ``expert`` x ``model`` devices splits a streamed run:
    the compute mapping (``rules``) and the storage mapping (``page_axes``)."""

    data: int
    expert: int
    model: int

    @classmethod
    def of_mesh(cls, mesh) -> Split:
        return cls(*(mesh.shape[a] for a in MESH_AXES))

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.model

    @property
    def rules(self) -> Rules:
        return rules_for(self.model)

    @property
    def page_axes(self) -> tuple[str, ...]:
        """The mesh axes a stage's pages split over: every device; a ``model`` axis of
        size 1 is left out (the batch axes' split)."""
        return PAGE_AXES if self.model > 1 else BATCH_AXES

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes a stage function is manual over (``shard_map``): the batch axes;
        the ``model`` axis is XLA's to split where it has more than one device."""
        return frozenset(BATCH_AXES if self.model > 1 else MESH_AXES)

    @property
    def expert_axis(self) -> str | None:
        """The mesh axis a MoE block's experts split over, if they do."""
        return dict(RULES)["expert"] if self.expert > 1 else None


def data_mesh(degree: int, expert_parallel: int = 1, tensor_parallel: int = 1):
    """A mesh (axes ``data``, ``expert``, ``model``) of ``degree`` x ``expert_parallel``
    x ``tensor_parallel`` devices (``degree`` 0: every device of every process, the
    others' product on each row). The devices are taken in process order, row by row
    (``model`` innermost: a block's split stays within a process's devices where it
    can), so each process's devices are contiguous in the mesh's flat order."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()  # ordered by process
    experts, model = expert_parallel, tensor_parallel
    row = experts * model
    if not degree and len(devices) % row:
        key = "expert_parallel" if model == 1 else "tensor_parallel"
        raise ConfigError(
            f"config key 'distributed.{key}' ({row}) must divide the device "
            f"count ({len(devices)}) when distributed.data_parallel is 0 (every device); "
            "change one of them"
        )
    n = degree * row or len(devices)
    if n > len(devices):
        key = "data_parallel" if row == 1 else "data_parallel x expert_parallel x tensor_parallel"
        raise ConfigError(
            f"config key 'distributed.{key}' asks for {n} devices but {len(devices)} "
            f"exist; lower it, or on CPU start with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    if jax.process_count() > 1 and n != len(devices):
        raise ConfigError(
            f"config key 'distributed.data_parallel' ({degree}): with "
            f"{jax.process_count()} processes every device takes part; set it to 0 or "
            f"{len(devices) // row}"
        )
    return Mesh(np.array(devices[:n]).reshape(n // row, experts, model), MESH_AXES)
