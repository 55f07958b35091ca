"""Where the in-memory runtime (``offload.mode=none``, ``runtime/in_memory.py``) puts its
state and rows on a data x expert x model mesh (``distributed.*`` != 1).

Each param leaf is split as its logical axes say (``models/staged.py``'s
``logical_axes``) under the one rule table (``rules.leaf_specs``, as ``zero.Zero3``
reads it): under tensor parallelism attention by heads, the MLP by its
hidden units and the vocabulary over the ``model`` axis (Megatron's split), under
expert parallelism a mixture of experts' stacked experts over the ``expert`` axis, and
whole over ``data`` (replicated). The optimizer state mirrors the params (each
params-shaped subtree of the optax state takes the params' shardings; int8 moments
their codes, ``optimizer/moments.py``, with the block scales whole on every device).
A micro-batch's rows split over the batch axes (``distributed.BATCH_AXES``). The one
jitted step then computes under these shardings and XLA's partitioner (GSPMD) adds the
collectives: the gradients' all-reduce over the data axes, Megatron's all-reduces over
``model``, under expert parallelism the routed rows brought to every expert's device
and the results summed (the expert weights stay split).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.config import Config, ConfigError
from hetjax.optimizer.moments import Int8Blocks
from hetjax.parallel.rules import BATCH_AXES, EXPERT_AXIS, MODEL_AXIS, data_mesh, leaf_specs

_KEYS = {MODEL_AXIS: "tensor_parallel", EXPERT_AXIS: "expert_parallel"}


@dataclasses.dataclass(frozen=True)
class MeshShardings:
    """The shardings of an in-memory run over ``mesh``: ``params`` and ``opt_state``
    (trees of ``NamedSharding``, the state's structure), ``replicated`` (a scalar's),
    ``rows`` (a training batch (A, B/A, W): its second axis split) and ``eval_rows``
    (an evaluation batch (B, W): its first)."""

    mesh: Mesh
    params: Any
    opt_state: Any
    replicated: NamedSharding
    rows: NamedSharding
    eval_rows: NamedSharding

    @classmethod
    def of(cls, config: Config, model, tx) -> MeshShardings:
        """The placement of ``model`` (its ``init`` tree) and of optax ``tx``'s state
        over ``config.distributed``'s mesh. A leaf whose split axis the mesh does not
        divide, or a micro-batch whose rows do not divide over the batch axes, is a
        ``ConfigError`` naming the key."""
        dist = config.distributed
        mesh = data_mesh(dist.data_parallel, dist.expert_parallel, dist.tensor_parallel)
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        specs = leaf_specs(model, shapes, dist.tensor_parallel)
        check = lambda path, shape, spec: _check_divides(mesh, path, shape, spec)
        jax.tree_util.tree_map_with_path(check, shapes, specs)
        replicated = NamedSharding(mesh, PartitionSpec())
        params = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        rows = math.prod(mesh.shape[a] for a in BATCH_AXES)
        if config.train.micro_batch_size % rows:
            raise ConfigError(
                f"config key 'train.batch_size' ({config.train.batch_size}): its "
                f"micro-batches of {config.train.micro_batch_size} rows must divide evenly "
                f"over the mesh's {rows} data x expert devices; make batch_size / "
                "grad_accum a multiple of it"
            )
        _check_processes(mesh)
        opt_state = mirror(jax.eval_shape(tx.init, shapes), shapes, params, replicated)
        return cls(
            mesh,
            params,
            opt_state,
            replicated,
            NamedSharding(mesh, PartitionSpec(None, BATCH_AXES)),
            NamedSharding(mesh, PartitionSpec(BATCH_AXES)),
        )

    def state(self, state: Any) -> Any:
        """The shardings of a ``TrainState`` (``in_memory.py``) of this placement."""
        whole = lambda tree: jax.tree.map(lambda _: self.replicated, tree)
        return state.replace(
            step=self.replicated,
            params=self.params,
            opt_state=self.opt_state,
            loss_scale=whole(state.loss_scale),
        )


def mirror(
    opt_shapes: Any, param_shapes: Any, param_shardings: Any, replicated: NamedSharding
) -> Any:
    """The shardings of an optax state (``opt_shapes``, its ``eval_shape``) that follow
    the params': each subtree shaped as the params (their structure and shapes; an
    int8 moment's codes, ``Int8Blocks``) takes ``param_shardings``, every other leaf
    (step counts, block scales) ``replicated``."""
    treedef = jax.tree.structure(param_shapes)
    shapes = [a.shape for a in jax.tree.leaves(param_shapes)]
    is_blocks = lambda x: isinstance(x, Int8Blocks)
    shape = lambda x: x.codes.shape if is_blocks(x) else x.shape

    def like_params(x) -> bool:
        leaves, td = jax.tree.flatten(x, is_leaf=is_blocks)
        return td == treedef and [shape(a) for a in leaves] == shapes

    def leaf(x, sharding):
        return Int8Blocks(sharding, replicated) if is_blocks(x) else sharding

    def place(x):
        if like_params(x):
            return jax.tree.map(leaf, x, param_shardings, is_leaf=is_blocks)
        return replicated

    return jax.tree.map(place, opt_shapes, is_leaf=like_params)


def put(tree: Any, shardings: Any) -> Any:
    """``tree`` (whole arrays, the same on every process) as global arrays of
    ``shardings``, each process placing only its own devices' shards: no collective
    (``jax.device_put`` to a sharding over several processes would check the values
    are equal across them)."""

    def one(a, sharding):
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: np.asarray(host[i]))

    return jax.tree.map(one, tree, shardings)


def whole(tree: Any) -> Any:
    """``tree``'s arrays as whole numpy arrays (copies) on every process: with several
    processes a split leaf is gathered (every process must call it)."""

    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        # np.array copies: on CPU a device_get can alias a buffer the next step donates
        return np.array(a)

    return jax.tree.map(one, tree)


def _check_divides(mesh: Mesh, path, shape: jax.ShapeDtypeStruct, spec: PartitionSpec) -> None:
    for dim, axis in enumerate(spec):
        for name in (axis,) if isinstance(axis, str) else axis or ():
            n = mesh.shape[name]
            if shape.shape[dim] % n:
                key = _KEYS.get(name, "data_parallel")
                raise ConfigError(
                    f"config key 'distributed.{key}' ({n}) must divide param "
                    f"{jax.tree_util.keystr(path)}'s axis {dim} ({shape.shape[dim]}), "
                    f"which the rules split over the {name!r} axis; choose a divisor of it"
                )


def _check_processes(mesh: Mesh) -> None:
    """Each process reads its own rows (``data.py``): the devices that share rows (a
    row of the mesh's ``model`` axis) must be one process's."""
    for group in mesh.devices.reshape(-1, mesh.shape[MODEL_AXIS]):
        if len({d.process_index for d in group}) > 1:
            raise ConfigError(
                f"config key 'distributed.tensor_parallel' ({mesh.shape[MODEL_AXIS]}): "
                "with offload.mode=none a model group's devices share their rows and must "
                "be one process's; make it divide each process's device count"
            )
