"""Expert parallelism's block slab (``distributed.expert_parallel``): a mixture of
experts' block laid out so that ZeRO-3's pages split its experts by device.

With the experts split over the G devices of the ``expert`` axis (N = S x G devices: S on
the ``data`` axis), a device computes with the block's dense params (attention, norms,
router) and only its own group of E/G experts: the block's slab is a
:class:`~hetjax.runtime.grouped.GroupedSlabLayout` whose grouped leaves are the experts,
already stacked on their first axis (:class:`ExpertGrouping`). Device n = (s, g)'s
share holds share s of expert group g's slab and share n of the dense slab; the dense
shares are all-gathered over every device, a group's expert shares over the ``data``
axis only, never over ``expert`` (``zero.py``), and the gradients are reduce-scattered
the same ways. Checkpoints record the pieces and restore into any other layout
(``grouped.py``).

With tensor parallelism too (``distributed.tensor_parallel`` M > 1, a data x expert x
model mesh), each expert group's weights are cut further by the model axis's slices
(:class:`ExpertTensorGrouping`): device (s, e, m) holds share s of group e's slice m,
gathered over ``data`` only, and computes its group's experts split over ``model`` as
tensor parallelism splits any MLP (the logical axis rules; the tokens' all-to-all stays
on ``expert``). The block's other split weights (attention's, any the rules split over
``model``) arrive split too: the layout's second part (:func:`expert_tensor_layout`) is
tensor parallelism's slices of them (``tensor.TensorGrouping``), slice m per device of
the ``model`` axis, shared over data x expert (the expert axis is a batch axis outside
the experts), so device (s, e, m)'s share is [share s of expert group e's slice m |
share s x X + e of attention's slice m | share n of the dense rest (norms, router)],
and each device fetches 1/M of the attention that a block whose attention were dense
pages would bring it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.distributed import BATCH_AXES, DATA_AXIS, EXPERT_AXIS, MODEL_AXIS
from hetjax.runtime.grouped import GroupedSlabLayout
from hetjax.runtime.tensor import (
    TensorGrouping,
    _is_spec,
    _items,
    _model_dim,
    _put,
    _stack,
    _unstack,
)
from models.llama import join_experts, split_experts


@dataclasses.dataclass(frozen=True)
class ExpertGrouping:
    """A MoE block's experts (``models.llama.split_experts``), a group of E/G experts
    per device of the ``expert`` axis; nothing is moved (experts are the first axis)."""

    groups: int  # G: devices on the expert axis
    axis: str = EXPERT_AXIS
    share_axes = (DATA_AXIS,)  # a group's devices

    def split(self, params: Any) -> tuple[Any, Any]:
        return split_experts(params)

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
    the rules split over ``model`` into M slices (tensor parallelism's, ``tensor.py``),
    slice m per device of the ``model`` axis. The G = X x M groups in the devices'
    order (e major): group e's slices, each stacked as :class:`TensorGrouping` stacks a
    leaf's (so that inside a stage function, manual over ``expert``, a device's group
    is tensor parallelism's stacked slices of its E/X experts). A checkpoint stacks the
    whole leaf's slices first (slice m of every expert), as tensor parallelism's
    (:meth:`stacked_index`), so it restores at any other split."""

    axes: tuple[tuple[tuple[str, ...], int], ...]  # (expert leaf path, its split axis)
    experts: int  # X: devices on the expert axis
    parts: int  # M: devices on the model axis
    per_group: int  # E / X experts a group holds
    axis: tuple[str, ...] = (EXPERT_AXIS, MODEL_AXIS)
    share_axes = (DATA_AXIS,)  # a group's devices

    @property
    def groups(self) -> int:
        return self.experts * self.parts

    @classmethod
    def of(cls, block: Any, specs: Any, experts: int, parts: int) -> ExpertTensorGrouping:
        """The grouping of a MoE block's params (arrays or shapes) whose ``specs`` (its
        ``PartitionSpec``s, ``tensor.tensor_specs``) split each expert weight over
        ``model``."""
        _, grouped = split_experts(block)
        split = dict(_items(jax.tree.map(_model_dim, specs, is_leaf=_is_spec)))
        axes = tuple((path, split[path]) for path, _ in _items(grouped))
        assert all(axis > 0 for _, axis in axes), axes  # split, never on the experts' axis
        num_experts = jax.tree.leaves(grouped)[0].shape[0]
        return cls(axes, experts, parts, num_experts // experts)

    def split(self, params: Any) -> tuple[Any, Any]:
        rest, experts = split_experts(params)
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


class ExpertSlabLayout(GroupedSlabLayout):
    """A MoE block's slab laid out for expert parallelism (see the module docstring)."""

    @classmethod
    def of(cls, block: Any, page_bytes: int, groups: int, shares: int) -> ExpertSlabLayout:  # type: ignore[override]
        """The layout of a block's params (arrays or shapes) with its experts split into
        ``groups`` groups, on ``groups`` x ``shares`` devices."""
        return super().of(block, page_bytes, groups * shares, ExpertGrouping(groups))


def expert_tensor_layout(
    block: Any, specs: Any, page_bytes: int, experts: int, parts: int, shares: int
) -> GroupedSlabLayout:
    """A MoE block's slab laid out on ``shares`` x ``experts`` x ``parts`` (data x
    expert x model) devices: its experts in ``experts`` x ``parts`` groups
    (:class:`ExpertTensorGrouping`, shared over ``data``), then its other weights that
    ``specs`` split over ``model`` in ``parts`` slices (``tensor.TensorGrouping``,
    shared over data x expert; no such part where none is split)."""
    experts_part = ExpertTensorGrouping.of(block, specs, experts, parts)
    rest, _ = experts_part.split(block)
    split = TensorGrouping.of(rest, specs, parts, share_axes=BATCH_AXES)
    groupings = (experts_part, split) if split.axes else (experts_part,)
    return GroupedSlabLayout.of(block, page_bytes, shares * experts * parts, *groupings)
