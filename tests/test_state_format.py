"""The optimizer's state format (hetjax/state_format.py) is the one source of
optimizer-state bytes: a format with 2-byte moments moves the planner's bytes and the
runtime's together, to the bytes counted by hand, and the stores, the I/O pool and the
checkpoint hold each kind in its dtype."""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from hetjax import memory
from hetjax.checkpoint_state import (
    INDEX,
    StateSource,
    StoredState,
    StreamedStateHandler,
    StreamedStateSave,
    layout_meta,
    scalars_meta,
)
from hetjax.config import OptimizerConfig
from hetjax.memory_host import in_memory_parts, nvme_parts, plan_host
from hetjax.optimizer import native
from hetjax.planning.workload import Workload, memory_sizes
from hetjax.runtime import setup
from hetjax.runtime.stages.measure import StageMemory
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import KindFormat, StateFormat, state_format
from hetjax.storage.nvme_states import NvmeStateStore
from hetjax.types import RuntimeState

FP32 = StateFormat.fp32(["mu", "nu"])
BF16_MOMENTS = StateFormat.of(
    {"master": np.float32, "mu": ml_dtypes.bfloat16, "nu": ml_dtypes.bfloat16}
)
INT8_BLOCKS = KindFormat(np.int8, block_size=2048)
EIGHT = dict(num_layers=8, d_model=32, num_heads=4, max_seq_len=32)


def test_every_optimizer_has_fp32_state_of_its_kinds():
    expected = {"adamw": ["mu", "nu"], "adam": ["mu", "nu"], "lion": ["mu"], "sgd": ["trace"]}
    for name, moments in expected.items():
        fmt = state_format(OptimizerConfig(name=name, host_kernel="auto"))
        assert fmt == StateFormat.fp32(moments)
        assert fmt.kinds == ["master", *moments]
        assert fmt.bytes_per_param == 4 * (1 + len(moments))
        assert fmt.nbytes(1000) == 4000 * (1 + len(moments))
    no_momentum = state_format(OptimizerConfig(name="sgd", momentum=0.0))
    assert no_momentum.kinds == ["master"] and no_momentum.bytes_per_param == 4


def test_a_format_declares_the_master_first_and_fp32():
    assert BF16_MOMENTS.moments == ["mu", "nu"] and BF16_MOMENTS.bytes_per_param == 8
    assert BF16_MOMENTS.moment_bytes_per_param == 4
    assert BF16_MOMENTS.nbytes(1000, ["mu"]) == 2000
    with pytest.raises(ValueError, match="master"):
        StateFormat.of({"mu": np.float32, "master": np.float32})
    with pytest.raises(ValueError, match="master is float32"):
        StateFormat.of({"master": ml_dtypes.bfloat16})
    # room for block-quantized moments: counted, not stored yet
    scaled = StateFormat.of({"master": np.float32, "mu": KindFormat(np.int8, block_size=64)})
    assert scaled.nbytes(128) == 128 * 4 + 128 + 2 * 4
    assert scaled.bytes_per_param == 4 + 1 + 4 / 64
    with pytest.raises(NotImplementedError, match="block scales"):
        scaled.dtype("mu")


def test_the_native_kernel_refuses_state_it_cannot_update():
    assert native.refusal(FP32) is None
    assert native.refusal(BF16_MOMENTS) is None  # bfloat16 moments: updated in one pass
    int8 = StateFormat.of({"master": np.float32, **dict.fromkeys(["mu", "nu"], INT8_BLOCKS)})
    assert native.refusal(int8) is None  # int8 blocks of 2048: updated in one pass
    other = KindFormat(np.int8, block_size=4096)  # blocks the kernel does not lay out
    wide = StateFormat.of({"master": np.float32, **dict.fromkeys(["mu", "nu"], other)})
    assert "float32, bfloat16" in native.refusal(wide)
    mixed = StateFormat.of({"master": np.float32, "mu": INT8_BLOCKS, "nu": np.float32})
    assert "float32, bfloat16" in native.refusal(mixed)
    assert "state kinds" in native.refusal(StateFormat.fp32(["mu"]))
    assert native.use_native("auto", "adamw", "cpu", wide) is False
    with pytest.raises(native.NativeKernelError, match="float32, bfloat16"):
        native.use_native("native", "adamw", "cpu", wide)
    slabs = {"master": np.zeros(8, np.float32)}
    slabs |= {k: np.zeros(8, np.int8) for k in ("mu", "nu")}
    grad = [np.zeros(8, np.float32)]
    with pytest.raises(ValueError, match="one dtype the kernel updates"):
        native.host_update(slabs, grad, np.zeros(10, np.float32), 0.0, 0, np.empty(8), 8)


def test_two_byte_moments_move_planner_and_runtime_bytes_together(tiny, tmp_path):
    """The runtime's sizes (``setup.memory_sizes``, as the streaming runtime builds them)
    and the planner's (``Workload`` -> ``memory_sizes``) with the same format give the
    same host and NVMe plans, and both move by the bytes counted by hand when the
    moments are 2 bytes; the NVMe state store built for that format holds those bytes
    on disk and in its I/O pool."""
    offload = dict(mode="stream", params="host", optimizer="nvme", prefetch_depth=1)
    memory_cfg = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    config = tiny(model=EIGHT, offload=offload, memory=memory_cfg)
    runtime = StreamingRuntime(config, workdir=tmp_path / "run")
    try:
        assert runtime.optimizer.state_format == FP32
        o, s, budget = runtime.offload, runtime.sizes, config.memory.host_budget
        t = config.train
        measured = runtime.fns.memory_sizes(t.micro_batch_size, t.seq_len, runtime.compute_dtype)
        stage_memory = StageMemory(s.boundary, s.working_set, s.kept, s.context, s.swapped)
        groups = runtime.model.groups
        fp32_workload = Workload.from_config(config, measured)
        elems = sum(s.own(n) for n in s.stages())  # every stage's slab, whole pages
        biggest = max(s.own(n) for n in s.stages())
        for fmt, per_param in ((FP32, 4 + 4 + 4), (BF16_MOMENTS, 4 + 2 + 2)):
            run = setup.memory_sizes(
                config, groups, runtime.layouts, runtime.state_layouts, stage_memory, fmt
            )
            w = dataclasses.replace(fp32_workload, state_format=fmt)
            planned = memory_sizes(w)
            assert w.state_bytes_per_param == per_param
            run_host, planned_host = plan_host(run, o, budget), plan_host(planned, o, budget)
            assert run_host.parts == planned_host.parts
            assert run_host.cached_stages == planned_host.cached_stages
            run_nvme = nvme_parts(run, o, run_host)
            assert run_nvme == nvme_parts(planned, o, planned_host)
            # by hand: two copies of every stage's state on NVMe; I/O buffers for
            # IO_SLOTS of the biggest stage; a cached stage's old and new state in RAM
            assert run_nvme["optimizer"] == 2 * per_param * elems
            assert run_host.optimizer_io == memory.IO_SLOTS * per_param * biggest
            cached = sum(s.own(n) for n in run_host.cached_stages)
            assert run_host.cache == 2 * per_param * cached
            assert in_memory_parts(run, remat=True)["optimizer"] == (per_param - 4) * elems
            if fmt == FP32:  # the runtime's own plans and store are these
                assert run_host.parts == runtime.host_plan.parts
                assert runtime.states.nvme_bytes == run_nvme["optimizer"]
                continue
            # the store built for 2-byte moments holds what the plan counts
            page_elems = runtime.layouts["embed"].page_elems
            pages = setup.stage_pages(run, o, page_elems)
            store = NvmeStateStore(
                tmp_path / "bf16", fmt, pages, page_elems, cached=[],
                sharding=runtime.parallel.shardings.optimizer, io_slots=memory.IO_SLOTS,
            )  # fmt: skip
            assert store.nvme_bytes == run_nvme["optimizer"]
            for stage in pages:
                n = s.own(stage)
                slabs = {k: np.full(n, 0.5, fmt.dtype(k)) for k in fmt.kinds}
                store.init_stage(stage, slabs, [])
            store.wait_init()
            read = list(pages)[: memory.IO_SLOTS]
            for stage in read:
                slabs, _ = store.get(stage)
                assert {k: a.dtype for k, a in slabs.items()} == fmt.dtypes
                assert all((a == 0.5).all() for a in slabs.values())
            assert store.host_bytes() == run_host.optimizer_io
            assert store.read_bytes == per_param * sum(s.own(n) for n in read)
    finally:
        runtime.close()


@pytest.mark.parametrize("fmt", [FP32, BF16_MOMENTS], ids=["fp32", "bf16-moments"])
def test_checkpoint_holds_each_kind_in_its_dtype(tmp_path, fmt):
    """A checkpoint's pages are in the format's dtypes, and its index records them only
    where one is not fp32 (an fp32 checkpoint is written as it always was)."""
    rng = np.random.default_rng(0)
    tree = lambda: {"w": rng.normal(size=(64, 64)).astype(np.float32)}
    state = RuntimeState({"embed": {k: tree() for k in fmt.kinds}}, {"embed": []})
    source = dataclasses.replace(StateSource.from_state(state), state_format=fmt)
    StreamedStateHandler().save(tmp_path / "state", StreamedStateSave(source))
    index = json.loads((tmp_path / "state" / "proc0" / INDEX).read_text())
    if fmt == FP32:
        assert set(index) == {"page_elems", "num_pages", "kinds", "stages"}
    else:
        assert index["dtypes"] == {"master": "float32", "mu": "bfloat16", "nu": "bfloat16"}
    meta = {"layouts": layout_meta(source.layouts), "scalars": scalars_meta(source.scalars)}
    stored = StoredState(tmp_path / "state", meta)
    assert stored.state_format == fmt
    assert stored.nbytes() == fmt.nbytes(64 * 64)
    for kind in fmt.kinds:
        saved = state.stages["embed"][kind]["w"].reshape(-1)
        read = stored.read("embed", kind, 0, 64 * 64)
        assert read.dtype == fmt.dtype(kind)
        np.testing.assert_array_equal(read, saved.astype(fmt.dtype(kind)))
