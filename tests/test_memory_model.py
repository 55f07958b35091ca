"""The planner and the runtime account memory with one model (hetjax/memory.py): for a
grid of placements and budgets, the planner's bytes per tier equal, byte for byte, the
plans the built streaming runtime enforces."""

import pytest

from hetjax.config import ConfigError
from hetjax.memory_host import nvme_parts
from hetjax.placement import Placement
from hetjax.planning.search import Candidate, footprint
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
    t = config.train
    sizes = None
    if runtime is not None:
        sizes = runtime.fns.memory_sizes(t.micro_batch_size, t.seq_len, runtime.compute_dtype)
    else:  # the same sizes, measured without a runtime
        from hetjax.runtime.placement import SingleDevice
        from hetjax.runtime.stages import StageFunctions, stage_layouts
        from models import build_model

        model = build_model(config.model)
        layouts = stage_layouts(model, config.memory.page_size)
        fns = StageFunctions(model, layouts, SingleDevice())
        sizes = fns.memory_sizes(t.micro_batch_size, t.seq_len, config.model.compute_dtype)
    w = Workload.from_config(config, sizes)
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
