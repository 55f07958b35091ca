"""The data x model split of a plan's devices (``distributed.tensor_parallel``): what
tensor parallelism would move between devices and save on a profile, and why a plan
takes the split it takes (printed by ``--plan`` on several devices).

The planner does not plan tensor parallelism yet: the runtime (``runtime/zero.py``)
gathers a block's whole pages on every device of a model group, so a device holds what
it holds without tensor parallelism while its blocks all-reduce activations besides:
no plan gains by it. What is priced here is Megatron's volume, for when a device holds
only its slice of a block (issue #42: the tensor-parallel page slices)."""

from __future__ import annotations

from hetjax.placement import Placement
from hetjax.planning.hardware import Hardware
from hetjax.planning.workload import Workload

# Megatron's all-reduces of one block per micro-batch: its attention's and its MLP's
# outputs in forward, their inputs' gradients in backward (Shoeybi et al. 2019, fig. 4);
# a block that recomputes in backward runs its forward's two again
ALL_REDUCES = {"kept": 4, "recomputed": 6}


def tensor_allreduce_bytes(w: Workload, placement: Placement, tensor: int) -> float:
    """Bytes one device sends per step for Megatron's all-reduces at ``tensor`` devices a
    model group: per block and micro-batch :data:`ALL_REDUCES`, each 2(t-1)/t of a
    ``(b, T, D)`` activation in the compute dtype, b the rows of its data group (t times
    a device's rows at ``tensor`` 1: ``w.boundary`` is one device's activation)."""
    if tensor == 1:
        return 0.0
    L = w.num_layers
    recomputed = placement.recomputed_blocks(L)
    per_micro_batch = (
        recomputed * ALL_REDUCES["recomputed"] + (L - recomputed) * ALL_REDUCES["kept"]
    )
    activation = tensor * w.boundary
    return w.micro_batches * per_micro_batch * 2 * (tensor - 1) / tensor * activation


def describe_split(w: Workload, hw: Hardware, placement: Placement) -> str:
    """One line: the data x model split a plan on ``hw``'s devices takes and why, with
    the all-reduce time each tensor-parallel degree would add over the profile's
    interconnect."""
    n = hw.num_devices
    degrees = [t for t in (2, 4, 8, 16) if t <= n and n % t == 0]
    if not degrees:
        return f"data x model: {n} x 1"
    link = hw.interconnect_bw
    cost = lambda t: (
        f"{tensor_allreduce_bytes(w, placement, t) / link:.3g} s/step at {t}"
        if link
        else f"{tensor_allreduce_bytes(w, placement, t) / 1e9:.3g} GB a step at {t}"
    )
    return (
        f"data x model: {n} x 1 (distributed.tensor_parallel=1): tensor parallelism would "
        f"add Megatron's all-reduces ({', '.join(map(cost, degrees))}) and save "
        "no device memory yet (each device gathers a block's whole pages), so the "
        "planner does not offer it"
    )
