"""``offload.mode=none`` as the planner sees it on a data x expert x model mesh: what one
device holds and what its step sends (``runtime/in_memory.py``, whose state
``parallel/in_memory.py`` places).

Each param leaf is split as the runtime splits it: its logical axes under the streaming
runtime's rules (``parallel/rules.py``'s ``leaf_specs``, the one table both read): under tensor
parallelism M attention by heads, the MLP by its hidden units and the vocabulary 1/M a
device, under expert parallelism X the stacked experts 1/X, every other leaf whole, and
every leaf whole over ``data``. The fp32 gradients and the optimizer state mirror the
params. The activations are those of a device's rows as the streaming planner counts
them at the same split (``Workload.from_config(..., devices, tensor)``: boundaries of a
data group's rows, a block's kept residuals as held on a device, the working set).

The step's collectives (XLA's partitioner adds them): each gradient leaf all-reduced
over the batch axes it is replicated on (ring: 2(r-1)/r of its bytes a device sends,
r its replicas), once a step after the micro-batches' sums; and under tensor
parallelism Megatron's all-reduces of every block (``split.allreduce_bytes``)."""

from __future__ import annotations

import dataclasses
import math

import jax

from hetjax.config import Config
from hetjax.memory_host import in_memory_parts
from hetjax.parallel.rules import BATCH_AXES, DATA_AXIS, EXPERT_AXIS, MODEL_AXIS, leaf_specs
from hetjax.planning.workload import Workload, memory_sizes
from models import build_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshShare:
    """One device's share of an in-memory run's state on a data x expert x model mesh
    (``data`` x ``expert`` x ``tensor`` devices): ``params`` elements of the params it
    holds (its gradients and optimizer state mirror them), of which ``allreduced``
    elements' worth its gradients' all-reduce over the batch axes sends (each leaf's
    held elements times 2(r-1)/r, r the devices it is replicated on over data x
    expert)."""

    data: int = 1
    expert: int = 1
    tensor: int = 1
    params: int
    allreduced: float = 0.0

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.tensor


def mesh_share(config: Config, devices: int = 1, tensor: int = 1) -> MeshShare:
    """The share of ``config``'s model one of ``devices`` devices holds with
    ``offload.mode=none``, ``tensor`` of them a model group and, on several devices,
    ``distributed.expert_parallel`` splitting the experts; from abstract shapes."""
    model = build_model(config.model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    specs = leaf_specs(model, shapes, tensor)
    expert = config.distributed.expert_parallel if devices > 1 else 1
    size = {DATA_AXIS: devices // (expert * tensor), EXPERT_AXIS: expert, MODEL_AXIS: tensor}
    params, allreduced = 0, 0.0
    for shape, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs), strict=True):
        axes = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
        held = math.prod(shape.shape) // math.prod(size[a] for a in axes)
        replicas = math.prod(size[a] for a in BATCH_AXES if a not in axes)
        params += held
        allreduced += held * 2 * (replicas - 1) / replicas
    return MeshShare(
        data=size[DATA_AXIS], expert=expert, tensor=tensor, params=params, allreduced=allreduced
    )


def model_group_in_process(devices: int, tensor: int) -> bool:
    """Whether a model group of ``tensor`` devices lies within one process of a run on
    ``devices`` (split evenly over ``jax.process_count()``): offload.mode=none's model
    group shares its rows, which one process reads (``parallel.in_memory._check_processes``).
    A plan from a profile is one process's."""
    return (devices // jax.process_count()) % tensor == 0


def in_memory_device_parts(w: Workload, share: MeshShare | None, remat: bool) -> dict[str, int]:
    """Device bytes of ``offload.mode=none`` on one device of ``share``'s mesh, by what
    they hold (``memory_host.in_memory_parts``): its params, fp32 gradients and
    optimizer state, and the activations of its rows (``w``: the workload at the same
    split; ``share`` None: one device's whole state, as the workload's slabs). What
    ``offload.mode=auto`` decides "fits" by and the planner's footprint."""
    return in_memory_parts(memory_sizes(w), remat, params=share.params if share else None)
