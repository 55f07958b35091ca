"""The slab layouts of a model's stages: the one place where tensor and expert
parallelism are decided for a stage.

The rule: a stage gets one part per grouping whose degree is > 1
(``parallel/groupings.py``), and the plain layout (``storage/pages.py``'s
``SlabLayout``) where it gets none:

* a block of a mixture of experts under expert parallelism (``expert_parallel`` G > 1)
  gets its experts' part: E/G experts per device of the ``expert`` axis
  (:class:`~hetjax.parallel.groupings.ExpertGrouping`), with tensor parallelism too
  each group's slices on the ``model`` axis
  (:class:`~hetjax.parallel.groupings.ExpertTensorGrouping`), shared over ``data``;
  under tensor parallelism alone the same part with one expert group (every expert's
  slice m on device m of ``model``): one layout, and one routed fetcher
  (``runtime/experts/routed_zero.py``), for every mesh;
* every stage under tensor parallelism (``tensor_parallel`` M > 1) gets its other split
  weights' part (the rules split over ``model``, ``parallel/rules.py``): a slice per
  device of the ``model`` axis (:class:`~hetjax.parallel.groupings.TensorGrouping`),
  shared over ``data`` (and ``expert``: a batch axis outside a block's experts), where
  any weight of the stage is split.

The rest of a stage (norms, biases, a router, unsplit weights) is its dense pages,
shared by every device (``parallel/grouped.py``). With both degrees 1 every stage is
the plain layout, whole leaves, as checkpoints have them.
"""

from __future__ import annotations

import math

import jax

from hetjax.parallel.grouped import GroupedSlabLayout
from hetjax.parallel.groupings import ExpertGrouping, ExpertTensorGrouping, TensorGrouping
from hetjax.parallel.rules import BATCH_AXES, DATA_AXIS, param_specs
from hetjax.storage.pages import MASTER_ITEMSIZE, SlabLayout, fitted_page_elems
from models.staged import split_experts


def stage_layouts(
    model,
    page_size: int,
    page_multiple: int = 1,
    expert_parallel: int = 1,
    leaf_buffers: bool = False,
    *,
    tensor_parallel: int = 1,
) -> dict[str, SlabLayout | GroupedSlabLayout]:
    """The slab layouts of a model's stages (``embed``, one block of each stage group by
    its name, e.g. ``block``, ``head``), from abstract shapes: nothing is allocated.
    Pages are at most ``page_size`` bytes, fitted to the largest block
    (``pages.fitted_page_elems``); slabs pad to a multiple of ``page_multiple`` pages
    (ZeRO-3: one equal share per device, ``page_multiple`` devices of which
    ``expert_parallel`` x ``tensor_parallel`` form a row of the mesh). Each stage gets
    one part per grouping whose degree is > 1 (the module docstring). ``leaf_buffers``:
    the device takes each stage's params leaf by leaf (one device:
    ``pages.LeafBuffers``), not as its pages. The layouts are where both the runtime and
    the planner take the stages' sizes from."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    specs = param_specs(model, tensor_parallel, shapes)
    blocks = {
        g.name: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes[g.key])
        for g in model.groups
    }
    block_elems = max(
        sum(math.prod(a.shape) for a in jax.tree.leaves(one)) for one in blocks.values()
    )
    elems = fitted_page_elems(block_elems, page_size // MASTER_ITEMSIZE, page_multiple)
    page_size = elems * MASTER_ITEMSIZE
    stages = {"embed": shapes["embed"], **blocks, "head": shapes["head"]}
    layouts = {}
    for name, params in stages.items():
        experts = expert_parallel if name in blocks else 1
        parts = groupings(
            params, specs.get(name), experts, tensor_parallel, expert_parallel,
            model.expert_params,
        )  # fmt: skip
        if parts:
            layouts[name] = GroupedSlabLayout.of(params, page_size, page_multiple, *parts)
        else:
            layouts[name] = SlabLayout.from_params(params, page_size, page_multiple, leaf_buffers)
    return layouts


def groupings(
    params, specs, experts: int, parts: int, expert_parallel: int, names: tuple[str, ...]
) -> tuple:
    """A stage's groupings, one per degree > 1: its experts (``names``: the model's
    ``expert_params``) over ``experts`` devices of
    the ``expert`` axis (each group cut in ``parts`` slices with tensor parallelism),
    then its other weights ``specs`` split over ``model`` in ``parts`` slices, shared
    over the batch axes (over ``data`` only without expert parallelism); none where no
    leaf is split."""
    out: list = []
    rest = params
    # a mixture of experts' experts are a grouping of their own whenever a degree
    # splits them: expert parallelism's groups, and under tensor parallelism alone one
    # expert group cut in ``parts`` slices (the 3-D mesh's layout with one group: one
    # routed fetcher for every mesh, runtime/experts/routed_zero.py)
    if experts > 1 or (parts > 1 and _has_experts(params, names)):
        grouping = (
            ExpertTensorGrouping.of(params, specs, experts, parts, names)
            if parts > 1
            else ExpertGrouping(experts, names)
        )
        out.append(grouping)
        rest, _ = grouping.split(params)
    if parts > 1:
        share_axes = BATCH_AXES if expert_parallel > 1 else (DATA_AXIS,)
        split = TensorGrouping.of(rest, specs, parts, share_axes=share_axes)
        if split.axes:
            out.append(split)
    return tuple(out)


def _has_experts(params, names: tuple[str, ...]) -> bool:
    """Whether a stage's params hold expert leaves (``.../moe/<one of names>``)."""
    return bool(names) and bool(split_experts(params, names)[1])
