"""Tensor parallelism's stage slabs (``distributed.tensor_parallel`` M > 1): each stage's
split weights laid out so that a device fetches only its slice of them.

Inside the stage functions each param is constrained by its logical axes under
``distributed.TENSOR_PARALLEL_RULES`` (:func:`tensor_specs`, ``zero.Zero3.constrain``:
attention by heads, the MLP by its hidden units, the vocabulary), so XLA splits the
compute as Megatron does. The pages follow that split: a stage's weight-decayed leaves
that a rule splits over the ``model`` axis are grouped (:class:`TensorGrouping`, a
:class:`~hetjax.runtime.grouped.GroupedSlabLayout`): each cut into M slices on its split
axis, each slice in its own shape (a device's shard of the leaf, so that turning the
pages into the leaf is a bitcast on the device, no transposed copy), slice m held in the
pages of the devices at ``model`` index m, so the
gather brings each device only its slice (over ``data``) and the dense rest (norm
scales, biases, unsplit weights: over every device). The biases a rule splits stay
dense (whole on each device, split by the constraint): weight decay keeps one split
point (``grouped.py``). Checkpoints record each piece's split axis and restore at any
other data x tensor split (``tests/test_tensor.py``). On the data x expert x model mesh
a MoE block's split weights but its experts are such a part of its layout, beside its
experts' (``experts.expert_tensor_layout``), shared over data x expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from hetjax.distributed import DATA_AXIS, MODEL_AXIS, mesh_axes
from hetjax.runtime.grouped import GroupedSlabLayout
from hetjax.storage.pages import weight_decay_mask
from models.staged import logical_axes


def tensor_specs(model, rules, shapes=None) -> dict[str, Any]:
    """Each stage's params' ``PartitionSpec``s under ``rules``, over the ``model`` axis
    only (a group's blocks without their stacked layer axis), by stage: ``embed``, each
    group's name, ``head``."""
    is_names = lambda n: isinstance(n, tuple)
    # only the model axis: the stage functions are manual over the others (a MoE's
    # expert axis has one device under tensor parallelism)
    on_model = lambda axis: MODEL_AXIS if axis == MODEL_AXIS else None
    spec = lambda names: PartitionSpec(*map(on_model, mesh_axes(names, rules)))
    names = logical_axes(model, shapes)
    specs = {"embed": jax.tree.map(spec, names["embed"], is_leaf=is_names)}
    for g in model.groups:
        specs[g.name] = jax.tree.map(lambda n: spec(n[1:]), names[g.key], is_leaf=is_names)
    specs["head"] = jax.tree.map(spec, names["head"], is_leaf=is_names)
    return specs


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
        ``PartitionSpec``s, :func:`tensor_specs`): every weight-decayed leaf split over
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


def tensor_layout(
    params: Any,
    specs: Any,
    page_bytes: int,
    tensor_parallel: int,
    shares: int,
    share_axes: tuple[str, ...] = (DATA_AXIS,),
) -> GroupedSlabLayout | None:
    """A stage's slab laid out for tensor parallelism over ``tensor_parallel`` x
    ``shares`` devices (the shares on ``share_axes``); None when no leaf of it is
    grouped (the plain layout then)."""
    grouping = TensorGrouping.of(params, specs, tensor_parallel, share_axes)
    if not grouping.axes:
        return None
    return GroupedSlabLayout.of(params, page_bytes, tensor_parallel * shares, grouping)
