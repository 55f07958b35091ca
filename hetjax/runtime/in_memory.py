"""The in-memory reference runtime (``offload.mode=none``): the whole state on the device
and one jitted step with gradient accumulation. It is the reference every offloaded mode
is tested against, so it is kept plain.

On a mesh (``distributed.*`` != 1) the state is placed by the streaming runtime's
logical-axis rules (``parallel/in_memory.py``) and the one jitted step computes under those
shardings, XLA's partitioner (GSPMD) adding the collectives:

* data parallelism (``distributed.data_parallel`` != 1, any number of processes): the
  state replicated on every device, each micro-batch's rows split over them (each
  process passes its own rows, ``data.py``), XLA's all-reduce summing the gradients;
* tensor parallelism (``distributed.tensor_parallel`` M > 1, with data parallelism a
  data x model mesh): params and optimizer state split over the ``model`` axis as
  Megatron splits them (attention by heads, the MLP by its hidden units, the
  vocabulary: ``parallel/rules.py``), whole over ``data``; the rows
  split over the data axis, the M devices of a model group computing on the same rows;
* expert parallelism (``distributed.expert_parallel`` X > 1, a mixture of experts): each
  block's stacked experts split over the ``expert`` axis, the rest replicated, the rows
  split over data x expert. The model is the plain one (no ``shard_map``, no
  all-to-all): XLA brings the routed rows to every device, each computes its own
  experts on them, and sums the results (no expert weight is gathered).

Checkpoints hold the whole state, so a run resumes at any other split (one device
included)."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from hetjax import timeline
from hetjax.config import Config, ConfigError
from hetjax.data import split_window, window_length
from hetjax.hf import open_checkpoint
from hetjax.optimizer.build import build_optimizer, optax_tree_slots
from hetjax.optimizer.moments import decode_state, encode_state
from hetjax.parallel.in_memory import MeshShardings, put, whole
from hetjax.state_format import moment_format
from hetjax.types import MASTER, LossScale, RuntimeState, StepReport
from models import build_model


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale | None


class InMemoryRuntime:
    """The whole state on the default device, or on a mesh as ``MeshShardings`` places
    it; one jitted step with gradient accumulation."""

    def __init__(self, config: Config, params: Any | None = None):
        self.config = config
        self.model = build_model(config.model)
        rng = jax.random.key(config.train.seed)
        if params is None and config.model.init_from:
            params = open_checkpoint(config.model).params()
        fp16 = config.model.compute_dtype == "float16"
        t = config.train
        loss_scale = LossScale.create(t.loss_scale_init, t.loss_scale_period) if fp16 else None
        # on a mesh: each leaf split as the logical-axis rules say (parallel/in_memory.py),
        # the rows split over the batch axes (a training batch's second axis, an
        # evaluation batch's first); None: everything on the default device
        self.mesh_shardings = mesh = None
        shapes = jax.eval_shape(self.model.init, rng)
        self.tx = build_optimizer(config.optimizer, config.train.steps, shapes)
        if config.distributed.sharded:
            self.mesh_shardings = mesh = MeshShardings.of(config, self.model, self.tx)
        # initialised straight into its shardings (the same values on any split: JAX's
        # random bits do not depend on the sharding)
        param_shardings = mesh.params if mesh else None
        if params is None:
            params = jax.jit(self.model.init, out_shardings=param_shardings)(rng)
        elif mesh:
            params = put(params, mesh.params)
        else:
            params = jax.device_put(params)
        opt_shardings = mesh.opt_state if mesh else None
        opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(params)
        self.state = TrainState(jnp.int32(0), params, opt_state, loss_scale)
        self._shardings = self._replicated = self._rows = self._eval_rows = None
        if mesh:
            self._shardings = mesh.state(self.state)
            self._replicated, self._rows = mesh.replicated, mesh.rows
            self._eval_rows = mesh.eval_rows
            self.state = self.state.replace(
                step=put(self.state.step, self._replicated),
                loss_scale=put(loss_scale, self._shardings.loss_scale),
            )
        objective, T = config.data.objective, config.train.seq_len
        step = functools.partial(
            step_fn,
            self.model,
            self.tx,
            objective=objective,
            seq_len=T,
            grad_shardings=param_shardings,
        )
        out_shardings = (self._shardings, self._replicated) if mesh else None
        self._step = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
        self._eval = jax.jit(lambda p, b: self.model.loss(p, *split_window(objective, b, T)))

    @staticmethod
    def _global(tree: Any, sharding: NamedSharding | None) -> Any:
        """``tree`` (this process's rows) as arrays of ``sharding`` over the mesh (None:
        as it is), each process giving its own part (of a replicated sharding: the
        whole, the same on every process). No collective: ``jax.device_put`` to a
        sharding over several processes would check the values are equal across
        them."""
        if sharding is None:
            return tree
        one = lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a))
        return jax.tree.map(one, tree)

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
        return whole(self.state.params)

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
        params = whole(self.state.params)  # a checkpoint holds the whole state
        n = len(jax.tree.leaves(params))
        leaves = jax.tree.leaves(whole(self._saved_opt_state()))
        trees, scalars, i = {MASTER: params}, [], 0
        treedef = jax.tree.structure(params)
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
        self.state = put(state, self._shardings) if self.mesh_shardings else state


def step_fn(
    model,
    tx,
    state: TrainState,
    batch: jax.Array,
    poison: jax.Array,
    guard: jax.Array,
    objective: str = "lm",
    seq_len: int = 0,
    grad_shardings: Any = None,
):
    """One optimizer step of ``model`` with optax ``tx`` on a global batch (A, B/A, W) of
    windows (``data.objective``'s, ``hetjax/data.py``; ``seq_len`` the encoder's
    tokens where the objective has an encoder): gradients summed over the A
    micro-batches, averaged, applied unless not finite or a loss spike. ``guard`` (2,):
    the loss limit (a greater loss is a spike, the loop's ``train.spike_factor``) and a
    gain the loss is multiplied by first (1; a fault injects a spike with more).
    ``grad_shardings``: the summed gradients' placement on a mesh (the params'), None:
    XLA's choice."""
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
    if grad_shardings is not None:  # split as the params, not gathered whole
        zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
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
