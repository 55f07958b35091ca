"""The planner: decides where every kind of training state lives, from the model's shapes,
the machine (a profile from ``hetjax/planning/hardware.py``, or measured) and the budgets.

    python -m hetjax.launch --config gpt175b --plan --hardware a100-80g

A :class:`Workload` is the model and batch as the planner sees them (stage sizes,
activation sizes, FLOPs, and stage times: measured by :func:`trace` on this machine, or
derived from the profile's FLOP/s). :func:`make_plan` evaluates every placement the
runtimes implement and returns the fastest :class:`Plan` that fits every tier:

* ``offload.mode=none`` (all state on the device, with or without ``model.remat``), or
* ``offload.mode=stream`` with compute-dtype params on the host or NVMe, fp32 master and
  optimizer state on the device, host or NVMe (NVMe state cached in spare host RAM by
  next use), block-boundary activations on the device, host or NVMe (through
  a few host buffers: Fuyou's SSD-CPU-GPU activation swap), a prefetch depth, blocks
  kept resident on the device (fewer copies) and blocks that keep their in-block
  activations from forward to backward instead of recomputing them
  (``offload.keep_blocks``: Fuyou's swap-instead-of-recompute), all of them or only
  those of the best swap benefit factor (``offload.keep_level``, hetjax/runtime/stages/remat.py),
  and, with the optimizer on the host or NVMe, a device cache of the optimizer state of
  the first stages (``offload.optimizer_device_stages``, Angel-PTM section 4.2): the
  stages the device memory left after everything else holds, updated there at device
  speed with no gradient copy (:func:`_cache_variants` says how residency and the
  cache share that memory);
* where none of those fits: every block recomputing, the micro-batch in chunks of rows
  (``offload.batch_chunks``).

On several devices each data x model split the model allows (``split.tensor_degrees``)
is planned so, from the slice layouts the runtime builds at that tensor-parallel degree,
and the fastest split wins (``split.describe_split`` says why).

The cost model is Fuyou's (section 4.5, equations 1-8) extended to our tiers: a step is
its forward phase plus its backward phase; each phase takes the longest of its lanes
(device compute, host->device, device->host, NVMe, the host optimizer overlapped with
the last micro-batch's backward, collectives: ZeRO-3's gathers and reduce-scatters,
expert parallelism's all-to-alls, Megatron's all-reduces). On the CPU backend the "device", the
copies and the host optimizer share the same cores, so their times add there, and so
do data-parallel devices' (``Hardware.shared_cores``). Memory per tier follows the
runtimes' own accounting (``hetjax/memory.py``:
``plan_device``, ``plan_host``, ``nvme_parts``), so a plan that fits here fits there.
"""

from __future__ import annotations

import dataclasses
import itertools

from hetjax import support
from hetjax.config import SWAP_LEVELS, Config, ConfigError, format_bytes
from hetjax.memory import WAIT_LAG_HOST, DeviceCache, device_parts, plan_device, window_wait_lag
from hetjax.memory_host import HostMemoryPlan, host_minimum, nvme_parts, plan_host
from hetjax.placement import Placement
from hetjax.planning.batch import BatchCost, batch_cost
from hetjax.planning.cost import (
    NO_FLOOR,
    ON_DEVICE,
    Candidate,
    in_memory_collective_bytes,
    lanes,
    nvme_writes,
    step_floors,
)
from hetjax.planning.hardware import Hardware
from hetjax.planning.in_memory import (
    MeshShare,
    in_memory_device_parts,
    mesh_share,
    model_group_in_process,
)
from hetjax.planning.plan import IN_MEMORY, Plan, PlanError
from hetjax.planning.split import allreduce_bytes, describe_split, tensor_degrees
from hetjax.planning.wear import Wear
from hetjax.planning.workload import Workload, memory_sizes

MARGIN = 0.9  # of a tier's capacity the planner may use when no budget is given
# Plans predicted within this factor of the fastest tie: the least offloaded of them wins
# (Candidate.rank). So a larger budget's plan is never slower than this factor times a
# smaller one's (its fastest is no slower).
TIE = 1.02
# with memory.nvme_wear_budget: a plan this much slower than the fastest that writes
# less to NVMe is preferred (writing less "costs little time")
WEAR_TIE = 1.10


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A candidate as the runtime would hold it: bytes per tier by what they hold (device
    and host per device/process, NVMe per process), from the memory model."""

    candidate: Candidate  # with the prefetch depth and resident blocks the plans chose
    device: dict[str, int]
    host: dict[str, int]
    nvme: dict[str, int]
    host_plan: HostMemoryPlan | None = None


def footprint(
    w: Workload, c: Candidate, limit: dict[str, int], n: int = 1, *, lag: int = WAIT_LAG_HOST
) -> Footprint | None:
    """Candidate ``c`` on ``n`` data-parallel devices within the tier budgets ``limit``,
    planned by the same functions the runtimes plan with (``hetjax/memory.py``); None
    when it does not fit. ``lag``: the window's (``memory.window_wait_lag``)."""
    if c.mode == "none":  # one device's share of the state (planning/in_memory.py)
        device = in_memory_device_parts(w, c.share, c.remat)
        fits = sum(device.values()) <= limit.get(IN_MEMORY, limit["device"])
        return Footprint(c, device, {}, {}) if fits else None
    s = memory_sizes(w, n, c.placement.batch_chunks)
    o = c.placement
    try:
        dev = plan_device(s, o, limit["device"], lag=lag)
        host = plan_host(s, o, limit["host"])
    except ConfigError:
        return None
    nvme = nvme_parts(s, o, host)
    if sum(nvme.values()) > limit["nvme"]:
        return None
    c = c.replace(prefetch_depth=dev.prefetch_depth, resident_blocks=dev.resident_blocks)
    return Footprint(c, dev.parts, host.parts, nvme, host)


def budgets(config: Config, hw: Hardware) -> dict[str, int]:
    """Bytes the plan may use per tier and device: the config's budgets, else the
    profile's capacity: the device's allocator pool (``memory.device_fraction`` of an
    accelerator's memory), host RAM and disks with a margin, shared by the machine's
    devices; on the CPU backend the device's memory is the same RAM as the host's, split
    between the two tiers (:func:`_shared_ram`). ``memory.host_budget`` is the
    process's, which drives every device of the machine (one process a machine): each
    device gets its share, and what is written back for the runtime is the process's
    (:func:`process_host_budget`)."""
    mem, n = config.memory, hw.num_devices
    pool = hw.device_pool(mem.device_fraction)
    if not pool and not mem.device_budget:
        raise PlanError(
            f"the {hw.name} profile does not know the device's memory: set "
            "memory.device_budget to the bytes the run may use on it"
        )
    device = int(MARGIN * pool) if hw.shared_cores else pool
    host = int(MARGIN * hw.host_memory / n)
    shared = {}
    if hw.shared_memory and not (mem.device_budget and mem.host_budget):
        device, host = _shared_ram(mem, hw)
        if not mem.device_budget:  # offload.mode=none holds nothing in host RAM
            shared = {IN_MEMORY: device + host}
    return {
        "device": min(mem.device_budget, pool or mem.device_budget)
        if mem.device_budget
        else device,
        "host": min(mem.host_budget, hw.host_memory) // n if mem.host_budget else host,
        "nvme": int(MARGIN * hw.nvme_capacity / n),
        **shared,
    }


def _shared_ram(mem, hw: Hardware) -> tuple[int, int]:
    """The device and host budgets per device where the device's memory is host RAM
    (the CPU backend, ``Hardware.shared_memory``): one pool, ``MARGIN`` of the free RAM
    shared by the devices, counted once. The tier the config gives a budget for takes
    it (at most the pool), the other what it leaves; with neither, half each (and
    ``offload.mode=none``, which holds nothing on the host, the whole pool:
    ``budgets()[IN_MEMORY]``)."""
    n = hw.num_devices
    ram = int(MARGIN * hw.host_memory) // n
    if mem.device_budget:
        device = min(mem.device_budget, ram)
        return device, ram - device
    if mem.host_budget:
        host = min(mem.host_budget // n, ram)
        return ram - host, host
    return ram // 2, ram - ram // 2


def process_host_budget(plan: Plan) -> int:
    """The ``memory.host_budget`` a run of ``plan`` is given: its host budget per device
    for every device of the process (:func:`budgets`; the devices split evenly over the
    processes)."""
    import jax

    return plan.budgets["host"] * max(1, plan.num_devices // jax.process_count())


def _candidates(
    w: Workload,
    parallelism: str,
    chunked: bool = False,
    base: Placement | None = None,
    share: MeshShare | None = None,
):
    """Every placement the runtimes implement under ``parallelism`` (one of
    ``support.PARALLELISMS``) that the planner may offer (``support.planned``).
    ``chunked``: instead, the placements with every block recomputing and the
    micro-batch in chunks of rows (``offload.batch_chunks``), at each chunk count the
    workload allows. ``base``: the placement the knobs not searched here come from (the
    config's; None: the defaults). ``share``: a device's share of the state with
    ``offload.mode=none`` at the workload's split (``in_memory.mesh_share``), which
    offers ``none`` where the matrix plans it (on one device without it too: the whole
    state)."""
    L, base = w.num_layers, base or Placement()
    offered = lambda feature: support.planned(feature, parallelism) is None
    if chunked:
        yield from _chunked_candidates(w, parallelism, base)
        return
    if offered("in_memory") and (share is not None or parallelism == support.SINGLE):
        yield Candidate(mode="none", remat=False, placement=ON_DEVICE, share=share)
        yield Candidate(mode="none", remat=True, placement=ON_DEVICE, share=share)
    # (kept blocks, their level, swapped blocks, their level, their tier): the last
    # blocks keep, the ones before them swap, the rest recompute
    counts = lambda most: sorted({1, 2, L // 4, L // 2, most} & set(range(1, most + 1)))
    kept = [(0, "all")]
    if offered("keep_blocks"):
        kept += [(k, level) for k in counts(L) for level in w.kept]
    # swapped blocks in eighths of the model: host RAM, not the device, bounds them
    eighths = lambda most: sorted(
        {1, 2, most, *range(max(1, L // 8), most + 1, max(1, L // 8))} & set(range(1, most + 1))
    )
    swap_levels = [level for level in w.kept if level in SWAP_LEVELS]
    # (swapped activations: not for an encoder-decoder, the support matrix's model axis)
    if not offered("swap_blocks") or support.supports_model("swap_blocks", w.model_kinds):
        swap_levels = []
    swap_tiers = ("host", "nvme") if offered("swap_to_nvme") else ("host",)
    keeps = [
        (keep, level, swap, swap_level, tier)
        for keep, level in kept
        for swap, swap_level, tier in [(0, "matmuls", "host")]
        + [(n, sl, tier) for n in eighths(L - keep) for sl in swap_levels for tier in swap_tiers]
    ]
    for params, optimizer, acts in _placements(parallelism):
        for depth in (0, 1, 2, 3):
            for keep, level, swap, swap_level, tier in keeps:
                if tier == "nvme" and acts != "nvme":  # RAM short for boundaries first
                    continue
                yield Candidate(
                    placement=_placement(
                        base, params, optimizer, acts, prefetch_depth=depth, keep_blocks=keep,
                        keep_level=level, swap_blocks=swap, swap_level=swap_level,
                        swap_tier=tier,
                    )
                )  # fmt: skip


def _placement(base: Placement, params: str, optimizer: str, activations: str, **knobs):
    """``base`` with the tiers and the knobs given; every other knob the planner
    searches at its least (no kept, swapped or chunked blocks, no device cache, every
    expert copied: the variants add them)."""
    searched = dict(
        prefetch_depth=0, resident_blocks=0, keep_blocks=0, keep_level="all", swap_blocks=0,
        swap_level="matmuls", swap_tier="host", device_stages=0, expert_fetch="all",
        batch_chunks=1,
    )  # fmt: skip
    return dataclasses.replace(
        base, params=params, optimizer=optimizer, activations=activations,
        **{**searched, **knobs},
    )  # fmt: skip


def _placements(parallelism: str):
    """(params, optimizer, activations) tiers of a streamed placement the planner offers
    under ``parallelism`` (``support.planned``)."""
    offered = lambda feature: support.planned(feature, parallelism) is None
    optimizers = ("device", "host", "nvme") if offered("optimizer_on_device") else ("host", "nvme")
    activations = ("device", "host", "nvme") if offered("nvme_boundaries") else ("device", "host")
    return itertools.product(("host", "nvme"), optimizers, activations)


def _chunked_candidates(w: Workload, parallelism: str, base: Placement):
    """Every block recomputing (chunks run no kept or swapped blocks), the micro-batch
    in each chunk count > 1 the workload allows (``offload.batch_chunks``)."""
    if support.planned("batch_chunks", parallelism) is not None:
        return
    for params, optimizer, acts in _placements(parallelism):
        for depth in (0, 1, 2, 3):
            for n in sorted(w.chunked_working_sets):
                if n > 1:
                    placement = _placement(
                        base, params, optimizer, acts, prefetch_depth=depth, batch_chunks=n
                    )
                    yield Candidate(placement=placement)


def _cache_variants(w: Workload, parallelism: str, c: Candidate):
    """Candidate ``c`` with a device cache of the optimizer state of its first k stages,
    for every k (the device plan then keeps as many resident blocks as fit besides, at
    least the cache's own). Angel-PTM caches what fits in the device memory left after
    everything else; here resident blocks compete for that memory (they save
    host->device copies, the cache saves host optimizer time, gradient copies and NVMe
    traffic), so every split is offered to the cost model. Only with the optimizer on
    the host or NVMe, where the parallelism supports it (``support.planned``) and in
    sync mode (lock-free mode takes the optimizer off the critical path already)."""
    if c.mode != "stream" or c.placement.optimizer == "device":
        return
    if support.planned("device_cache", parallelism) is not None:
        return
    if w.grad_policy == "lockfree":
        return
    for k in range(1, w.num_layers + 3):
        yield c.replace(device_stages=k)


def _evaluate(w: Workload, hw: Hardware, limit: dict[str, int], c: Candidate) -> list[tuple]:
    """Candidate ``c``'s footprint per tier and predicted step, as ``[(step, rank, c,
    device, host, nvme, optimizer cache, lanes, NVMe bytes written a step)]``; empty
    when it does not fit. (The step when clipping binds: the chosen's only, :func:`_clipped`.)"""
    f = _footprint(w, hw, limit, c)
    if f is None:
        return []
    c, host, nvme = f.candidate, f.host, f.nvme
    cache = host.get("optimizer cache", 0)
    cached, spill, kept = _lane_inputs(host, nvme)
    step, by_lane = lanes(w, hw, c, cached, spill, kept_params=kept)
    written = sum(nvme_writes(w, c, cached, spill, hw.num_devices).values())
    return [(step, c.rank, c, f.device, host, nvme, cache, by_lane, written)]


def _footprint(w: Workload, hw: Hardware, limit: dict[str, int], c: Candidate) -> Footprint | None:
    """:func:`footprint` of ``c`` on ``hw``'s devices, the window's lag on the profile's
    backend (its, not this process's), as there."""
    return footprint(w, c, limit, hw.num_devices, lag=window_wait_lag(not hw.shared_cores))


def _clipped(w: Workload, hw: Hardware, chosen: tuple) -> float:
    """The step of the plan ``chosen`` (:func:`_evaluate`'s tuple) when clipping binds
    (``cost.lanes``' ``after_backward``)."""
    _, _, c, _, host, nvme = chosen[:6]
    cached, spill, kept = _lane_inputs(host, nvme)
    return lanes(w, hw, c, cached, spill, after_backward=True, kept_params=kept)[0]


def _lane_inputs(host: dict[str, int], nvme: dict[str, int]) -> tuple[float, int, int]:
    """What :func:`~hetjax.planning.cost.lanes` takes from a footprint: the cached
    fraction of the NVMe optimizer state, the gradient bytes spilled to NVMe, the params
    kept in RAM for backward."""
    cache = host.get("optimizer cache", 0)
    cached = cache / nvme["optimizer"] if nvme.get("optimizer") else 0.0
    return cached, nvme.get("gradients", 0), host.get("params kept for backward", 0)


def plan_batch_cost(
    w: Workload, hw: Hardware, limit: dict[str, int], chosen: tuple, rows: int
) -> BatchCost:
    """What the batch of the plan ``chosen`` (:func:`_evaluate`'s tuple) costs, the
    micro-batch ``rows`` rows (``train.micro_batch_size``): the cost model at its
    placement (``planning/batch.py``), resized workloads checked against ``limit``."""
    step, _, c, _, host, nvme = chosen[:6]
    cached, spill, kept = _lane_inputs(host, nvme)
    timed = lambda v: lanes(v, hw, c, cached, spill, kept_params=kept)[1]

    def planned(v: Workload):
        found = _evaluate(v, hw, limit, c)
        return (found[0][0], found[0][7]) if found else None

    chunks = c.placement.batch_chunks if c.mode == "stream" else 1
    host_optimizer = c.mode == "stream" and c.placement.optimizer != "device"
    row_devices = hw.num_devices // w.tensor
    unit = row_devices * chunks  # rows a device's chunks need, every device
    # the workload gives each device at least one row: its batch is that many rows
    planned_rows = max(1, rows // row_devices) * row_devices
    if planned_rows != rows:
        w = dataclasses.replace(
            w,
            tokens_per_step=w.tokens_per_step * planned_rows // rows,
            flops_per_step=w.flops_per_step * planned_rows / rows,
        )
    return batch_cost(
        w, timed, planned, rows=planned_rows, unit=unit, step_s=step, host_optimizer=host_optimizer
    )


def make_plan(
    config: Config,
    hw: Hardware,
    workload: Workload | None = None,
    expert_fraction: float | None = None,
    workloads: dict[int, Workload] | None = None,
) -> Plan:
    """The fastest placement of ``config``'s model that fits every tier of ``hw`` (and
    the config's budgets), at the fastest data x model split of ``hw``'s devices
    (``split.tensor_degrees``; the least tensor-parallel within ``TIE`` of the
    fastest). Raises :class:`PlanError` naming the short tier and by how much when
    nothing fits. ``expert_fraction``: as :meth:`Workload.from_config`'s.
    ``workload``: plan that one only (at its ``tensor``); ``workloads``: by degree,
    those to plan (the tracer's); default: from the config's shapes at each degree."""
    backend = "cpu" if hw.shared_cores else "gpu"  # the profile's, not this process's
    if workload is not None:
        workloads = {workload.tensor: workload}
    elif workloads is None:
        degrees = tensor_degrees(config, hw.num_devices) if hw.num_devices > 1 else [1]
        workloads = {
            t: Workload.from_config(
                config, devices=hw.num_devices, backend=backend,
                expert_fraction=expert_fraction, tensor=t,
            )
            for t in degrees
        }  # fmt: skip
    plans: dict[int, Plan] = {}
    refused: dict[int, PlanError] = {}
    for t, w in workloads.items():
        try:
            plans[t] = _plan_split(config, hw, w)
        except PlanError as e:
            refused[t] = e
    if not plans:
        raise refused[min(refused)]  # the least split's shortfall (one device's, if planned)
    fastest = min(p.step_s for p in plans.values())
    t = min(k for k, p in plans.items() if p.step_s <= TIE * fastest)
    chosen = plans[t]
    if hw.num_devices == 1:
        return chosen
    others = {k: f"{p.step_s:.4g} s/step" for k, p in plans.items() if k != t}
    others |= {k: _short(e) for k, e in refused.items()}
    return dataclasses.replace(
        chosen, split=describe_split(hw, chosen, dict(sorted(others.items())))
    )


def _short(e: PlanError) -> str:
    """Why a split does not fit, in a few words: the first tier short and by how much."""
    text = str(e)
    tier = next((t for t in ("device", "host", "nvme") if f"{t} needs" in text), "")
    short = text.split("short by ", 1)[1].split(" ", 2)[:2] if "short by " in text else []
    return f"does not fit ({tier} short by {' '.join(short)})" if tier and short else "does not fit"


def _plan_split(config: Config, hw: Hardware, w: Workload) -> Plan:
    """The fastest placement of workload ``w`` (at its tensor-parallel degree) on
    ``hw``, as :func:`make_plan` describes."""
    limit = budgets(config, hw)
    parallel = planned_parallelism(config, hw, w.tensor)
    base = Placement.from_config(config)  # the knobs not searched come from the config
    share = None  # offload.mode=none: a device's share, where planned
    in_memory = support.planned("in_memory", parallel) is None
    if in_memory and model_group_in_process(hw.num_devices, w.tensor):
        share = mesh_share(config, hw.num_devices, w.tensor)
    budget = config.memory.nvme_wear_budget
    # a wear budget chooses among the plans that stay within it, and by bytes written:
    # the floors' pruning (relative to the fastest of all) does not hold there
    search = lambda chunked: _fastest_per_placement(
        w, hw, limit, _candidates(w, parallel, chunked, base, share), parallel, not budget
    )
    best = search(False)
    if not best:
        # Chunks of rows only where no placement holds a whole micro-batch's working set:
        # the cost model gives a chunk's kernels the whole batch's FLOP rate, which small
        # chunks on an accelerator do not reach (not priced, not measured on a GPU).
        best = search(True)
    if not best:
        raise PlanError(_shortfall(config, w, hw, limit, parallel))
    wear_of = lambda b: Wear.of(config, b[8], b[0])
    if budget:  # refuse what wears the drives past the budget; prefer writing less
        within = [b for b in best if not wear_of(b).over_budget(budget)]
        if not within:
            least = wear_of(min(best, key=lambda b: b[8]))
            raise PlanError(
                f"{w.name} on {hw.name}: no placement stays within the SSD wear budget; "
                f"the one that writes least: {least.over_budget(budget)}. Lower "
                "train.steps, raise memory.nvme_wear_budget, add drives (memory.nvme_path) "
                "or host RAM (memory.host_budget caches optimizer state)"
            )
        best = within
    chosen = _choose(best, write_less=bool(budget))
    step, _, c, device, host, nvme, cache, lanes, _ = chosen
    busiest = max(lanes, key=lanes.get)
    o = config.optimizer
    return Plan(
        hardware=hw.name,
        workload=w.name,
        candidate=c,
        optimizer_cache=cache,
        device=device,
        host=host,
        nvme=nvme,
        budgets=limit,
        lanes=lanes,
        step_s=step,
        tokens_per_s=w.tokens_per_step / step,
        tflops=w.flops_per_step / step / hw.num_devices,
        bottleneck=busiest,
        step_clipped_s=_clipped(w, hw, chosen) if o.grad_clip > 0 and o.mode == "sync" else step,
        num_devices=hw.num_devices,
        num_layers=w.num_layers,
        groups=tuple((name, n) for name, n, _ in w.groups),
        expert_fraction=w.expert_fetch_fraction,
        expert_source=w.expert_fetch_source,
        deferred_share=(
            w.expert_step_share
            if w.deferred_expert_updates and c.placement.optimizer == "nvme"
            else None
        ),
        fallbacks=tuple(support.fallbacks(config, parallel)) if c.mode == "stream" else (),
        wear=wear_of(chosen),
        tensor_parallel=w.tensor,
        batch_cost=plan_batch_cost(w, hw, limit, chosen, config.train.micro_batch_size),
        allreduce_bytes=(
            in_memory_collective_bytes(w, c)[1]
            if c.mode == "none"
            else w.micro_batches * sum(allreduce_bytes(w, c.placement))
        ),
    )


def _choose(best: list[tuple], write_less: bool = False) -> tuple:
    """The plan among ``best`` (:func:`_evaluate`'s tuples: step s first, rank second,
    NVMe bytes written a step last): the least offloaded within ``TIE`` of the fastest;
    ``write_less`` (a wear budget): instead, of the plans within ``WEAR_TIE`` of the
    fastest that write less than that one, those writing least, chosen the same way."""

    def preferred(pool):  # the least offloaded of those within TIE of the fastest
        fastest = min(b[0] for b in pool)
        return min((b for b in pool if b[0] <= TIE * fastest), key=lambda b: (b[1], b[0]))

    chosen = preferred(best)
    if write_less:
        fastest = min(b[0] for b in best)
        cheaper = [b for b in best if b[0] <= WEAR_TIE * fastest and b[-1] < 0.99 * chosen[-1]]
        if cheaper:
            least = min(b[-1] for b in cheaper)
            chosen = preferred([b for b in cheaper if b[-1] <= least * 1.001])
    return chosen


def planned_parallelism(config: Config, hw: Hardware, tensor: int = 1) -> str:
    """The parallelism a plan of ``config`` on ``hw`` runs under (``support``'s): one
    device keeps the whole state; several shard it (ZeRO-3), splitting the experts too
    with ``distributed.expert_parallel``, or each block's compute over ``tensor``
    devices."""
    if hw.num_devices == 1:
        return support.SINGLE
    return support.parallelism_of(0, config.distributed.expert_parallel, tensor)


def _fastest_per_placement(
    w: Workload,
    hw: Hardware,
    limit: dict[str, int],
    candidates,
    parallelism: str,
    prune: bool = True,
):
    """Each candidate that fits at its fastest (:func:`_evaluate`), with the device caches
    of optimizer state and the routed experts ``parallelism`` allows: ``[(step, rank,
    candidate, ...)]``. ``prune``: leave out what :func:`_choose` cannot choose: the
    variants no faster than their floor (``cost.step_floors``) where that is slower than
    ``TIE`` times a plan already found. The fastest plan of all is no slower than that
    one, so they are neither within ``TIE`` of it nor it; a candidate left with none of
    its variants is left out, one left with some has the same fastest (the others were
    slower). Without a wear budget ``_choose`` looks at nothing else."""
    routing = _routing(w, parallelism)
    best = []
    fastest, kept = float("inf"), {}
    for base in candidates:
        if base.placement.uses_nvme and not hw.nvme_capacity:
            continue
        floors, ceiling = NO_FLOOR, float("inf")
        if prune:
            floors, ceiling = step_floors(w, hw, base, kept), TIE * fastest
        if floors.from_(0) > ceiling:
            continue
        options = _evaluate(w, hw, limit, base) if floors.at(0) <= ceiling else []
        for c in _cache_variants(w, parallelism, base):
            k = c.placement.device_stages
            if floors.from_(k) > ceiling:
                break  # (neither this cache nor a larger one is worth a look)
            if floors.at(k) > ceiling:  # only whether it fits: a larger cache is
                # offered only where this one fits
                if _footprint(w, hw, limit, c) is None:
                    break
                continue
            cached = _evaluate(w, hw, limit, c)
            if not cached:
                break  # a larger cache needs more device memory still
            options += cached
        if routing and base.mode == "stream":  # or routed experts
            options += [
                b
                for o in options
                for b in _evaluate(w, hw, limit, o[2].replace(expert_fetch="routed"))
            ]
        if options:  # this placement's fastest split of device memory
            best.append(min(options, key=lambda b: b[0]))
            fastest = min(fastest, best[-1][0])
    return best


def _routing(w: Workload, parallelism: str) -> bool:
    """Whether the planner offers routed experts (``offload.expert_fetch=routed``)."""
    return bool(w.routed_expert_params) and support.planned("routed_experts", parallelism) is None


def _shortfall(
    config: Config, w: Workload, hw: Hardware, limit: dict[str, int], parallelism: str
) -> str:
    """Why nothing fits: the smallest footprint per tier, tier by tier."""
    state = "nvme" if hw.nvme_capacity else "host"  # params and optimizer state
    nvme_boundaries = support.planned("nvme_boundaries", parallelism) is None
    acts = ("nvme", "host") if nvme_boundaries and hw.nvme_capacity else ("host",)
    # the smallest working set: the most chunks of rows the workload allows
    s = memory_sizes(w, hw.num_devices, max([w.batch_chunks, *w.chunked_working_sets]))
    smallest = []  # boundaries on NVMe need the least host, on the host the least NVMe
    for a in acts:
        o = _placement(Placement(), state, state, a)
        host = host_minimum(s, o)
        least = DeviceCache.of(s, o).blocks
        smallest.append((device_parts(s, o, 0, least), host.parts, nvme_parts(s, o, host)))
    device, host, nvme = (
        min((m[t] for m in smallest), key=lambda d: sum(d.values())) for t in range(3)
    )
    short = []
    hints = {
        "device": "raise memory.device_budget, lower train.batch_size or raise train.grad_accum",
        "host": "raise memory.host_budget or add RAM",
        "nvme": "point memory.nvme_path at a larger disk",
    }
    for tier, held in (("device", device), ("host", host), ("nvme", nvme)):
        need = sum(held.values())
        if need > limit[tier]:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items() if v)
            short.append(
                f"{tier} needs at least {format_bytes(need)} ({parts}) but has "
                f"{format_bytes(limit[tier])}: short by {format_bytes(need - limit[tier])} "
                f"({hints[tier]})"
            )
    if not short:  # each tier fits alone (can't happen with the smallest candidate)
        short.append("no placement fits all tiers at once")
    return f"{w.name} does not fit {hw.name} in any placement: " + "; ".join(short)
