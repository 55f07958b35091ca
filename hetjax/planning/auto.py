"""``offload.mode=auto``: the placement to train with, decided before the runtime is
built (the whole state on the device when it fits, else the planner's)."""

from __future__ import annotations

import time
from pathlib import Path

from hetjax import support
from hetjax.config import Config, format_bytes
from hetjax.memory_host import in_memory_parts
from hetjax.planning.hardware import device_capacity, measure_local
from hetjax.planning.search import MARGIN, Plan, make_plan, process_host_budget
from hetjax.planning.tracer import trace
from hetjax.planning.workload import Workload, measured_expert_fraction, memory_sizes


def resolve_auto(config: Config, workdir=None, log=print) -> Config:
    """``offload.mode=auto``: the config to train with (see :func:`plan_auto`)."""
    return plan_auto(config, workdir, log)[0]


def plan_auto(config: Config, workdir=None, log=print) -> tuple[Config, Plan | None]:
    """``offload.mode=auto``: the config to train with, and the plan when one was made.
    When the whole state fits the device (``memory.device_budget``, else the device's
    free memory) that is ``offload.mode=none``, decided from shapes alone; otherwise the
    tracer measures this machine and the model, the planner plans, and the plan's
    placement is returned (with the budgets it planned for, so the streaming runtime plans within
    them)."""
    if config.offload.mode != "auto":
        return config, None
    in_memory = support.supports("in_memory", support.parallelism(config.distributed))
    if in_memory:  # ZeRO-3 is the streaming runtime's
        log(f"offload.mode=auto: {in_memory}: offload.mode=stream")
        streamed = config.replace(offload=dict(mode="stream"))
        for line in support.fallbacks(streamed):
            log(f"offload.mode=auto: {line}")
        return streamed, None
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
            return config.replace(offload=dict(mode="none"), model=dict(remat=remat)), None
    log("offload.mode=auto: the state does not fit the device; measuring this machine")
    t0 = time.perf_counter()
    nvme = config.memory.nvme_path or (Path(workdir) / "nvme" if workdir else "")
    hw = measure_local(str(nvme), config.model.compute_dtype)
    plan = make_plan(config, hw, trace(config, expert_fraction=measured_expert_fraction(workdir)))
    log(f"planned in {time.perf_counter() - t0:.1f} s")
    for line in plan.table().splitlines():
        log(line)
    overrides = plan.config_overrides()
    if plan.candidate.mode == "stream":
        overrides["memory"] = dict(
            device_budget=plan.budgets["device"], host_budget=process_host_budget(plan)
        )
    return config.replace(**overrides), plan
