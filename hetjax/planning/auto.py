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
from hetjax.memory_host import in_memory_parts
from hetjax.planning.hardware import device_capacity, measure_local
from hetjax.planning.search import MARGIN, Plan, make_plan, process_host_budget
from hetjax.planning.split import tensor_degrees
from hetjax.planning.tracer import trace_splits
from hetjax.planning.workload import Workload, measured_expert_fraction, memory_sizes


def resolve_auto(config: Config, workdir=None, log=print) -> Config:
    """``offload.mode=auto``: the config to train with (see :func:`plan_auto`)."""
    return plan_auto(config, workdir, log)[0]


def plan_auto(config: Config, workdir=None, log=print) -> tuple[Config, Plan | None]:
    """``offload.mode=auto``: the config to train with, and the plan when one was made.
    On one device, when the whole state fits it (``memory.device_budget``, else the
    device's free memory) that is ``offload.mode=none``, decided from shapes alone;
    otherwise, and always under data or expert parallelism (ZeRO-3 is the streaming
    runtime's), the tracer measures this machine and the model at one device's rows, the
    planner plans for the run's devices (per-device budgets, the collectives lane), and
    the plan's placement is returned with the budgets it planned for, so the streaming
    runtime plans within them. Several processes take process 0's plan: measurements
    differ between machines, and every process must run the same placement. Several
    devices: the plan's data x model split too (``split.tensor_degrees``, each
    measured by the one trace), which the returned config trains with."""
    if config.offload.mode != "auto":
        return config, None
    parallel = support.parallelism(config.distributed)
    in_memory = support.planned("in_memory", parallel)
    if in_memory:  # ZeRO-3 is the streaming runtime's
        log(f"offload.mode=auto: {in_memory}: planning the streaming runtime")
    else:
        fits = _fits_in_memory(config, log)
        if fits is not None:
            return fits, None
        log("offload.mode=auto: the state does not fit the device; measuring this machine")
    t0 = time.perf_counter()
    devices = _devices(config)
    nvme = config.memory.nvme_path or (Path(workdir) / "nvme" if workdir else "")
    hw = measure_local(str(nvme), config.model.compute_dtype)
    if devices > 1:  # the devices this machine's measurements are shared by
        hw = dataclasses.replace(hw, num_devices=devices)
    fraction = measured_expert_fraction(workdir)
    degrees = tensor_degrees(config, devices) if devices > 1 else [1]
    workloads = trace_splits(config, devices=devices, expert_fraction=fraction, tensors=degrees)
    plan = make_plan(config, hw, workloads=workloads)
    log(f"planned in {time.perf_counter() - t0:.1f} s")
    for line in plan.table().splitlines():
        log(line)
    overrides = plan.config_overrides()
    if plan.candidate.mode == "stream":
        overrides["memory"] = dict(
            device_budget=plan.budgets["device"], host_budget=process_host_budget(plan)
        )
    return config.replace(**_process_zeros(overrides)), plan


def _fits_in_memory(config: Config, log) -> Config | None:
    """``offload.mode=none`` (with ``model.remat`` where that is what fits) when the
    whole state fits the device, else None."""
    w = Workload.from_config(config)
    budget = config.memory.device_budget or int(MARGIN * device_capacity())
    for remat in (False, True):
        need = sum(in_memory_parts(memory_sizes(w), remat).values())
        if need <= budget:
            log(
                f"offload.mode=auto: the whole state fits the device ({format_bytes(need)} "
                f"of {format_bytes(budget)}): offload.mode=none"
                + (", model.remat=true" if remat else "")
            )
            return config.replace(offload=dict(mode="none"), model=dict(remat=remat))
    return None


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
