"""The planner and the runtime account memory with one model (hetjax/memory.py): for a
grid of placements and budgets, the planner's bytes per tier equal, byte for byte, the
plans the built streaming runtime enforces. That model itself against bytes counted by
hand from a small config's shapes, and against what a step of the runtime measures:
the last test."""

import pytest

from hetjax.config import ConfigError
from hetjax.memory_host import nvme_parts
from hetjax.placement import Placement
from hetjax.planning.search import Candidate, footprint
from hetjax.planning.tracer import trace
from hetjax.planning.workload import Workload
from hetjax.runtime.streaming import StreamingRuntime

EIGHT = dict(num_layers=8, d_model=32, num_heads=4, max_seq_len=32)
# params, optimizer, activations, prefetch depth, kept blocks, cached stages. The first
# two run by default (host state; NVMe state with a Belady cache), the rest with -m slow.
SLOW = pytest.mark.slow
PLACEMENTS = [
    ("host", "host", "device", 2, 0, 0),
    ("host", "nvme", "host", 1, 0, 0),
    pytest.param(("nvme", "nvme", "nvme", 3, 0, 0), marks=SLOW),
    pytest.param(("host", "device", "device", 0, 2, 0), marks=SLOW),
    pytest.param(("nvme", "host", "host", 2, 1, 3), marks=SLOW),
    pytest.param(("host", "nvme", "device", 2, 0, 10), marks=SLOW),  # every stage cached
]
BUDGETS = [("64MiB", "64MiB"), ("1MiB", "3MiB")]  # (device, host): roomy, then tight

# -- what the cells of a grid share (issue #56: a compile paid once per module) -----------
_STAGE_MEMORY: dict = {}
_TRACES: dict = {}


def _stage_memory(config):
    """XLA's measure of the single-device stage functions (``StageFunctions.memory_sizes``)
    of ``config``'s model, pages, micro-batch and dtypes, built as the runtime builds them
    (``runtime/assemble.py``): measured once per module and shared by every placement of
    a grid (placements do not change the stage functions; a runtime that measured
    differently for one would fail its cell: its plan against the planner's from these)."""
    from hetjax.memory import block_grad_dtype
    from hetjax.parallel.single import SingleDevice
    from hetjax.runtime.stages.functions import StageFunctions
    from models import build_model

    t, m, off = config.train, config.model, config.offload
    grad_dtype = block_grad_dtype(config)
    key = (m, config.memory.page_size, t.micro_batch_size, t.seq_len, grad_dtype)
    key += (off.keep_level, off.batch_chunks)
    if key not in _STAGE_MEMORY:
        parallel = SingleDevice()
        layouts = parallel.stage_layouts(build_model(m), config.memory.page_size)
        fns = StageFunctions(
            build_model(m, parallel.expert_axis), layouts, parallel, block_grad_dtype=grad_dtype,
            keep_level=off.keep_level, batch_chunks=off.batch_chunks,
        )  # fmt: skip
        _STAGE_MEMORY[key] = fns.memory_sizes(t.micro_batch_size, t.seq_len, m.compute_dtype)
    return _STAGE_MEMORY[key]


def _traced(config, devices: int, tensor: int = 1):
    """``planning.tracer.trace(config, repeats=1, devices, tensor)`` of ``config`` with its
    placement at the defaults, once per module for each model, split and pages: the
    tracer reads of the offload section only ``batch_chunks`` (and the workload
    ``expert_fetch``, "all" in every cell here), the placement is the candidate's
    (``footprint``), so the cells that differ only in placement plan from one trace, as
    ``offload.mode=auto`` traces a config before it chooses a placement."""
    placement_free = config.replace(
        offload=dict(
            params="host", optimizer="host", activations="device", prefetch_depth=2,
            keep_blocks=0, swap_blocks=0, optimizer_device_stages=0, expert_fetch="all",
        )
    )  # fmt: skip
    key = (placement_free, devices, tensor)
    if key not in _TRACES:
        _TRACES[key] = trace(placement_free, repeats=1, devices=devices, tensor=tensor)
    return _TRACES[key]


@pytest.mark.parametrize(  # clipping kept gradients (keep) is the default
    "clip", [pytest.param(0.0, marks=pytest.mark.slow), 1.0], ids=["release", "keep"]
)
@pytest.mark.parametrize("device_budget,host_budget", BUDGETS, ids=["roomy", "tight"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "-".join(map(str, p)))
def test_planner_bytes_equal_the_runtime_plans(
    tiny, tmp_path, placement, device_budget, host_budget, clip
):
    params, optimizer, acts, depth, keep, cached = placement
    offload = dict(
        mode="stream",
        params=params,
        optimizer=optimizer,
        activations=acts,
        prefetch_depth=depth,
        keep_blocks=keep,
        optimizer_device_stages=cached,
    )
    memory = dict(page_size="16KiB", device_budget=device_budget, host_budget=host_budget)
    config = tiny(model=EIGHT, offload=offload, memory=memory, optimizer=dict(grad_clip=clip))
    try:
        runtime = StreamingRuntime(config, workdir=tmp_path)
    except ConfigError as e:  # a placement that does not fit: the planner must say so too
        runtime, refused = None, e
    # the stage functions' sizes, measured once for every cell (the runtime measures its
    # own: its plans are checked against the planner's from these)
    w = Workload.from_config(config, _stage_memory(config))
    c = Candidate(
        placement=Placement(
            params=params, optimizer=optimizer, activations=acts, prefetch_depth=depth,
            keep_blocks=keep, device_stages=cached, expert_fetch="all",
        )
    )  # fmt: skip
    limit = {"device": config.memory.device_budget, "host": config.memory.host_budget}
    f = footprint(w, c, {**limit, "nvme": 1 << 40})
    if runtime is None:
        assert f is None, f"the runtime refused ({refused}), the planner did not"
        return
    try:
        assert f is not None, "the runtime fits, the planner says it does not"
        assert f.device == runtime.plan.parts
        assert f.host == runtime.host_plan.parts
        assert f.nvme == nvme_parts(runtime.sizes, runtime.offload, runtime.host_plan)
        assert f.candidate.placement.prefetch_depth == runtime.plan.prefetch_depth
        assert f.candidate.placement.resident_blocks == runtime.plan.resident_blocks
        assert sum(f.device.values()) <= limit["device"]
        assert sum(f.host.values()) <= limit["host"]
    finally:
        runtime.close()


def test_planner_bytes_for_a_small_config_by_hand(tiny, tmp_path):
    """The 8-block tiny GPT (d 32, vocab 256, 32 positions, 4 x 16 tokens a micro-batch),
    params in RAM, optimizer state on NVMe, boundaries in RAM, prefetch depth 1, clipping
    (gradients kept for a redo), budgets that hold everything: every part of the
    planner's footprint counted by hand from the model's shapes, and a step of the
    runtime against it (its NVMe bytes exactly; the device and host bytes it measures
    within the plan's)."""
    from equivalence import training_batches

    offload = dict(mode="stream", optimizer="nvme", activations="host", prefetch_depth=1)
    memory = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    config = tiny(model=EIGHT, offload=offload, memory=memory, optimizer=dict(grad_clip=1.0))
    # Params: embed 256 x 32 tokens + 32 x 32 positions = 9,216; a block 2 norms x 2 x 32,
    # qkv 32 x 96 + 96, out 32 x 32 + 32, mlp 32 x 128 + 128 and 128 x 32 + 32 = 12,704;
    # the head its norm, 2 x 32 = 64 (tied to the embed). 16 KiB pages: 4,096 fp32
    # elements (a block fills 4 pages: the fitted page is the whole 16 KiB).
    page = 4096
    embed, block, head = 3 * page, 4 * page, 1 * page  # 9,216, 12,704 and 64, padded
    stages = embed + 8 * block + head  # 147,456 elements
    boundary = 4 * 16 * 32 * 4  # a (B, T, D) fp32 activation: 8 KiB
    state = 12  # bytes an element: fp32 master, mu and nu
    device = {
        "embed+head": 4 * (embed + head),
        "blocks": 4 * block * 8,  # the 64 MiB budget holds every block resident
        "gradients": 2 * 4 * block,  # two slabs, the block's the larger
        "boundaries": 2 * boundary,  # one going out, one coming in
        "contexts": 0,
        "kept": 0,
        "swapped": 0,
        "optimizer": 0,
    }
    host = {
        "params": 4 * stages + 2 * 4 * block,  # all, and two refreshed on their way
        "params kept for backward": 0,
        "params kept to their next read": 0,
        "gradients": 4 * stages,  # every stage's, kept for a clipping redo
        "optimizer": 0,
        "optimizer I/O": 4 * state * block,  # 2 read ahead, 1 updating, 1 written back
        "boundaries": 8 * boundary,
        "swapped activations": 0,
        "optimizer cache": 2 * state * stages,  # all of it (old and new) fits the budget
    }
    nvme = {"optimizer": 2 * state * stages}  # two copies
    nvme |= {"params": 0, "boundaries": 0, "swapped activations": 0, "gradients": 0}

    runtime = StreamingRuntime(config, workdir=tmp_path)
    try:
        t = config.train
        sizes = runtime.fns.memory_sizes(t.micro_batch_size, t.seq_len, runtime.compute_dtype)
        w = Workload.from_config(config, sizes)
        placement = Placement(
            params="host", optimizer="nvme", activations="host", prefetch_depth=1,
            expert_fetch="all",
        )  # fmt: skip
        budgets = {"device": 64 << 20, "host": 64 << 20, "nvme": 1 << 40}
        f = footprint(w, Candidate(placement=placement), budgets)
        # the working set is XLA's (the compiled stage functions'), not countable by hand
        assert f.device == device | {"working set": sizes.working_set}
        assert f.host == host
        assert f.nvme == nvme
        assert f.candidate.placement.resident_blocks == 8
        report = runtime.train_step(training_batches(config, 1)[0])  # accounted: the first
        assert report.metrics["nvme_bytes"] == nvme["optimizer"]
        # what the runtime holds, measured by its ledger and its stores, within the plan
        assert 0 < report.metrics["device_bytes_peak"] <= sum(f.device.values())
        assert 0 < report.metrics["host_bytes"] <= sum(f.host.values())
    finally:
        runtime.close()


@pytest.mark.slow  # ~15 s: a 4-device runtime and the tracer
@pytest.mark.parametrize(
    "keep, optimizer, cached",
    [(0, "host", 0), (1, "host", 0), (0, "host", 3), (0, "device", 0)],
    ids=["streamed", "kept", "device_cache", "optimizer_device"],
)
def test_planner_bytes_agree_with_the_runtime_on_4_devices(tiny, tmp_path, keep, optimizer, cached):
    """ZeRO-3 on 4 devices (tiny GPT, 2 blocks of 4 pages of 16 KiB): the planner, from
    what ``offload.mode=auto`` gives it (the tracer's one-device measurement at a
    device's rows), counts each device's bytes as the built runtime does (XLA's own
    measure of the ZeRO-3 stage functions): the gradient slabs each device holds after
    the reduce-scatter byte for byte (two, a quarter of the block's 64 KiB each, counted
    by hand), every other part but the measured ones equal, and the working set (the
    reduce-scatter's temporaries: the whole gradient) and a kept block (its gathered
    pages, padding included) not below the runtime's, nor 5% above it. Optimizer state
    on the device (the device cache's 3 stages, or every stage's): each device holds a
    quarter of it (``optimizer/sharded_slab.py``), as the planner counts."""
    from hetjax.parallel.zero import Zero3

    offload = dict(
        mode="stream", params="host", optimizer=optimizer, keep_blocks=keep,
        optimizer_device_stages=cached,
    )  # fmt: skip
    memory = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    config = tiny(offload=offload, memory=memory, distributed=dict(data_parallel=4))
    runtime = StreamingRuntime(config, workdir=tmp_path, parallel=Zero3(config))
    try:
        w = _traced(config, devices=4)
        placement = Placement(
            params="host", optimizer=optimizer, activations="device", keep_blocks=keep,
            prefetch_depth=config.offload.prefetch_depth, expert_fetch="all",
            device_stages=cached,
        )  # fmt: skip
        budgets = {"device": 64 << 20, "host": 64 << 20, "nvme": 1 << 40}
        f = footprint(w, Candidate(placement=placement), budgets, 4)
        ran = runtime.plan.parts
        assert ran["gradients"] == 2 * 4 * (4 * 4096) // 4  # two fp32 slabs, a quarter each
        # the default AdamW: fp32 master, mu and nu (12 bytes an element), twice during a
        # step; embed (3 pages) and each block (4) padded to 4 pages of 4,096, the head 4:
        # a quarter of each on each device; the cache adds its params (fp32) and its
        # stages' kept gradients (fp32: clipping keeps them)
        quarter = 4096  # elements of one stage on one device
        if optimizer == "device":  # embed, 2 blocks and the head
            assert ran["optimizer"] == 2 * 12 * 4 * quarter
        elif cached:
            assert ran["optimizer"] == (2 * 12 + 4 + 4) * 3 * quarter
        measured = ("working set", "kept")
        assert {k: v for k, v in f.device.items() if k not in measured} == {
            k: v for k, v in ran.items() if k not in measured
        }
        for part in measured if keep else measured[:1]:
            assert ran[part] <= f.device[part] <= 1.05 * ran[part], (part, f.device, ran)
        assert f.candidate.placement.resident_blocks == runtime.plan.resident_blocks
    finally:
        runtime.close()


@pytest.mark.slow  # ~25 s: two tensor-parallel runtimes and the tracer
@pytest.mark.parametrize("data", [1, 2], ids=["1x2", "2x2"])
def test_planner_bytes_agree_with_the_runtime_under_tensor_parallelism(tiny, tmp_path, data):
    """Data x tensor = 1 x 2 and 2 x 2 (tiny GPT, 2 blocks, d 32, vocab 256, 32
    positions; 4 x 16 tokens a micro-batch; 16 KiB pages of 4,096 fp32 elements): the
    planner, from what ``auto`` gives it (the tracer at a device's rows, ``tensor``),
    counts each device's bytes as the built runtime does, both counted by hand. A block
    (12,704 params) splits its attention-out (1,024) and MLP (8,192) weights: a 1/2
    slice is 4,608 elements (2 pages, a multiple of the data devices); the rest stays
    dense (3,488: the fused QKV kernel, which the rules do not split, norms, biases),
    1 page padded to a multiple of every device: a device computes with 2 + 2 pages at
    1 x 2 and 4 + 2 at 2 x 2. The embed's token table splits by vocab (slice 4,096: 1
    page, 2 at 2 data devices) beside 1,024 dense positions; the embed and the tied
    head's norm (64: 1 page) are held as stored: dense pages + 2 slices, and n pages:
    4 + 2 pages at 1 x 2, 8 + 4 at 2 x 2. The window holds both blocks (depth 1, lag 1);
    gradients: two slabs of the larger of a block's and the embed's, reduce-scattered
    over every device; boundaries: the 2 kept (B, T, D) of a data group's rows (4 /
    data x 16 x 32 x 4 B). The working set (XLA's, its collectives' temporaries
    included) the runtime's: the tracer measures it as the runtime does, on the mesh
    (estimated from the one device's measurement it was 1.09 and 1.19 of it)."""
    from hetjax.parallel.zero import Zero3

    offload = dict(mode="stream", params="host", optimizer="host")
    memory = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    dist = dict(data_parallel=data, tensor_parallel=2)
    config = tiny(offload=offload, memory=memory, distributed=dist)
    n, page = 2 * data, 4 * 4096
    runtime = StreamingRuntime(config, workdir=tmp_path, parallel=Zero3(config))
    try:
        w = _traced(config, devices=n, tensor=2)
        placement = Placement(
            params="host", optimizer="host", activations="device",
            prefetch_depth=config.offload.prefetch_depth, expert_fetch="all",
        )  # fmt: skip
        budgets = {"device": 64 << 20, "host": 64 << 20, "nvme": 1 << 40}
        f = footprint(w, Candidate(placement=placement), budgets, n)
        compute_pages = {1: 2 + 2, 2: 4 + 2}[data]  # the dense pages and one 1/2 slice
        embed_pages = {1: 4, 2: 8}[data]
        by_hand = {
            "embed+head": page * (embed_pages + n),
            "blocks": 2 * compute_pages * page,
            "gradients": 2 * max(compute_pages, embed_pages) * page // n,
            "boundaries": 2 * (4 // data) * 16 * 32 * 4,
            "contexts": 0,
            "kept": 0,
            "swapped": 0,
            "optimizer": 0,
        }
        ran = runtime.plan.parts
        assert {k: v for k, v in f.device.items() if k != "working set"} == by_hand
        assert {k: v for k, v in ran.items() if k != "working set"} == by_hand
        assert f.device["working set"] == ran["working set"]
        # host RAM per device: the process's (one process drives every device) / n
        assert {k: n * v for k, v in f.host.items()} == runtime.host_plan.parts
    finally:
        runtime.close()


MOE = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
    num_experts=4, experts_per_token=2, tie_embeddings=False, vocab_size=256, max_seq_len=32,
)  # fmt: skip


@pytest.mark.slow  # ~3 s each: a 4-device runtime and the tracer
@pytest.mark.parametrize(
    "model, dist, optimizer, cached",
    [
        (MOE, dict(data_parallel=2, expert_parallel=2), "device", 0),
        ({}, dict(data_parallel=2, tensor_parallel=2), "host", 3),
    ],
    ids=["expert_2x2_optimizer_device", "tensor_2x2_device_cache"],
)
def test_planner_counts_device_state_per_device_as_the_runtime_does(
    tiny, tmp_path, model, dist, optimizer, cached
):
    """Optimizer state on the device under expert and tensor parallelism (4 devices in
    one process, each holding and updating its own pages: ``optimizer/sharded_slab.py``):
    the planner, from the tracer's workload, counts each device's bytes of it as the
    built runtime does."""
    from hetjax.parallel.zero import Zero3

    offload = dict(
        mode="stream", params="host", optimizer=optimizer, optimizer_device_stages=cached,
        expert_fetch="all",
    )  # fmt: skip
    memory = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    config = tiny(model=model, offload=offload, memory=memory, distributed=dist)
    runtime = StreamingRuntime(config, workdir=tmp_path, parallel=Zero3(config))
    try:
        w = _traced(config, devices=4, tensor=dist.get("tensor_parallel", 1))
        placement = Placement(
            params="host", optimizer=optimizer, activations="device", expert_fetch="all",
            prefetch_depth=config.offload.prefetch_depth, device_stages=cached,
        )  # fmt: skip
        budgets = {"device": 64 << 20, "host": 64 << 20, "nvme": 1 << 40}
        f = footprint(w, Candidate(placement=placement), budgets, 4)
        assert runtime.plan.parts["optimizer"] > 0
        assert f.device["optimizer"] == runtime.plan.parts["optimizer"]
    finally:
        runtime.close()


def _held_by_blocks(monkeypatch) -> dict[int, list[int]]:
    """What each block hands the runtime's ledger to hold on a device between its forward
    and its backward (a kept block's vjp; a swapped block's residuals, out to the host
    and back), per device (``ledger.device_bytes`` of each array), each time, by block."""
    import jax

    from hetjax.runtime.loop.ledger import Ledger, device_bytes

    held: dict[int, list[int]] = {}
    hold = Ledger.hold

    def recording(self, key, arrays):
        if isinstance(key, tuple) and key[0] == "block":
            on_device = [
                a for a in jax.tree.leaves(arrays)
                if isinstance(a, jax.Array) and (a.sharding.memory_kind or "device") == "device"
            ]  # fmt: skip
            held.setdefault(key[1], []).append(sum(map(device_bytes, on_device)))
        return hold(self, key, arrays)

    monkeypatch.setattr(Ledger, "hold", recording)
    return held


T5 = dict(
    family="t5", num_layers=2, num_decoder_layers=3, d_model=32, num_heads=4, d_ff=64,
    layer_norm_eps=1e-6, tie_embeddings=False, relative_attention_num_buckets=8,
    relative_attention_max_distance=12,
)  # fmt: skip
TENSOR_2X2, TENSOR_1X2 = dict(data_parallel=2, tensor_parallel=2), dict(tensor_parallel=2)


@pytest.mark.slow  # ~10 s each, the MoE and T5 under tensor parallelism 30-60 s
@pytest.mark.parametrize(
    "model, dist, blocks",
    [
        ({}, TENSOR_2X2, "keep"),
        ({}, TENSOR_2X2, "swap"),
        ({}, dict(data_parallel=1, **TENSOR_1X2), "keep"),
        ({}, dict(data_parallel=1, **TENSOR_1X2), "swap"),
        (MOE, dict(data_parallel=2, expert_parallel=2), "keep"),
        (MOE, dict(data_parallel=2, expert_parallel=2), "swap"),
        (MOE, TENSOR_2X2, "keep"),
        (MOE, dict(data_parallel=1, **TENSOR_1X2), "swap"),
        (T5, TENSOR_2X2, "keep"),  # (a model of two stage groups swaps no blocks)
        (T5, dict(data_parallel=1, **TENSOR_1X2), "keep"),
    ],
    ids=[
        "gpt_tensor_2x2-keep", "gpt_tensor_2x2-swap", "gpt_tensor_1x2-keep",
        "gpt_tensor_1x2-swap", "moe_expert_2x2-keep", "moe_expert_2x2-swap",
        "moe_tensor_2x2-keep", "moe_tensor_1x2-swap", "t5_tensor_2x2-keep",
        "t5_tensor_1x2-keep",
    ],
)  # fmt: skip
def test_planner_counts_kept_and_swapped_blocks_per_device_as_the_ledger_measures(
    tiny, tmp_path, monkeypatch, model, dist, blocks
):
    """Under tensor parallelism (data x tensor 2 x 2 and 1 x 2: the tiny GPT, MoE and
    T5) and expert parallelism (2 x 2, the tiny MoE), one kept block (level all) or one
    swapped block (level matmuls): the planner, from what ``auto`` gives it (the tracer
    on this machine's devices), counts each device's bytes of it as the runtime's
    ledger measures them in a step (what the block hands it to hold on a device: the
    kept vjp's arrays, the swapped residuals back on the device, each array's shard),
    and every part of a device's bytes as the runtime's own plan counts them (the
    working set and contexts from the same mesh measurement). (A split weight's
    activations are split over the model axis, the model-wide ones whole on each
    device: only XLA's layout says which, so both are measured from it, not from a
    one-device trace.)"""
    from equivalence import training_batches

    from hetjax.parallel.zero import Zero3

    keep, swap = (1, 0) if blocks == "keep" else (0, 1)
    offload = dict(
        mode="stream", params="host", optimizer="host", keep_blocks=keep, swap_blocks=swap,
        expert_fetch="all",
    )  # fmt: skip
    memory = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    data = dict(objective="prefix_lm") if model is T5 else {}  # T5's encoder reads a prefix
    config = tiny(model=model, data=data, offload=offload, memory=memory, distributed=dist)
    tensor = dist.get("tensor_parallel", 1)
    devices = dist["data_parallel"] * tensor * dist.get("expert_parallel", 1)
    held = _held_by_blocks(monkeypatch)
    runtime = StreamingRuntime(config, workdir=tmp_path, parallel=Zero3(config))
    try:
        runtime.train_step(training_batches(config, 1)[0])
        # the last block keeps or swaps (the last blocks keep, those before them swap);
        # a kept block holds its vjp once; a swapped one nothing on the device as it
        # goes out (its residuals on the host), then its residuals back for its backward
        last = config.model.num_blocks - 1
        measured = held[last][-1]
        assert measured > 0 and held == {last: [measured] if keep else [0, measured]}, held
        w = _traced(config, devices=devices, tensor=tensor)
        placement = Placement(
            params="host", optimizer="host", activations="device", keep_blocks=keep,
            swap_blocks=swap, prefetch_depth=config.offload.prefetch_depth,
            expert_fetch="all",
        )  # fmt: skip
        budgets = {"device": 64 << 20, "host": 64 << 20, "nvme": 1 << 40}
        f = footprint(w, Candidate(placement=placement), budgets, devices)
        part = "kept" if keep else "swapped"
        assert f.device[part] == measured, (part, f.device[part], held)
        assert runtime.plan.parts[part] == measured
        assert f.device == runtime.plan.parts
    finally:
        runtime.close()
