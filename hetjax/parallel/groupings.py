"""The groupings of a stage's leaves: which leaves a device fetches and computes with
only a group of, and how they are cut into groups (``parallel/grouped.py`` lays a stage
out in parts, one per grouping; ``parallel/layouts.py`` decides which a stage gets).

* :class:`TensorGrouping` (``distributed.tensor_parallel`` M > 1): a stage's split
  weights, each cut into M slices on the axis the rules split over ``model``
  (``parallel/rules.py``: attention by heads, the MLP by its hidden units, the
  vocabulary), each slice in its own shape (a device's shard of the leaf, so that
  turning the pages into the leaf is a bitcast on the device, no transposed copy),
  slice m in the pages of the devices at ``model`` index m, so the gather brings each
  device only its slice (over its share axes) and the dense rest (norm scales, biases,
  unsplit weights: over every device). The biases a rule splits stay dense (whole on
  each device, split by the constraint): weight decay keeps one split point.
* :class:`ExpertGrouping` (``distributed.expert_parallel`` G > 1): a mixture of experts'
  experts (``models.staged.split_experts``: the model's ``expert_params``), E/G per
  device of the ``expert`` axis, shared over ``data``; nothing is moved (experts are the
  first axis).
* :class:`ExpertTensorGrouping` (both, a data x expert x model mesh): each expert
  group's weights cut further by the model axis's slices: device (s, e, m) holds share
  s of group e's slice m, gathered over ``data`` only, and computes its group's experts
  split over ``model`` as tensor parallelism splits any MLP (the tokens' all-to-all
  stays on ``expert``). The block's other split weights are a :class:`TensorGrouping`
  beside it, shared over data x expert.

Checkpoints record each piece's split axis and restore at any other split
(``parallel/grouped.py``, ``tests/test_tensor.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from hetjax.parallel.rules import DATA_AXIS, EXPERT_AXIS, MODEL_AXIS
from hetjax.storage.pages import weight_decay_mask
from models.staged import join_experts, split_experts


def _items(tree: Any, prefix: tuple = ()) -> list[tuple[tuple[str, ...], Any]]:
    """A nested dict's leaves with their key paths, in key order."""
    if isinstance(tree, dict):
        return [kv for k in tree for kv in _items(tree[k], (*prefix, str(k)))]
    return [(prefix, tree)]


def _stack(leaf: Any, axis: int, parts: int) -> Any:
    """A leaf -> its axis ``axis`` cut into ``parts`` slices, each in its own shape,
    stacked on the first axis (merged with the slices' first axis). Under tensor
    parallelism a device's slice is its shard of the leaf, so the moves are its own
    bitcasts (no transposed copy)."""
    shape = list(leaf.shape)
    shape[axis : axis + 1] = [parts, shape[axis] // parts]
    if isinstance(leaf, jax.ShapeDtypeStruct):
        shape.insert(0, shape.pop(axis))
        return jax.ShapeDtypeStruct((shape[0] * shape[1], *shape[2:]), leaf.dtype)
    xp = np if isinstance(leaf, np.ndarray) else jnp
    stacked = xp.moveaxis(leaf.reshape(shape), axis, 0)
    return stacked.reshape(-1, *stacked.shape[2:])


def _unstack(stacked: Any, axis: int, parts: int) -> Any:
    """The inverse of :func:`_stack`."""
    xp = np if isinstance(stacked, np.ndarray) else jnp
    one = stacked.reshape(parts, -1, *stacked.shape[1:])  # (parts, a slice's shape)
    whole = xp.moveaxis(one, 0, axis)
    shape = list(one.shape[1:])
    shape[axis] *= parts
    return whole.reshape(shape)


@dataclasses.dataclass(frozen=True)
class TensorGrouping:
    """A stage's split weights, a 1/M slice of each per device of the ``model`` axis:
    ``axes`` holds (leaf path, the axis the rules split it on) of each grouped leaf."""

    axes: tuple[tuple[tuple[str, ...], int], ...]
    parts: int  # M: devices on the model axis
    axis: str = MODEL_AXIS
    # the devices holding the same slice: the data axis, and under expert parallelism
    # the expert axis too (a batch axis outside a MoE block's experts)
    share_axes: tuple[str, ...] = (DATA_AXIS,)

    @property
    def groups(self) -> int:
        return self.parts

    @classmethod
    def of(
        cls, params: Any, specs: Any, parts: int, share_axes: tuple[str, ...] = (DATA_AXIS,)
    ) -> TensorGrouping:
        """The grouping of a stage's params (arrays or shapes) split as ``specs`` (its
        ``PartitionSpec``s, ``rules.param_specs``): every weight-decayed leaf split over
        ``model``."""
        decay = dict(_items(jax.tree.map(bool, weight_decay_mask(params))))
        split = dict(_items(jax.tree.map(_model_dim, specs, is_leaf=_is_spec)))
        paths = [path for path, _ in _items(params) if decay[path] and split[path] >= 0]
        return cls(tuple((path, split[path]) for path in paths), parts, share_axes=share_axes)

    def split(self, params: Any) -> tuple[Any, Any]:
        axes = dict(self.axes)
        rest: dict = {}
        grouped: dict = {}
        for path, leaf in _items(params):
            if path in axes:
                _put(grouped, path, _stack(leaf, axes[path], self.parts))
            else:
                _put(rest, path, leaf)
        return rest, grouped

    def join(self, rest: Any, grouped: Any) -> Any:
        axes = dict(self.axes)
        whole = jax.tree.map(lambda a: a, rest)  # a copy of its dicts
        for path, leaf in _items(grouped):
            _put(whole, path, _unstack(leaf, axes[path], self.parts))
        return whole

    def cut(self, path: tuple[str, ...]) -> tuple[int, int]:
        return dict(self.axes)[tuple(path)], self.parts

    def stacked_index(self, group: int) -> int:
        return group


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _model_dim(spec: PartitionSpec) -> int:
    """The dimension a spec splits over ``model`` (-1: none)."""
    return next((d for d, axis in enumerate(spec) if axis == MODEL_AXIS), -1)


def _put(tree: dict, path: tuple[str, ...], leaf: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = leaf


@dataclasses.dataclass(frozen=True)
class ExpertGrouping:
    """A MoE block's experts (``models.staged.split_experts``), a group of E/G experts
    per device of the ``expert`` axis; nothing is moved (experts are the first axis)."""

    groups: int  # G: devices on the expert axis
    names: tuple[str, ...]  # the expert leaves (the model's ``expert_params``)
    axis: str = EXPERT_AXIS
    share_axes = (DATA_AXIS,)  # a group's devices

    def split(self, params: Any) -> tuple[Any, Any]:
        return split_experts(params, self.names)

    def join(self, rest: Any, grouped: Any) -> Any:
        return join_experts(rest, grouped)

    def cut(self, path: tuple[str, ...]) -> tuple[int, int]:
        return 0, 1

    def stacked_index(self, group: int) -> int:
        return group


@dataclasses.dataclass(frozen=True)
class ExpertTensorGrouping:
    """A MoE block's experts under expert x tensor parallelism (X x M devices): group e
    of E/X experts per device of the ``expert`` axis, each expert weight cut on the axis
    the rules split over ``model`` into M slices (as :class:`TensorGrouping` cuts them),
    slice m per device of the ``model`` axis. The G = X x M groups in the devices'
    order (e major): group e's slices, each stacked as :class:`TensorGrouping` stacks a
    leaf's (so that inside a stage function, manual over ``expert``, a device's group
    is tensor parallelism's stacked slices of its E/X experts). A checkpoint stacks the
    whole leaf's slices first (slice m of every expert), as tensor parallelism's
    (:meth:`stacked_index`), so it restores at any other split."""

    axes: tuple[tuple[tuple[str, ...], int], ...]  # (expert leaf path, its split axis)
    names: tuple[str, ...]  # the expert leaves (the model's ``expert_params``)
    experts: int  # X: devices on the expert axis
    parts: int  # M: devices on the model axis
    per_group: int  # E / X experts a group holds
    axis: tuple[str, ...] = (EXPERT_AXIS, MODEL_AXIS)
    share_axes = (DATA_AXIS,)  # a group's devices

    @property
    def groups(self) -> int:
        return self.experts * self.parts

    @classmethod
    def of(
        cls, block: Any, specs: Any, experts: int, parts: int, names: tuple[str, ...]
    ) -> ExpertTensorGrouping:
        """The grouping of a MoE block's params (arrays or shapes) whose ``specs`` (its
        ``PartitionSpec``s, ``rules.param_specs``) split each expert weight (``names``:
        the model's ``expert_params``) over ``model``."""
        _, grouped = split_experts(block, names)
        split = dict(_items(jax.tree.map(_model_dim, specs, is_leaf=_is_spec)))
        axes = tuple((path, split[path]) for path, _ in _items(grouped))
        assert all(axis > 0 for _, axis in axes), axes  # split, never on the experts' axis
        num_experts = jax.tree.leaves(grouped)[0].shape[0]
        return cls(axes, names, experts, parts, num_experts // experts)

    def split(self, params: Any) -> tuple[Any, Any]:
        rest, experts = split_experts(params, self.names)
        axes, grouped = dict(self.axes), {}
        for path, leaf in _items(experts):
            _put(grouped, path, self._stack(leaf, axes[path]))
        return rest, grouped

    def _stack(self, leaf: Any, axis: int) -> Any:
        """(E, ...) -> each group of E/X experts' M slices stacked, the groups in order."""
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return _stack(leaf, axis, self.parts)  # the same shape
        xp = np if isinstance(leaf, np.ndarray) else jnp
        n = self.per_group
        groups = [_stack(leaf[e * n : (e + 1) * n], axis, self.parts) for e in range(self.experts)]
        return xp.concatenate(groups)

    def join(self, rest: Any, grouped: Any) -> Any:
        """The inverse of :meth:`split`, of every group or (inside a stage function) of
        one device's: as many groups as the leaves hold."""
        axes, experts = dict(self.axes), {}
        for path, stacked in _items(grouped):
            xp = np if isinstance(stacked, np.ndarray) else jnp
            n = self.parts * self.per_group  # rows of a group
            groups = [
                _unstack(stacked[e * n : (e + 1) * n], axes[path], self.parts)
                for e in range(stacked.shape[0] // n)
            ]
            _put(experts, path, groups[0] if len(groups) == 1 else xp.concatenate(groups))
        return join_experts(rest, experts)

    def cut(self, path: tuple[str, ...]) -> tuple[int, int]:
        return dict(self.axes)[tuple(path)], self.parts

    def stacked_index(self, group: int) -> int:
        e, m = divmod(group, self.parts)  # device (e, m) -> slice m of expert group e
        return m * self.experts + e
