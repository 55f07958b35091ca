"""The in-memory reference runtime (``offload.mode=none``): the whole state on the device
and one jitted step with gradient accumulation. It is the reference every offloaded mode
is tested against, so it is kept plain.

Under data parallelism (``distributed.data_parallel`` != 1, any number of processes) it
is plain data parallelism: the state replicated on every device of the mesh, each
micro-batch's rows split over them (each process passes its own rows, ``data.py``), and
XLA's all-reduce summing the gradients inside the one jitted step. Expert and tensor
parallelism are the streaming runtime's (``support.py``)."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hetjax import timeline
from hetjax.config import Config, ConfigError
from hetjax.data import split_window, window_length
from hetjax.distributed import BATCH_AXES, data_mesh
from hetjax.hf import open_checkpoint
from hetjax.optimizer.build import build_optimizer, optax_tree_slots
from hetjax.optimizer.moments import decode_state, encode_state
from hetjax.optimizer.state_format import moment_format
from hetjax.types import MASTER, LossScale, RuntimeState, StepReport
from models import build_model


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale | None


class InMemoryRuntime:
    """Everything on the default device; one jitted step with gradient accumulation."""

    def __init__(self, config: Config, params: Any | None = None):
        self.config = config
        self.model = build_model(config.model)
        rng = jax.random.key(config.train.seed)
        if params is None and config.model.init_from:
            params = jax.device_put(open_checkpoint(config.model).params())
        if params is None:
            params = jax.jit(self.model.init)(rng)
        self.tx = build_optimizer(config.optimizer, config.train.steps, params)
        fp16 = config.model.compute_dtype == "float16"
        t = config.train
        self.state = TrainState(
            step=jnp.int32(0),
            params=params,
            opt_state=self.tx.init(params),
            loss_scale=LossScale.create(t.loss_scale_init, t.loss_scale_period) if fp16 else None,
        )
        # data parallelism: the state on every device, the rows split over them (a
        # training batch's second axis, an evaluation batch's first); None: the default
        # device
        self._replicated = self._rows = self._eval_rows = None
        if config.distributed.sharded:
            mesh = data_mesh(config.distributed.data_parallel)
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._rows = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))
            self._eval_rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
            self.state = self._global(self.state, self._replicated)
        objective, T = config.data.objective, config.train.seq_len
        step = functools.partial(step_fn, self.model, self.tx, objective=objective, seq_len=T)
        self._step = jax.jit(step, donate_argnums=0, out_shardings=self._replicated)
        self._eval = jax.jit(lambda p, b: self.model.loss(p, *split_window(objective, b, T)))

    @staticmethod
    def _global(tree: Any, sharding: NamedSharding | None) -> Any:
        """``tree`` as arrays of ``sharding`` over the mesh (None: as it is), each
        process giving its own part (of a replicated sharding: the whole, the same on
        every process). No collective: ``jax.device_put`` to a sharding over several
        processes would check the values are equal across them."""
        if sharding is None:
            return tree
        put = lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a))
        return jax.tree.map(put, tree)

    def train_step(
        self,
        batch: np.ndarray,
        poison: bool = False,
        loss_limit: float = math.inf,
        loss_gain: float = 1.0,
    ) -> StepReport:
        guard = np.array([loss_limit, loss_gain], np.float32)
        poison = np.float32(np.nan if poison else 1.0)
        batch, poison, guard = self._global(batch, self._rows), *self._global(
            (poison, guard), self._replicated
        )  # fmt: skip
        self.state, (loss, grad_norm, nonfinite, spike, scale) = self._step(
            self.state, batch, poison, guard
        )
        timeline.watch("compute", "train step", loss)
        nonfinite, spike, scale = bool(nonfinite), bool(spike), float(scale)
        fp16_overflow = nonfinite and self.state.loss_scale is not None and scale > 1
        return StepReport(
            float(loss),
            float(grad_norm),
            nonfinite or spike,
            scale,
            nonfinite=nonfinite and not fp16_overflow,
            spike=spike,
        )

    def eval_loss(self, batch: np.ndarray) -> float:
        return float(self._eval(self.state.params, self._global(batch, self._eval_rows)))

    def params(self) -> Any:
        # np.array copies: on CPU a device_get can alias a buffer the next step donates.
        return jax.tree.map(np.array, self.state.params)

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass

    def plan_lines(self) -> list[str]:
        return []  # one jitted step on the device: nothing was planned

    # -- checkpoints --------------------------------------------------------------------

    def _opt_slots(self) -> list[str | None]:
        return optax_tree_slots(self._saved_opt_state(), self.state.params)

    def _saved_opt_state(self) -> Any:
        """The optax state as a checkpoint holds it: moments in fp32 or bfloat16 as they
        are; int8 blocks as the fp32 values they hold (a checkpoint's pages are one
        dtype a kind, without block scales)."""
        if moment_format(self.config.optimizer.state_dtype).block_size is None:
            return self.state.opt_state
        return decode_state(self.state.opt_state)

    def save_state(self) -> RuntimeState:
        n = len(jax.tree.leaves(self.state.params))
        leaves = jax.tree.leaves(self._saved_opt_state())
        trees, scalars, i = {MASTER: self.state.params}, [], 0
        treedef = jax.tree.structure(self.state.params)
        for kind in self._opt_slots():
            if kind is None:
                scalars.append(np.array(leaves[i]))
                i += 1
            else:
                trees[kind] = jax.tree.unflatten(treedef, leaves[i : i + n])
                i += n
        ls = self.state.loss_scale
        loss_scale = (float(ls.scale), int(ls.good_steps)) if ls is not None else None
        return RuntimeState.from_trees(trees, scalars, loss_scale, self.model.groups)

    def load_state(self, state: RuntimeState) -> None:
        slots = self._opt_slots()
        kinds = [MASTER, *(k for k in slots if k)]
        if sorted(state.kinds) != sorted(kinds):
            raise ConfigError(
                f"the checkpoint holds the state kinds {state.kinds}, this run's optimizer "
                f"(optimizer.name={self.config.optimizer.name}) needs {kinds}: resume "
                "with the optimizer settings that wrote it, or start over with a new --workdir"
            )
        # Filled as fp32 moments and put in this run's format: a checkpoint of another
        # state dtype converts (bfloat16 widens exactly, fp32 rounds to nearest even,
        # int8 quantizes; ``moments.py``).
        template = decode_state(self.state.opt_state)
        old_leaves = jax.tree.leaves(template)
        scalars = iter(state.scalars["embed"])
        leaves: list[Any] = []
        i = 0
        for kind in slots:
            if kind is None:
                leaves.append(jnp.asarray(next(scalars), old_leaves[i].dtype))
                i += 1
            else:
                tree = state.kind_tree(kind)
                leaves += [jnp.asarray(a, jnp.float32) for a in jax.tree.leaves(tree)]
                i += len(jax.tree.leaves(tree))
        params = jax.tree.map(jnp.asarray, state.params())
        if jax.tree.structure(params) != jax.tree.structure(self.state.params):
            raise ConfigError("the checkpoint's params do not match this model's structure")
        loss_scale = self.state.loss_scale
        if loss_scale is not None and state.loss_scale is not None:
            loss_scale = loss_scale.replace(
                scale=jnp.float32(state.loss_scale[0]), good_steps=jnp.int32(state.loss_scale[1])
            )
        state = self.state.replace(
            params=params,
            opt_state=encode_state(
                jax.tree.unflatten(jax.tree.structure(template), leaves),
                moment_format(self.config.optimizer.state_dtype),
            ),
            loss_scale=loss_scale,
        )
        self.state = self._global(state, self._replicated)


def step_fn(
    model,
    tx,
    state: TrainState,
    batch: jax.Array,
    poison: jax.Array,
    guard: jax.Array,
    objective: str = "lm",
    seq_len: int = 0,
):
    """One optimizer step of ``model`` with optax ``tx`` on a global batch (A, B/A, W) of
    windows (``data.objective``'s, ``hetjax/data.py``; ``seq_len`` the encoder's
    tokens where the objective has an encoder): gradients summed over the A
    micro-batches, averaged, applied unless not finite or a loss spike. ``guard`` (2,):
    the loss limit (a greater loss is a spike, the loop's ``train.spike_factor``) and a
    gain the loss is multiplied by first (1; a fault injects a spike with more)."""
    scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
    seed = scale * poison  # the loss cotangent; poison is 1, or NaN to inject a fault

    def micro(grad_sum, windows):  # windows (B/A, W)
        tokens, targets = split_window(objective, windows, seq_len)

        def loss_fn(p):
            loss = model.loss(p, tokens, targets)
            return loss * seed, loss

        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grad_sum, losses = jax.lax.scan(micro, zeros, batch)  # batch (A, B/A, T+1)
    grads = jax.tree.map(lambda g: g / (batch.shape[0] * scale), grad_sum)
    grad_norm = optax.tree.norm(grads)
    loss = jnp.mean(losses) * guard[1]
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
    spike = finite & (loss > guard[0])

    def update(_):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    # A non-finite step (fp16 overflow, or divergence) or a loss spike leaves the state
    # as it was; the loss scale counts a spike as a finite step.
    params, opt_state = jax.lax.cond(
        finite & ~spike, update, lambda _: (state.params, state.opt_state), None
    )
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    if state.loss_scale is not None:
        new = new.replace(loss_scale=state.loss_scale.update(finite))
    return new, (loss, grad_norm, ~finite, spike, scale)


def step_device_bytes(config: Config) -> int:
    """Device bytes ``offload.mode=none`` needs for ``config``: XLA's memory analysis of
    the jitted train step (arguments + outputs - donated aliases + temporaries),
    compiled from abstract shapes, so nothing is allocated."""
    model = build_model(config.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    tx = build_optimizer(config.optimizer, config.train.steps, params)
    state = TrainState(
        jax.ShapeDtypeStruct((), np.int32), params, jax.eval_shape(tx.init, params), None
    )
    t = config.train
    window = window_length(config.data, t.seq_len)
    batch = jax.ShapeDtypeStruct((t.grad_accum, t.micro_batch_size, window), np.int32)
    objective = config.data.objective
    step = functools.partial(step_fn, model, tx, objective=objective, seq_len=t.seq_len)
    step = jax.jit(step, donate_argnums=0)
    scalar, guard = jax.ShapeDtypeStruct((), np.float32), jax.ShapeDtypeStruct((2,), np.float32)
    a = step.lower(state, batch, scalar, guard).compile().memory_analysis()
    return int(
        a.argument_size_in_bytes
        + a.output_size_in_bytes
        - a.alias_size_in_bytes
        + a.temp_size_in_bytes
    )
