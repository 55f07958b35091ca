"""The cost model: a step's predicted time per lane (Fuyou's section 4.5, equations 1-8,
extended to hetjax's tiers). A step is its forward phase plus its backward phase; each
phase takes the longest of its lanes (device compute, host->device, device->host, NVMe,
the host optimizer overlapped with the last micro-batch's backward, collectives). On the
CPU backend the "device", the copies and the host optimizer share the same cores, so
their times add there, and so do data-parallel devices' (``Hardware.shared_cores``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.memory import IO_READAHEAD, DeviceCache, params_are_master
from hetjax.placement import Placement
from hetjax.planning.hardware import Hardware
from hetjax.planning.in_memory import MeshShare
from hetjax.planning.split import allreduce_bytes
from hetjax.planning.workload import Workload, kept_key, memory_sizes

_PLACEMENT_FIELDS = frozenset(f.name for f in dataclasses.fields(Placement))

ADAM_BYTES = 28  # bytes a device-side AdamW moves per parameter (reads and writes)


# mode none's placement: everything on the device (the tiers the plan's table names)
ON_DEVICE = Placement(
    params="device", optimizer="device", activations="device", prefetch_depth=0,
    expert_fetch="all",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """A placement the planner evaluates: ``mode`` ``stream``, the streaming runtime
    with ``placement``; or ``none``, the whole state on the device in one jitted step,
    its blocks recomputing in backward or not (``remat``, ``model.remat``), each device
    holding ``share`` of it (``planning/in_memory.py``: on a mesh, its split)."""

    mode: str = "stream"  # none | stream
    remat: bool = False  # mode none only
    placement: Placement = ON_DEVICE
    share: MeshShare | None = None  # mode none only

    def replace(self, **changes) -> Candidate:
        """The candidate with some of its placement's fields changed (as
        ``dataclasses.replace`` would, without its cost: the planner asks hundreds of
        thousands of times a plan, and neither class checks its fields in ``__init__``)."""
        unknown = changes.keys() - _PLACEMENT_FIELDS
        if unknown:
            raise TypeError(f"Placement has no field {sorted(unknown)[0]!r}")
        placement = object.__new__(Placement)
        placement.__dict__.update(self.placement.__dict__, **changes)
        candidate = object.__new__(Candidate)
        candidate.__dict__.update(self.__dict__, placement=placement)
        return candidate

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        """The config sections that train with this candidate (``Config.replace(**...)``)."""
        if self.mode == "none":
            return dict(offload=dict(mode="none"), model=dict(remat=self.remat))
        return self.placement.config_overrides()

    @property
    def rank(self) -> float:
        """Preference among plans of (nearly) equal predicted time: less offloaded first."""
        if self.mode == "none":
            return float(self.remat)
        p = self.placement
        tiers = {"device": 0, "host": 1, "nvme": 2}
        return (
            10
            + tiers[p.params]
            + tiers[p.optimizer]
            + tiers[p.activations]
            + 0.1 * p.prefetch_depth
            + ((0.5 + tiers[p.swap_tier] - 1) if p.swap_blocks else 0.0)  # part way
            + 0.01 * (p.batch_chunks - 1)  # smaller kernels than the whole batch's
        )


def lanes(
    w: Workload,
    hw: Hardware,
    c: Candidate,
    cached: float,
    grad_spill: int = 0,
    after_backward: bool = False,
    kept_params: int = 0,
) -> tuple[float, dict]:
    """Predicted seconds per step and per lane (Fuyou's equations 1-8, our tiers).
    ``cached``: the fraction of NVMe optimizer state cached in host RAM; ``grad_spill``:
    gradient bytes written to NVMe per step (read back only by a clipping redo).
    ``kept_params``: bytes of params on NVMe that forward's reads keep in RAM for
    backward (the host plan's ``kept_params``), which backward then does not read.
    ``after_backward``: the step of a sync run whose clipping binds (the update loop's
    adaptive speculation then updates every stage once backward has ended, the spilled
    gradients read back; ``update_loop.py``) instead of overlapped with backward.
    (:func:`step_floors` bounds the step from its device-compute, collectives and
    optimizer terms, computed as here.)"""
    A = w.micro_batches
    fwd = _forward_s(w, hw)
    if c.mode == "none":
        return _in_memory_lanes(w, hw, c, fwd)
    o = c.placement
    compute_b = _backward_s(w, hw, o)
    sizes = memory_sizes(w, hw.num_devices, o.batch_chunks)
    cache = DeviceCache.of(sizes, o)
    t = _copies(w, hw, o, sizes, cache)
    comm_f, comm_b = _collectives_s(w, hw, o)
    disk = _disk(w, hw, c, t, cached, grad_spill, kept_params, cache)
    # The device cache's stages are the last backward reaches: their updates run on the
    # device after it, at device speed (Angel-PTM); the host updates the others,
    # overlapped with backward.
    dev_opt = _device_optimizer_s(hw, cache.params)
    if o.optimizer == "device":  # each device updates its 1/n (on shared cores in turn)
        opt = _device_optimizer_s(hw, w.params if hw.shared_cores else w.params * t.frac)
    else:  # the machine's optimizer serves n processes
        opt = (w.params - cache.params) / hw.optimizer_params_per_s
    if after_backward:  # the spilled gradients read back (mode none returned above)
        readback = grad_spill / hw.nvme_read_bw if grad_spill else 0.0
        disk = dataclasses.replace(disk, step=disk.step + readback)
    lanes_s = (fwd, compute_b), (comm_f, comm_b), (opt, dev_opt)
    step = _step_s(hw, o, t, disk, *lanes_s, A, after_backward)
    lanes = {
        "compute": A * (fwd + compute_b),
        "host->device": A * (t.h2d_f + t.h2d_b) / hw.h2d_bw,
        "device->host": A * (t.d2h_f + t.d2h_b) / hw.d2h_bw,
        "nvme": A * (disk.f + disk.b) + disk.step,
        "optimizer": opt + dev_opt,
        "collectives": A * (comm_f + comm_b),
    }
    return step, lanes


@dataclasses.dataclass(frozen=True)
class _Copies:
    """A device's bytes over the host link in a micro-batch's forward (``_f``) and
    backward (``_b``), per direction, and what :func:`_disk` reads of them."""

    frac: float  # a device's share of a block (1 / devices)
    h2d_f: float
    h2d_b: float
    d2h_f: float
    d2h_b: float
    serial_f: float  # seconds forward waits for the routed experts' copy
    skipped: float  # the routed blocks' experts not copied (the disk still reads them)
    bounds: float  # boundaries crossing to the host and back
    streamed_b: int  # blocks whose params backward fetches
    routing: bool  # expert-aware streaming (only the routed experts copied)
    routed: int  # the streamed blocks that copy only their routed experts


def _copies(w: Workload, hw: Hardware, o: Placement, sizes, cache: DeviceCache) -> _Copies:
    """:class:`_Copies` of placement ``o``."""
    n, L, cb = hw.num_devices, w.num_layers, w.compute_bytes
    kept, swapped = o.keep_blocks, o.swap_blocks
    recomputed = o.recomputed_blocks(L)
    frac = 1.0 / n
    resident = max(o.resident_blocks, cache.blocks)
    streamed_f = L - resident
    streamed_b = max(0, L - kept - resident)  # the swapped blocks' params come again
    # Boundaries on the host or NVMe cross to the host in forward and back in backward;
    # on NVMe, all but the last IO_READAHEAD (held in RAM for backward, which takes them
    # first) are written and read back. Swapped blocks' activations cross both ways.
    bounds = recomputed * w.boundary if o.activations in ("host", "nvme") else 0
    swap = swapped * sizes.swapped_held(o.swap_level) if swapped else 0  # a device's
    # each device copies in its share of the stored block (expert parallelism: every
    # expert's), then gathers the rest of what it computes with from the others
    # (_collectives_s)
    Ps = w.stored_block
    # expert-aware streaming (runtime/experts/routed.py): the streamed blocks that recompute copy
    # only their routed experts; kept and swapped blocks copy them all. The disk still
    # reads whole blocks. In forward the routed experts' copy waits for the routing (a
    # host sync), so the device waits for it: ``serial_f``; backward's is known ahead.
    routing = bool(w.routed_expert_params and o.expert_fetch == "routed")
    routed = max(0, recomputed - resident) if routing else 0
    # a device's share of the routed blocks' experts: under ZeRO-3 each device copies
    # its 1/n of every page (routed_zero.py; under tensor parallelism its share of its
    # slice), the routed experts' pages of it among them
    experts = routed * cb * w.routed_expert_params * frac
    skipped = experts * (1 - w.expert_fetch_fraction)
    serial_f = experts * w.expert_fetch_fraction / hw.h2d_bw
    h2d_f = streamed_f * cb * Ps * frac - skipped
    h2d_b = streamed_b * cb * Ps * frac - skipped + bounds + swap
    # per device; the device cache's gradients stay there
    d2h_f, d2h_b = bounds + swap, cache.host_grad_bytes
    return _Copies(
        frac, h2d_f, h2d_b, d2h_f, d2h_b, serial_f, skipped, bounds, streamed_b, routing, routed
    )


@dataclasses.dataclass(frozen=True)
class _Disk:
    """NVMe seconds: a micro-batch's forward (``f``) and backward (``b``), the step's
    own (``step``: state, written params and spilled gradients), and the deferred expert
    updates caught up in the forward (``catch_up``, on its path)."""

    f: float = 0.0
    b: float = 0.0
    step: float = 0.0
    catch_up: float = 0.0


def _disk(
    w: Workload, hw: Hardware, c: Candidate, t: _Copies, cached: float, grad_spill: int,
    kept_params: int, cache: DeviceCache,
) -> _Disk:  # fmt: skip
    """:class:`_Disk` of candidate ``c`` (``lanes``' arguments)."""
    o, n, A, cb = c.placement, hw.num_devices, w.micro_batches, w.compute_bytes
    disk_f = disk_b = disk_step = 0.0
    writes = nvme_writes(w, c, cached, grad_spill, n)  # bytes a step writes, by what
    if o.params == "nvme":
        # params that are the fp32 master are written with the state, and a cached
        # stage's come from its state in RAM
        master = params_are_master(o, cb)
        read = (1 - cached) if master else 1.0
        disk_f = (t.h2d_f + t.skipped) * read / hw.nvme_read_bw * n  # the disks serve n
        disk_b = max(0.0, t.h2d_b + t.skipped - t.bounds - kept_params) * read
        disk_b = disk_b / hw.nvme_read_bw * n
        disk_step += writes["params"] / hw.nvme_write_bw
    # boundaries and swapped activations: written in each micro-batch's forward, read
    # back in its backward
    if writes["activations"]:  # (a profile without NVMe writes none)
        disk_f += writes["activations"] / A / hw.nvme_write_bw
        disk_b += writes["activations"] / A / hw.nvme_read_bw
    if grad_spill:
        disk_step += writes["gradients"] / hw.nvme_write_bw
    S = w.state_bytes_per_param
    catch_up = 0.0
    if o.optimizer == "nvme":
        moved = S * (w.params - cache.params) * (1 - cached)
        # params that are the master: a block's state read copies the master from its
        # backward's param read (storage/params.py, MasterPages), cb bytes a parameter
        master = params_are_master(o, cb)
        copied = cb * t.streamed_b * w.stored_block * t.frac * (1 - cached) if master else 0
        read = moved - copied
        if t.routing and w.deferred_expert_updates:
            saved_r, _, again = deferred_bytes(w, t.routed * w.routed_expert_params * S)
            read = read - saved_r * (1 - cached)
            catch_up = again * (1 - cached) * (1 / hw.nvme_read_bw + 1 / hw.nvme_write_bw)
        disk_step += read / hw.nvme_read_bw + writes["optimizer"] / hw.nvme_write_bw
    return _Disk(disk_f, disk_b, disk_step, catch_up)


def _step_s(
    hw: Hardware, o: Placement, t: _Copies, disk: _Disk, compute: tuple[float, float],
    comm: tuple[float, float], optimizer: tuple[float, float], A: int,
    after_backward: bool = False,
) -> float:  # fmt: skip
    """A step's seconds from its lanes: ``A`` forwards, ``A - 1`` backwards and the last
    backward with the optimizer (``compute``, ``comm``: forward's and backward's;
    ``optimizer``: the host's (or the device's, placement ``device``) and the device
    cache's update); ``after_backward``: the update after the last backward, not beside
    it (``lanes``)."""
    n = hw.num_devices
    (fwd, compute_b), (comm_f, comm_b), (opt, dev_opt) = compute, comm, optimizer
    copy_f = t.h2d_f / hw.h2d_bw + t.d2h_f / hw.d2h_bw
    copy_b = t.h2d_b / hw.h2d_bw + t.d2h_b / hw.d2h_bw
    if hw.shared_cores:  # compute, copies, collectives and optimizer take turns on the
        # same cores, and so do the n devices' (each its rows, its copies, its collectives)
        t_f = max(n * (fwd + copy_f + comm_f), disk.f)
        t_b = max(n * (compute_b + copy_b + comm_b), disk.b)
        t_last = max(n * (compute_b + copy_b + comm_b) + opt + dev_opt, disk.b + disk.step)
    else:
        overlapped = t.h2d_f / hw.h2d_bw - t.serial_f
        t_f = max(fwd, overlapped, t.d2h_f / hw.d2h_bw, comm_f, disk.f) + t.serial_f
        t_b = max(compute_b, t.h2d_b / hw.h2d_bw, t.d2h_b / hw.d2h_bw, comm_b, disk.b)
        if o.optimizer == "device":  # the update shares the device with backward
            t_last = max(t_b, compute_b + opt, disk.b + disk.step)
        else:
            t_last = max(t_b, compute_b + dev_opt, opt, disk.b + disk.step)
    if after_backward:
        t_b_last = n * (compute_b + copy_b + comm_b) if hw.shared_cores else t_b
        if hw.shared_cores or o.optimizer == "device":
            t_last = max(t_b_last, disk.b) + max(opt + dev_opt, disk.step)
        else:  # host stages on the host, cached ones on the device, at once
            t_last = max(t_b_last, disk.b) + max(opt, dev_opt, disk.step)
    return A * t_f + (A - 1) * t_b + t_last + disk.catch_up


def _forward_s(w: Workload, hw: Hardware) -> float:
    """A micro-batch's forward on the device, every stage: the compute lane's forward."""
    st = w.stage_times(hw)
    return st["embed_fwd"] + w.num_layers * st["block_fwd"]


def _backward_s(w: Workload, hw: Hardware, o: Placement) -> float:
    """A micro-batch's backward on the device with the blocks of ``o`` recomputing,
    kept or swapped (each at its level): the compute lane's backward."""
    st = w.stage_times(hw)
    kept, swapped = o.keep_blocks, o.swap_blocks
    compute_b = st["head"] + o.recomputed_blocks(w.num_layers) * st["block_bwd"]
    compute_b += kept * st[kept_key(o.keep_level)] if kept else 0.0
    compute_b += swapped * st[kept_key(o.swap_level)] if swapped else 0.0
    return compute_b + st["embed_bwd"]


def _collectives_s(w: Workload, hw: Hardware, o: Placement) -> tuple[float, float]:
    """A micro-batch's collectives on several devices, forward and backward: the
    collectives lane's (0.0 on one device, or without a link)."""
    n, L, cb = hw.num_devices, w.num_layers, w.compute_bytes
    # On the CPU backend the devices' memory is host RAM: a collective is copies.
    link = hw.interconnect_bw or (hw.h2d_bw if hw.shared_cores else 0.0)
    if n == 1 or not link:
        return 0.0, 0.0
    # all-gather params, reduce-scatter gradients the same way (the blocks' in
    # memory.block_grad_dtype, the rest fp32) and, with expert parallelism, each block's
    # all-to-alls (its backward recomputes the forward's, then sends their cotangents)
    Pg = w.gathered_block(n)
    grads = 4 * w.scattered_rest(n) + w.block_grad_bytes * L * w.scattered_block(n)
    comm_f = L * (cb * Pg + w.exchange_bytes) / link
    comm_b = (o.recomputed_blocks(L) * (cb * Pg + 2 * w.exchange_bytes) + grads) / link
    # tensor parallelism: Megatron's all-reduces of each block's sub-layers
    # (planning/split.py), over the same links
    allreduce_f, allreduce_b = allreduce_bytes(w, o)
    return comm_f + allreduce_f / link, comm_b + allreduce_b / link


@dataclasses.dataclass(frozen=True)
class Floors:
    """Steps no faster than :func:`lanes`' (outside ``after_backward``) of the streamed
    candidates that differ from one only in their params and activations tiers,
    prefetch depth, resident blocks, device cache (``device_stages``) or expert fetch
    (:func:`step_floors`), by their device cache."""

    each: tuple[float, ...]  # [k]: with the optimizer state of k stages cached
    after: tuple[float, ...]  # [k]: the least of each[k:]

    def at(self, k: int) -> float:
        """The floor with ``k`` stages cached."""
        return self.each[min(k, len(self.each) - 1)]

    def from_(self, k: int) -> float:
        """The least floor with ``k`` or more stages cached."""
        return self.after[min(k, len(self.after) - 1)]


NO_FLOOR = Floors((0.0,), (0.0,))


def step_floors(w: Workload, hw: Hardware, c: Candidate, kept: dict) -> Floors:
    """:class:`Floors` of ``c``: its lanes that depend on none of what may differ.
    ``kept``: a dict this keeps them in, for one ``w`` and ``hw``. :data:`NO_FLOOR`
    where none is proven (see :func:`_floors`)."""
    o = c.placement
    # all the floors depend on besides w and hw
    key = (c.mode, o.optimizer, o.batch_chunks, o.keep_blocks, o.keep_level)
    key += (o.swap_blocks, o.swap_level)
    if key not in kept:
        each = _floors(w, hw, c, kept)
        after = list(each)
        for k in range(len(after) - 2, -1, -1):
            after[k] = min(after[k], after[k + 1])
        kept[key] = Floors(each, tuple(after))
    return kept[key]


def _floors(w: Workload, hw: Hardware, c: Candidate, kept: dict) -> tuple[float, ...]:
    """:func:`step_floors`' ``each``. On an accelerator ``lanes`` takes each phase as
    the longest of its lanes, device compute and the collectives among them (neither
    depends on what may differ), the last backward's also the optimizer's (the device's
    update after it, or the host's beside it, both set by the device cache): ``t_f >=
    max(fwd, comm_f)``, ``t_b >= max(compute_b, comm_b)``, ``t_last >= max(t_b,
    optimizer)``; ``serial_f`` and ``catch_up`` only add. Each term is computed as
    ``lanes`` computes it and summed in the same order, so rounding keeps the floor
    below (a float sum is monotone in each term). No floor (0.0): mode none; shared
    cores (copies add to compute there, their signs not proven); the optimizer on NVMe
    with deferred expert updates (``catch_up`` scales by ``1 - cached``, not proven
    non-negative)."""
    o = c.placement
    if c.mode != "stream" or hw.shared_cores:
        return (0.0,)
    if o.optimizer == "nvme" and w.routed_expert_params and w.deferred_expert_updates:
        return (0.0,)
    A, P = w.micro_batches, w.params
    fwd, compute_b = _forward_s(w, hw), _backward_s(w, hw, o)
    comm_f, comm_b = _collectives_s(w, hw, o)
    t_b = max(compute_b, comm_b)
    phases = A * max(fwd, comm_f) + (A - 1) * t_b
    if o.optimizer == "device":  # no device cache
        opt = _device_optimizer_s(hw, P * (1.0 / hw.num_devices))
        return (phases + max(t_b, compute_b + opt),)
    cached = (o.optimizer, o.batch_chunks)  # the params of each device cache
    if cached not in kept:
        sizes = memory_sizes(w, hw.num_devices, o.batch_chunks)
        kept[cached] = [
            DeviceCache.of(sizes, dataclasses.replace(o, device_stages=k)).params
            for k in range(w.num_layers + 3)
        ]
    # the device updates the cached stages after backward, the host the others beside it
    rate = hw.optimizer_params_per_s
    return tuple(
        phases + max(t_b, compute_b + _device_optimizer_s(hw, p), (P - p) / rate)
        for p in kept[cached]
    )


def in_memory_collective_bytes(w: Workload, c: Candidate) -> tuple[float, float]:
    """Bytes one device sends a step in an ``offload.mode=none`` step on a mesh, as
    ``(gradients' all-reduce, Megatron's all-reduces)``: each gradient leaf fp32
    all-reduced over the batch axes it is replicated on, once a step (ring:
    ``MeshShare.allreduced``), and every micro-batch's all-reduces of each block under
    tensor parallelism (``split.allreduce_bytes``; with ``model.remat`` the blocks'
    backward runs their forward's again)."""
    share = c.share
    if share is None:
        return 0.0, 0.0
    L = w.num_layers
    recompute = dataclasses.replace(ON_DEVICE, keep_blocks=0 if c.remat else L)
    return 4 * share.allreduced, w.micro_batches * sum(allreduce_bytes(w, recompute))


def _in_memory_lanes(w: Workload, hw: Hardware, c: Candidate, fwd: float) -> tuple[float, dict]:
    """:func:`lanes` of ``offload.mode=none``: every micro-batch's forward and backward
    (``model.remat``: the blocks recompute), on a mesh the collectives
    (:func:`in_memory_collective_bytes`, after the compute: XLA's step is not assumed
    to overlap them), then each device's optimizer step over its share. On the CPU
    backend the devices take turns on the same cores."""
    st = w.stage_times(hw)
    n, A, L = hw.num_devices, w.micro_batches, w.num_layers
    bwd_blocks = L * (st["block_bwd"] if c.remat else st["block_bwd_kept"])
    compute = A * (fwd + st["head"] + bwd_blocks + st["embed_bwd"])
    dev_opt = _device_optimizer_s(hw, c.share.params if c.share else w.params)
    link = hw.interconnect_bw or (hw.h2d_bw if hw.shared_cores else 0.0)
    comm = sum(in_memory_collective_bytes(w, c)) / link if n > 1 and link else 0.0
    step = compute + comm + dev_opt
    if hw.shared_cores:
        step *= n
    return step, {"compute": compute, "optimizer": dev_opt, "collectives": comm}


def nvme_writes(
    w: Workload, c: Candidate, cached: float, grad_spill: int = 0, n: int = 1
) -> dict[str, float]:
    """Bytes a step writes to NVMe, by what (the machine's ``n`` processes together):
    the optimizer state not cached in RAM (``cached``: its cached fraction; deferred
    expert updates leave some unwritten), compute-dtype params with files of their own,
    boundaries and swapped activations on NVMe (each micro-batch's), and the gradients
    the host plan spills (``grad_spill``). What :func:`lanes` times the writes by, and
    what the SSD wears by (``planning/wear.py``). A catch-up of deferred updates
    (expected, not every step) is not counted."""
    out = dict.fromkeys(("optimizer", "params", "activations", "gradients"), 0.0)
    if c.mode == "none":
        return out
    o = c.placement
    L, A, cb = w.num_layers, w.micro_batches, w.compute_bytes
    sizes = memory_sizes(w, n, o.batch_chunks)
    cache = DeviceCache.of(sizes, o)
    if o.optimizer == "nvme":
        written = w.state_bytes_per_param * (w.params - cache.params) * (1 - cached)
        routing = w.routed_expert_params and o.expert_fetch == "routed"
        if routing and w.deferred_expert_updates:
            routed = max(0, o.recomputed_blocks(L) - max(o.resident_blocks, cache.blocks))
            state = routed * w.routed_expert_params * w.state_bytes_per_param
            written -= deferred_bytes(w, state)[1] * (1 - cached)
        out["optimizer"] = written
    if o.params == "nvme" and not params_are_master(o, cb):
        out["params"] = cb * (w.params - cache.params)
    acts = 0.0
    if o.activations == "nvme":
        acts += max(0, o.recomputed_blocks(L) - IO_READAHEAD) * w.boundary
    if o.swap_blocks and o.swap_tier == "nvme":
        acts += max(0, o.swap_blocks - IO_READAHEAD) * sizes.swap_bytes(o.swap_level)
    out["activations"] = A * acts * n
    out["gradients"] = float(grad_spill)
    return out


def deferred_bytes(w: Workload, state: float) -> tuple[float, float, float]:
    """Deferred expert updates (``optimizer/deferred.py``) over ``state`` bytes of the
    routed experts' optimizer state (all kinds, the master's among them): the bytes a
    step expects not to read and not to write, and the bytes it expects to catch up
    (read and write again, in the forward). An expert gets a token in
    a step with probability q = 1 - (1 - f)^A (f the share a micro-batch routes, A
    micro-batches); without one its state is not read but the master, nor written, and
    it is caught up when it comes back, after a gap: probability q (1 - q)."""
    q = w.expert_step_share
    moments = state * w.state_format.moment_bytes_per_param / w.state_bytes_per_param
    again = state * q * (1 - q)
    return moments * (1 - q) - again, state * (1 - q) - again, again


def _device_optimizer_s(hw: Hardware, params: int) -> float:
    """An optimizer step on the device: memory-bound at ADAM_BYTES per parameter; on the
    CPU backend the device is the host's cores, as fast as the host optimizer."""
    if hw.shared_cores or not hw.device_memory_bw:
        return params / hw.optimizer_params_per_s
    return params * ADAM_BYTES / hw.device_memory_bw
