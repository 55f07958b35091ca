"""Small shared types at the bottom of the package: what a step reports, the fp16 loss
scale, the placement-free training state, errors, and the Protocols runtimes and stores
implement. This module imports nothing else from hetjax but the error base
(``hetjax/errors.py``), so every layer can use it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from hetjax.errors import UserError

MASTER = "master"  # the fp32 master params' slab kind (optimizer state kinds follow it)


# -- errors ------------------------------------------------------------------------------


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says what to change."""


class DamagedPageError(TrainingError):
    """A live NVMe page read back is not what was written (its CRC-32C differs): silent
    corruption on the SSD (``storage/checksums.py``). The training loop adds which
    checkpoint holds a good copy, or rolls back to it."""

    def __init__(self, path, page: int, what: str, got: int, want: int):
        self.path, self.page, self.what = path, page, what
        super().__init__(
            f"NVMe page damaged: {path} (page {page} of {what}) reads with CRC-32C "
            f"{got:#010x}, was written with {want:#010x}"
        )


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written or read; the message says what to do. Earlier
    complete checkpoints are never touched by a failed save."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files are not what was saved (a page fails its CRC-32, or its
    index is missing): a run resuming from it falls back to the one before."""


# -- what a step reports ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerWork:
    """What the host update loop did, handed from its thread to the step that waited for
    it (sync mode) or that collected it (lock-free mode): counts of this span of work,
    except ``redo`` and ``deferred``, which count steps since the loop started."""

    busy_s: float = 0.0  # time the loop spent updating (overlapped with backward or not)
    params: int = 0  # parameters updated on the host (padded slabs, redos too)
    device_params: int = 0  # parameters of the device cache updated on the device
    redo: int = 0  # steps whose speculative update was redone with clipping
    deferred: int = 0  # steps updated after backward only (clipping bound the step before)

    def __add__(self, later: OptimizerWork) -> OptimizerWork:
        return OptimizerWork(
            self.busy_s + later.busy_s,
            self.params + later.params,
            self.device_params + later.device_params,
            later.redo,
            later.deferred,
        )


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one optimizer step did, built by the step: the training loop's metrics read
    it, nothing else is read back from the runtime."""

    loss: float  # mean token loss of the global batch
    grad_norm: float  # global L2 norm of the (unscaled, averaged) gradients
    skipped: bool = False  # the update was skipped (fp16 overflow, or non-finite)
    loss_scale: float = 1.0
    nonfinite: bool = False  # loss or gradient not finite beyond fp16 loss scaling
    spike: bool = False  # a finite loss over the step's loss limit (train.spike_factor)
    # The runtime's own measures of this step, as metrics.jsonl fields: bytes per tier
    # (device_bytes_peak, host_bytes, nvme_bytes), NVMe I/O (nvme_read_bytes,
    # nvme_write_bytes), optimizer work and waits (optimizer_s, optimizer_busy_s,
    # optimizer_params, ...), collectives (all_gather_bytes, reduce_scatter_bytes).
    metrics: dict[str, float | int] = dataclasses.field(default_factory=dict)


@flax.struct.dataclass
class LossScale:
    """Dynamic loss scale for fp16 compute: halve and skip the step on overflow; double
    after ``period`` steps without one."""

    scale: jax.Array
    good_steps: jax.Array
    period: int = flax.struct.field(pytree_node=False, default=1000)

    @classmethod
    def create(cls, init: float, period: int) -> LossScale:
        return cls(jnp.float32(init), jnp.int32(0), period)

    def update(self, finite: jax.Array) -> LossScale:
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(
            finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0)
        )
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good)


# -- the placement-free state -----------------------------------------------------------


# A model's stages are embed, the blocks of each of its stage groups in forward order, and
# head (models/staged.py). A group's blocks are stages "<name><i>" whose slabs have layout
# "<name>"; its params are stacked in the model's tree under group_key(name): a
# decoder-only model's one group is "block" (key "blocks"), an encoder-decoder model's
# "encoder" and "decoder".


def group_key(name: str) -> str:
    """The params-tree key of the group whose blocks are stages ``<name><i>``."""
    return "blocks" if name == "block" else name


def stage_layout(stage: str) -> str:
    """The slab layout of a stage: ``embed``, ``head``, or its group's name
    (``block3`` -> ``block``, ``decoder0`` -> ``decoder``)."""
    return stage.rstrip("0123456789")


def is_block(stage: str) -> bool:
    """Whether ``stage`` is a block of some group (not embed or head)."""
    return stage not in ("embed", "head")


def stage_names(groups: list[tuple[str, int]]) -> list[str]:
    """embed, ``(name, num_layers)`` groups' blocks in order, head."""
    blocks = [f"{name}{i}" for name, layers in groups for i in range(layers)]
    return ["embed", *blocks, "head"]


def stages_tree(stages: dict[str, Any]) -> dict[str, Any]:
    """Per-stage trees (``{"embed": ..., "block0": ..., "head": ...}``) -> the model's
    tree, each group's blocks stacked on a leading axis under its key."""
    groups: dict[str, list] = {}
    for name, tree in stages.items():
        if is_block(name):
            groups.setdefault(group_key(stage_layout(name)), []).append(tree)
    stacked = {k: jax.tree.map(lambda *xs: np.stack(xs), *v) for k, v in groups.items()}
    return {"embed": stages["embed"], **stacked, "head": stages["head"]}


@dataclasses.dataclass
class RuntimeState:
    """A runtime's complete state in the placement-free form (host numpy arrays).

    ``stages[stage][kind]`` is that stage's params pytree of kind ``kind`` (``master``
    is the fp32 params); ``scalars[stage]`` the optax scalars of its state, in optax's
    leaf order; ``loss_scale`` the fp16 ``(scale, good_steps)`` or None."""

    stages: dict[str, dict[str, Any]]
    scalars: dict[str, list[np.ndarray]]
    loss_scale: tuple[float, int] | None = None

    @property
    def kinds(self) -> list[str]:
        return list(next(iter(self.stages.values())))

    def params(self) -> dict[str, Any]:
        """The master params as the model's pytree (``blocks`` stacked on axis 0)."""
        return self.kind_tree(MASTER)

    def kind_tree(self, kind: str) -> dict[str, Any]:
        return stages_tree({name: state[kind] for name, state in self.stages.items()})

    @classmethod
    def from_trees(
        cls, trees: dict[str, Any], scalars: list[np.ndarray], loss_scale=None, groups=None
    ) -> RuntimeState:
        """From whole-model trees by kind (``{"master": params, "mu": ...}``, each
        group's blocks stacked) and one set of scalars shared by every stage. ``groups``:
        the model's stage groups in forward order (``models.staged.StageGroup``, their
        ``name``), by default the one group ``block``."""
        names = [g.name for g in groups] if groups is not None else ["block"]
        layers = {n: jax.tree.leaves(trees[MASTER][group_key(n)])[0].shape[0] for n in names}
        stages: dict[str, dict[str, Any]] = {}
        for name in stage_names([(n, layers[n]) for n in names]):
            stages[name] = {}
            for kind, tree in trees.items():
                if is_block(name):
                    i = int(name[len(stage_layout(name)) :])
                    blocks = tree[group_key(stage_layout(name))]
                    stages[name][kind] = jax.tree.map(lambda a, i=i: np.array(a[i]), blocks)
                else:
                    stages[name][kind] = jax.tree.map(np.array, tree[name])
        per_stage = {name: [np.array(s) for s in scalars] for name in stages}
        return cls(stages, per_stage, loss_scale)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves((self.stages, self.scalars)))


# -- protocols ---------------------------------------------------------------------------


class Runtime(Protocol):
    def train_step(
        self,
        batch: np.ndarray,
        poison: bool = False,
        loss_limit: float = math.inf,
        loss_gain: float = 1.0,
    ) -> StepReport:
        """One optimizer step on a global batch of shape (A, B/A, W) int32 (windows of
        ``data.objective``, ``hetjax/data.py``: W = T+1 for ``lm``). A step
        whose loss or gradient is not finite changes no state, nor does one whose loss
        exceeds ``loss_limit`` (a spike: ``StepReport.spike``). ``poison`` (fault
        injection for tests) makes the step's gradients NaN; ``loss_gain`` (likewise)
        multiplies the loss before it is compared with the limit."""

    def eval_loss(self, batch: np.ndarray) -> float:
        """Mean token loss of a (B, W) batch with the current params."""

    def params(self) -> Any:
        """The current fp32 params as a host (numpy) pytree."""

    def settle(self) -> None:
        """Finishes outstanding optimizer work (lock-free mode) and writes cached state
        out to its tier, so ``params`` and the files on disk hold the final state."""

    def close(self) -> None:
        """Stops background threads; ``params`` still works afterwards."""

    def plan_lines(self) -> list[str]:
        """The start-up plans (placements, budgets), one log line each."""

    def save_state(self) -> Any:
        """The complete state for a checkpoint: a :class:`RuntimeState` (host copies
        that later steps do not change) or a ``checkpoint_state.StateSource`` (the state
        where it lives, frozen until the checkpoint has written it)."""

    def load_state(self, state: Any) -> None:
        """Replaces the whole state (a resume or a rollback) from a
        :class:`RuntimeState` or a checkpoint's ``StoredState``."""


class StateStore(Protocol):
    """Where fp32 master params and optimizer state live between updates (device, host
    RAM or NVMe, ``storage/states.py``): per stage, a dict of slabs by kind plus the
    optax scalars. Updates are speculative until :meth:`commit`."""

    read_bytes: int  # bytes read from NVMe since the store was made (0 off NVMe)
    write_bytes: int  # bytes written to NVMe since the store was made

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None: ...
    def wait_init(self) -> None: ...
    def prefetch(self, stage: str) -> Any: ...
    def get(self, stage: str, handle: Any = None) -> tuple[dict, list]: ...
    def recycle(self, stage: str) -> tuple[dict | None, bool]: ...
    def put(self, stage: str, slabs: dict, scalars: list) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...
    def master(self, stage: str) -> np.ndarray: ...
    def freeze(self, stage: str) -> tuple[Any, list, Any]: ...
    def committed(self, stage: str) -> tuple[dict[str, np.ndarray], list]: ...
    def flush(self) -> None: ...
    def host_bytes(self) -> int: ...
    def device_bytes(self) -> int: ...
    @property
    def nvme_bytes(self) -> int: ...


class ParamStore(Protocol):
    """Where the compute-dtype params wait for the next forward (host RAM, NVMe or the
    device, ``storage/params.py``): published as each stage's pages, handed out as the
    placement's device takes them (one device: ``pages.LeafBuffers``; ZeRO-3: pages)."""

    read_bytes: int
    write_bytes: int

    def publish(self, stage: str, pages: list) -> None: ...
    def prefetch(self, stage: str) -> None: ...
    def ready(self, stage: str) -> bool: ...  # get(stage) would not wait for a read
    def get(self, stage: str, keep: bool = False) -> Any: ...
    def commit(self) -> None: ...
    def abort(self) -> bool: ...
    def close(self) -> None: ...
    def host_bytes(self) -> int: ...
    @property
    def nvme_bytes(self) -> int: ...


# -- parallelism ---------------------------------------------------------------------


class Kind:
    """What an argument or result of a stage function is, as its compute layout places
    it (the entries of a :class:`StageSignature`). One device places every kind alike;
    data parallelism (ZeRO-3) splits and reduces them as each says:

    ``PAGES``    a stage's params as the device computes with them (a list of pages,
                 leaf buffers, or an expert-parallel block's pages): whole on every
                 device, but a MoE block's experts, split as the placement's rules map
                 the ``expert`` axis. Arguments only.
    ``BATCH``    rows of the micro-batch: tokens (B, T), activations (B, T, D) and their
                 gradients, split on the leading axis as the rules map ``batch``.
    ``CONTEXT``  a stage group's context (``models/staged.py``) or its gradient: split on
                 the leading axis as ``BATCH`` (an activation in it by rows; a param in it,
                 which every device holds, as one copy per device).
    ``GRAD``     a gradient as it leaves the device (``grad_slab``: the pages and their
                 squared norms): each device its own share of the pages, summed over
                 the devices that computed it. Results only.
    ``WHOLE``    the same value on every device: a scalar argument (the loss scale, the
                 auxiliary loss's seed), statistics already averaged (``MEAN``).
    ``MEAN``     a mean over the micro-batch's rows (the loss, a block's auxiliary-loss
                 statistics): the mean of the devices' means, whole on every device.
                 Results only; as an argument it is ``WHOLE``.
    ``LOCAL``    a device's own value of any structure, never combined with another's
                 (a kept block's vjp, a swapped block's residuals): as a result, each
                 device's stacked on a new leading axis; as an argument, handed back to
                 the device that made it.
    """

    PAGES = "pages"
    BATCH = "batch"
    CONTEXT = "context"
    GRAD = "grad"
    WHOLE = "whole"
    MEAN = "mean"
    LOCAL = "local"


@dataclasses.dataclass(frozen=True)
class StageSignature:
    """The declared layout of a stage function: one :class:`Kind` per positional
    argument (trailing ones may be left out by a call, as defaults), and its results'
    kinds in the structure it returns them (a kind for a whole subtree: ``(Kind.MEAN,
    Kind.GRAD)`` for ``loss, (grad, norms)``; nested tuples for nested results)."""

    args: tuple[str, ...]
    results: Any


@runtime_checkable
class Parallelism(Protocol):
    """How the devices split a streamed run: one device (``parallel/single.py``'s
    ``SingleDevice``) or a mesh (``parallel/zero.py``'s ``Zero3``: pages sharded over
    it, data x expert x model). The streaming runtime is handed one (its ``parallel``)
    and never asks which; this is every member it and the stage functions use.

    Every stage function the streaming runtime runs, kept and swapped blocks' included,
    is compiled with :meth:`jit` from its declared :class:`StageSignature`, never from
    its arrays' ranks. The params' layout is declared by the model too: each leaf names
    its logical axes (``models/staged.py``'s ``logical_axes``) and ``axis_rules`` maps
    them (and ``batch``) to mesh axes (``parallel/rules.py``)."""

    shardings: Any  # this process's device, host and optimizer memory spaces
    expert_axis: str | None  # the mesh axis a MoE's experts are split over, if any
    # logical axis name -> mesh axis (or a tuple of them; None: whole on every device)
    axis_rules: tuple[tuple[str, Any], ...]
    nvme_subdir: str  # this process's directory under the NVMe path ("": the path)
    local_share: Any  # the fraction of a batch's rows (and per-device values) held here
    degree: int  # devices a stage's pages split over
    batch_degree: int  # devices a micro-batch's rows split over
    local_degree: int  # this process's devices, each holding its own pages of state
    tensor_parallel: int  # devices of the ``model`` axis, splitting a stage's compute

    @property
    def on_mesh(self) -> bool:
        """Whether a block's compute needs the mesh (expert parallelism's all-to-all,
        tensor parallelism's split weights)."""

    # -- the stages' layouts and the state's shares
    def stage_layouts(self, model: Any, page_size: int) -> dict[str, Any]:
        """The stages' slab layouts (``parallel/layouts.py``)."""

    def state_layouts(self, layouts: dict[str, Any]) -> dict[str, Any]:
        """The part of each stage's layout whose state this process holds."""

    def own_pages(self, layout: Any) -> tuple[int, int]:
        """(first page, number of pages) of a stage slab that this process holds."""

    def own_slab(self, layout: Any, slab: Any) -> Any:
        """A whole stage slab -> this process's pages of it."""

    def whole_slab(self, slab: Any) -> np.ndarray:
        """This process's pages of a stage slab -> the whole slab (every process's)."""

    def param_store(
        self, store: ParamStore, nvme_store: ParamStore | None, layouts: dict, device_stages
    ) -> ParamStore:
        """The param store the runtime reads stages from, over ``store`` (its NVMe part
        ``nvme_store`` where params are on NVMe; ``device_stages``: the device cache's)."""

    # -- compiling and running the stage functions
    def jit(self, fn: Any, signature: StageSignature) -> Any:
        """``fn`` compiled to run in this layout, its arguments and results placed as
        ``signature`` declares."""

    def per_device(self, fn: Any, signature: StageSignature, args: tuple) -> Any:
        """``fn(*args)`` traced on one device's part of ``args`` (global), as a stage
        function runs: the start-up measurements of a block on the mesh."""

    def device_pages(self, layout: Any, dtype: Any) -> Any:
        """A stage's abstract pages as a stage function gets them (to lower it with)."""

    def abstract_rows(self, x: Any) -> Any:
        """A ``BATCH`` argument's abstract value (shape, dtype, placement)."""

    def grad_slab(self, pages: Any, dtype: Any) -> Any:
        """Inside a stage function: the gradient of its pages as it leaves the device."""

    def constrain(self, stage: str, params: Any) -> Any:
        """Inside a stage function: stage ``stage``'s params tree as it computes with them
        (tensor parallelism: split over the mesh's ``model`` axis by their logical axes)."""

    def to_device(self, pages: Any, layout: Any = None) -> Any:
        """A stage's params from its store -> on the device(s) as the stage computes."""

    def swap_staging(self) -> Any:
        """Where the NVMe swaps' reads wait for their copy to the device (None: each
        device's share put on it)."""

    def put_batch(self, rows: np.ndarray) -> jax.Array:
        """This process's rows of a batch -> a ``BATCH`` argument."""

    def put_scalar(self, value: float) -> jax.Array:
        """An fp32 scalar -> a ``WHOLE`` argument."""

    # -- gradients to the host, and what the step reports
    def host_grad(self, grad: Any) -> Any:
        """A ``GRAD`` result's pages -> this process's gradient pages on the host."""

    def host_sq(self, sq: Any) -> float:
        """A ``GRAD`` result's per-page squared norms -> this process's sum."""

    def sum_over_processes(self, value: float) -> float:
        """A per-process value summed over every process."""

    def sent_grad(self, grad: Any, layout: Any = None) -> None:
        """A gradient slab of a stage with ``layout`` left the device (counted)."""

    def describe(self, layouts: dict[str, Any]) -> list[str]:
        """Lines for the run's start-up log: how the stages split."""

    def step_metrics(self) -> dict[str, int]:
        """This step's collective traffic, for the step's report."""
