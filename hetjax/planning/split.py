"""The data x model split of a plan's devices (``distributed.tensor_parallel``): which
tensor-parallel degrees a model allows, what Megatron's all-reduces move between a
model group's devices, and why a plan takes the split it takes (printed by ``--plan``
on several devices).

Under tensor parallelism M a device holds a block's dense pages and only its 1/M slice
of the split weights (``parallel/groupings.py``: the planner takes the sizes from the same
layouts, ``Workload.from_config(..., tensor=M)``), computes 1/M of its data group's
rows' heads and MLP units, and holds that data group's boundaries; its blocks
all-reduce their attention's and MLP's outputs besides ZeRO-3's gathers (priced in the
collectives lane, ``cost.lanes``). So a split can fit where a whole block cannot, and
cost all-reduces where both fit: the planner plans every degree and takes the fastest
(``search.make_plan``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetjax.placement import Placement
from hetjax.planning.hardware import Hardware
from hetjax.planning.workload import Workload

if TYPE_CHECKING:
    from hetjax.config import Config


def tensor_degrees(config: Config, devices: int) -> list[int]:
    """The tensor-parallel degrees a plan of ``config`` on ``devices`` devices may take:
    each divisor t of the device count that splits the model as the rules split it
    (``parallel/rules.py``: t divides the heads, the key/value heads,
    the MLP's hidden units and the vocabulary) and leaves the micro-batch's rows
    dividing over the devices/t data groups (1 alone where none does: the runtime then
    says why). The planner plans tensor parallelism for the zoo's blocks (GPT, Llama,
    its mixture of experts, whose experts' MLPs split by their hidden units, and T5's
    encoder and decoder): its memory model is checked there
    (``tests/test_memory_model.py``); not beside expert parallelism, whose data x
    expert x model meshes are not searched (a block's experts' exchange and its
    all-reduces there are estimates from the buffers' shapes, not checked against a
    compiled step). A config's ``distributed.tensor_parallel`` > 1 is taken as given
    (with expert parallelism too: ``tests/test_tensor_expert.py``)."""
    m, dist = config.model, config.distributed
    if dist.tensor_parallel > 1:
        return [dist.tensor_parallel]
    if dist.expert_parallel > 1 or m.family not in ("gpt", "llama", "t5"):
        return [1]
    kv = m.num_kv_heads or m.num_heads
    sizes = (m.num_heads, kv, m.ff_dim, m.vocab_size)
    rows = config.train.micro_batch_size
    degrees = [
        t
        for t in range(1, devices + 1)
        if devices % t == 0 and all(n % t == 0 for n in sizes) and rows % (devices // t) == 0
    ]
    return degrees or [1]  # (the runtime then says why the rows do not divide)


def allreduce_bytes(w: Workload, placement: Placement, tensor: int | None = None):
    """Bytes one device sends per micro-batch for Megatron's all-reduces at ``tensor``
    devices a model group (default the workload's ``tensor``), as ``(forward,
    backward)``: per block ``w.all_reduces`` (``workload.all_reduces``, the mean over its
    blocks), each 2(t-1)/t of a ``(b, T, D)`` activation in the compute dtype, b the
    rows of its data group (``w.boundary`` is the data group's activation at
    ``w.tensor``: a device's rows times it)."""
    tensor = tensor or w.tensor
    if tensor == 1:
        return 0.0, 0.0
    L = w.num_layers
    recomputed = placement.recomputed_blocks(L)
    activation = w.boundary * tensor / w.tensor
    each = 2 * (tensor - 1) / tensor * activation
    fwd, bwd = w.all_reduces
    return L * fwd * each, (L * bwd + recomputed * fwd) * each


def tensor_allreduce_bytes(w: Workload, placement: Placement, tensor: int) -> float:
    """Bytes one device sends per step for Megatron's all-reduces at ``tensor`` devices
    a model group (:func:`allreduce_bytes` of every micro-batch)."""
    return w.micro_batches * sum(allreduce_bytes(w, placement, tensor))


def describe_split(hw: Hardware, chosen, others: dict[int, str]) -> str:
    """One line: the data x model split a plan on ``hw``'s devices takes (``chosen``, a
    ``search.Plan``) and why: each degree planned, its predicted step or why it does not
    fit (``others``: by degree, those not chosen), and the all-reduce time the chosen
    one adds over the profile's interconnect."""
    n, t = hw.num_devices, chosen.tensor_parallel
    line = f"data x model: {n // t} x {t} (distributed.tensor_parallel={t})"
    if not others:
        return line + (
            ": the only split the model and the micro-batch's rows allow (split.tensor_degrees)"
        )
    options = [f"{t}: {chosen.step_s:.4g} s/step"] + [f"{k}: {why}" for k, why in others.items()]
    why = "the fastest of tensor_parallel " + "; ".join(options)
    if t > 1:
        link = hw.interconnect_bw or hw.h2d_bw
        s = chosen.allreduce_bytes / link if link else 0.0
        why += f"; Megatron's all-reduces move {chosen.allreduce_bytes / 1e9:.3g} GB a step"
        why += f" ({s:.3g} s over the interconnect)" if link else ""
    return f"{line}: {why}"
