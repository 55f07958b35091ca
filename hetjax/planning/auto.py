"""``offload.mode=auto``: the placement to train with, decided before the runtime is
built (the whole state on the device when it fits, else the planner's)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from hetjax import support
from hetjax.config import Config, format_bytes
from hetjax.planning.hardware import device_capacity, measure_local
from hetjax.planning.in_memory import in_memory_device_parts, mesh_share, model_group_in_process
from hetjax.planning.plan import Plan
from hetjax.planning.search import MARGIN, make_plan, process_host_budget
from hetjax.planning.split import tensor_degrees
from hetjax.planning.tracer import trace_splits
from hetjax.planning.workload import Workload, measured_expert_fraction


def resolve_auto(config: Config, workdir=None, log=print, detail=None) -> Config:
    """``offload.mode=auto``: the config to train with (see :func:`plan_auto`)."""
    return plan_auto(config, workdir, log, detail)[0]


def plan_auto(config: Config, workdir=None, log=print, detail=None) -> tuple[Config, Plan | None]:
    """``offload.mode=auto``: the config to train with, and the plan when one was made.
    When a device's share of the whole state fits it (``memory.device_budget``, else the
    device's free memory) that is ``offload.mode=none``, decided from shapes alone: on
    one device the whole state; on several each device's share of it at a data x model
    split (``split.tensor_degrees``, the least tensor-parallel that fits, without
    ``model.remat`` first: ``_fits_in_memory``), where the support matrix plans it.
    Otherwise (and under expert parallelism, where it does not) the tracer measures
    this machine and the model at one device's rows, the planner plans for the run's
    devices (per-device budgets, the collectives lane), and the plan's placement is
    returned with the budgets it planned for, so the streaming runtime plans within
    them. Several processes take process 0's plan: measurements differ between
    machines, and every process must run the same placement. Several devices: the
    plan's data x model split too (``split.tensor_degrees``, each measured by the one
    trace), which the returned config trains with. ``log`` takes the decision in a few
    lines, ``detail`` (default: ``log``) the plan's table (``--verbose``)."""
    detail = detail or log
    if config.offload.mode != "auto":
        return config, None
    devices = _devices(config)
    degrees = tensor_degrees(config, devices) if devices > 1 else [1]
    # process 0's decision on every process (each may measure another free memory)
    fits = _process_zeros({"none": _fits_in_memory(config, devices, degrees, log)})["none"]
    if fits is not None:
        return config.replace(**fits), None
    t0 = time.perf_counter()
    nvme = config.memory.nvme_path or (Path(workdir) / "nvme" if workdir else "")
    hw = measure_local(str(nvme), config.model.compute_dtype)
    if devices > 1:  # the devices this machine's measurements are shared by
        hw = dataclasses.replace(hw, num_devices=devices)
    fraction = measured_expert_fraction(workdir)
    workloads = trace_splits(config, devices=devices, expert_fraction=fraction, tensors=degrees)
    plan = make_plan(config, hw, workloads=workloads)
    log(f"planned in {time.perf_counter() - t0:.1f} s: {_brief(plan, config)}")
    for line in plan.table().splitlines():
        detail(line)
    if plan.wear is not None and plan.wear.warning():
        log(plan.wear.warning())
    overrides = plan.config_overrides()
    if plan.candidate.mode == "stream":
        overrides["memory"] = dict(
            device_budget=plan.budgets["device"], host_budget=process_host_budget(plan)
        )
    return config.replace(**_process_zeros(overrides)), plan


def _fits_in_memory(config: Config, devices: int, degrees: list[int], log) -> dict | None:
    """The config sections of ``offload.mode=none`` when a device's share of the whole
    state fits it at one of the data x model splits ``degrees`` of ``devices`` devices
    (``in_memory.in_memory_device_parts``, the planner's footprint), else None. Without
    ``model.remat`` at any split first (recomputing costs every device a third more
    compute), then with it; of those, the least tensor-parallel (its all-reduces cost
    each block's sub-layers). The split taken is among the sections returned."""
    budget = config.memory.device_budget or int(MARGIN * device_capacity())
    splits = []
    for t in degrees:
        if not model_group_in_process(devices, t):
            continue
        parallel = support.parallelism_of(devices // t, config.distributed.expert_parallel, t)
        if devices > 1 and (why := support.planned("in_memory", parallel)):
            log(f"offload.mode=auto: {why}: planning the streaming runtime")
            continue
        w = Workload.from_config(config, devices=devices, tensor=t)
        splits.append((t, w, mesh_share(config, devices, t)))
    for remat in (False, True):
        for t, w, share in splits:
            need = sum(in_memory_device_parts(w, share, remat).values())
            if need > budget:
                continue
            where = "the device" if devices == 1 else f"each of {devices} devices"
            split = f" at data x model {devices // t} x {t}" if devices > 1 else ""
            log(
                f"offload.mode=auto: the state fits {where}{split} ({format_bytes(need)} "
                f"of {format_bytes(budget)}): offload.mode=none"
                + (", model.remat=true" if remat else "")
            )
            sections = dict(offload=dict(mode="none"), model=dict(remat=remat))
            if t > 1:
                sections["distributed"] = dict(data_parallel=devices // t, tensor_parallel=t)
            return sections
    if splits:
        log(
            f"offload.mode=auto: the state does not fit the device ({format_bytes(budget)}"
            f"{', memory.device_budget' if config.memory.device_budget else ' free'}); "
            "measuring this machine and the model to plan what goes to host RAM and NVMe "
            "(seconds) ..."
        )
    return None


def _brief(plan: Plan, config: Config) -> str:
    """The plan in a line: what streams from where, where the optimizer state lives, the
    predicted step (the table: ``--verbose``, or ``--plan``)."""
    c, p = plan.candidate, plan.candidate.placement
    more = "--verbose prints the plan (docs/guide/planner.md)"
    if c.mode == "none":
        return f"the whole state on the device, offload.mode=none; {more}"
    tier = {"host": "host RAM", "nvme": "NVMe", "device": "the device"}
    held = {"host": "in host RAM", "nvme": "on NVMe", "device": "on the device"}
    L, r = plan.num_layers, p.resident_blocks
    blocks = lambda a, b: f"block {a}" if a == b else f"blocks {a}-{b}"
    params = f"{blocks(r, L - 1)} of {L} stream from {tier[p.params]}" if r < L else ""
    params += f" ({blocks(0, r - 1)} stay on the device)" if 0 < r < L else ""
    params = params or "every block stays on the device"
    optimizer = f"the fp32 master and {config.optimizer.name} state {held[p.optimizer]}"
    return f"{params}; {optimizer}; predicted {plan.step_s:.3g} s/step; {more}"


def _devices(config: Config) -> int:
    """The devices of the run's mesh (``distributed.data_parallel`` 0: every device)."""
    if not config.distributed.sharded:
        return 1
    import jax

    return config.distributed.devices or jax.device_count()


def _process_zeros(overrides: dict) -> dict:
    """Process 0's ``overrides`` on every process (as they are with one process)."""
    import jax

    if jax.process_count() == 1:
        return overrides
    from jax.experimental import multihost_utils

    text = json.dumps(overrides, sort_keys=True).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(text))))
    buf = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(text, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))))
