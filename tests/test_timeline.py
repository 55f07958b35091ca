"""Step timelines (train.trace_every) and the metrics.jsonl fields of issue #9."""

import gc
import json

import jax
import numpy as np
import pytest

from hetjax import timeline
from hetjax.data import make_datasets
from hetjax.metrics import step_record
from hetjax.parallel.single import live_bytes_by_kind
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _offloaded(tiny, **train_overrides):
    """Params on the host, optimizer state on NVMe, no clipping (one update per stage)."""
    return tiny(
        train=dict(steps=4, eval_batches=0, log_every=100, **train_overrides),
        offload=dict(mode="stream", optimizer="nvme"),
        optimizer=dict(grad_clip=0.0),
        memory=dict(page_size="16KiB"),
    )


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    from conftest import tiny_config

    workdir = tmp_path_factory.mktemp("traced")
    result = train(_offloaded(tiny_config, trace_every=2), workdir, verbose=False)
    return workdir, result


def test_trace_has_every_lane_with_disjoint_spans(traced_run):
    workdir, result = traced_run
    assert sorted(p.name for p in (workdir / "trace").iterdir()) == [
        "step_2.json",
        "step_2.png",
        "step_4.json",
        "step_4.png",
    ]
    assert (workdir / "trace" / "step_4.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads((workdir / "trace" / "step_4.json").read_text())
    events = trace["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(lanes.values()) == sorted(timeline.LANES)
    spans = [e for e in events if e["ph"] == "X"]
    by_lane = {lane: [] for lane in timeline.LANES}
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0
        by_lane[lanes[e["tid"]]].append((e["ts"], e["ts"] + e["dur"]))
    # Every lane saw work on this offloaded step (params host, optimizer NVMe).
    assert all(by_lane[lane] for lane in timeline.LANES), {k: len(v) for k, v in by_lane.items()}
    for lane, intervals in by_lane.items():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end, f"overlapping spans on lane {lane}"
    compute = [e["name"] for e in spans if lanes[e["tid"]] == "compute"]
    assert any("block1 bwd" in n for n in compute) and any("embed fwd" in n for n in compute)
    # The overlap figure: step time / the busiest lane's busy time, also in metrics.jsonl.
    other = trace["otherData"]
    busy = {lane: sum(e - s for s, e in iv) / 1e6 for lane, iv in by_lane.items()}
    assert busy[other["busiest_lane"]] == pytest.approx(max(busy.values()), rel=1e-6)
    assert other["step_over_busiest"] == pytest.approx(other["step_s"] / max(busy.values()))
    rec = result.records[3]
    assert rec["trace_step_over_busiest"] == pytest.approx(other["step_over_busiest"])
    assert "trace_busiest_lane" not in result.records[2]  # step 3 was not traced


# The tiny model's stages (tests/conftest.py: vocab 256, D 32, 2 layers, 32 positions) in
# fp32 elements, by hand from its shapes, padded to whole 16 KiB pages (4096 elements):
# embed wte + wpe = 256 * 32 + 32 * 32 = 9216 -> 12288; a block 12 D^2 + 13 D = 12704
# -> 16384; the head's ln_f 2 D = 64 -> 4096.
TINY_SLAB_ELEMS = 12288 + 2 * 16384 + 4096
TINY_ADAM_STATE_BYTES = 3 * 4 * TINY_SLAB_ELEMS  # fp32 master, mu and nu


def test_metrics_fields_of_an_offloaded_run(traced_run, tiny, tmp_path):
    workdir, result = traced_run
    lines = result.records  # what metrics.jsonl gets (verbose=False writes no file)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    fields = (
        "host_bytes",
        "nvme_bytes",
        "mfu",
        "nvme_read_gbs",
        "nvme_write_gbs",
        "optimizer_params_per_s",
    )
    # the device peak on the accounted steps: the first and the traced ones (trace_every=2)
    assert [r["step"] for r in lines if "device_bytes_peak" in r] == [1, 2, 4]
    assert all(r["device_bytes_peak"] > 0 for r in lines if "device_bytes_peak" in r)
    for r in lines:
        for f in fields:
            assert f in r and r[f] > 0, f
        assert r["mfu"] < 1  # the tiny model is far from the measured matmul peak
        # No cache (no host budget): every stage's state is read and written once a
        # step, and every parameter updated once (no clipping: no redo).
        assert r["nvme_read_bytes"] == r["nvme_write_bytes"] == TINY_ADAM_STATE_BYTES
        assert r["optimizer_params"] == TINY_SLAB_ELEMS

    # The same config, stepped by hand: the device peak against the live device arrays
    # a probe samples after every dispatch, the host bytes against the host plan.
    config = _offloaded(tiny)
    gc.collect()  # earlier tests' garbage must not be freed while samples are taken
    samples = []
    runtime = StreamingRuntime(
        config,
        workdir=tmp_path,
        probe=lambda rt: samples.append(live_bytes_by_kind().get("device", 0)),
    )
    try:
        data, _, _ = make_datasets(config)
        t = config.train
        batch = data.batch(0).reshape(1, t.batch_size, t.seq_len + 1)
        resident = sum(a.nbytes for a in jax.tree.leaves(runtime.resident))
        baseline = live_bytes_by_kind().get("device", 0) - resident
        m = runtime.train_step(batch).metrics
        peak = max(samples) - baseline
        assert abs(m["device_bytes_peak"] - peak) <= 0.05 * peak, (m["device_bytes_peak"], peak)
        assert m["device_bytes_peak"] <= runtime.plan.required
        assert m["nvme_read_bytes"] == m["nvme_write_bytes"] == TINY_ADAM_STATE_BYTES
        assert m["nvme_bytes"] == 2 * TINY_ADAM_STATE_BYTES  # two copies on disk
        assert m["optimizer_params"] == TINY_SLAB_ELEMS
        # Host bytes: the param slabs and gradient buffers, within the host plan. (No
        # clipping: gradients are dropped once updated, so how many were held at once
        # depends on the optimizer thread; the embed's is held until backward ends.)
        plan = runtime.host_plan
        embed_grad = 12288 * 4  # fp32
        assert plan.param_slabs + embed_grad <= m["host_bytes"] <= plan.required
        # The next step reports its own work, not the sum of both steps'.
        again = runtime.train_step(batch).metrics
        assert again["nvme_read_bytes"] == TINY_ADAM_STATE_BYTES
        assert again["optimizer_params"] == TINY_SLAB_ELEMS
    finally:
        runtime.close()


def test_step_record_rates():
    """The derived rates of a step record, for inputs with round answers: 2 TFLOP in
    0.5 s against an 8 TFLOP/s peak is 4 TFLOP/s at MFU 0.5; 3 GB read in 0.5 s is
    6 GB/s; 100 parameters in 0.25 s of optimizer time is 400 per second."""
    rec = step_record(
        7,
        2.5,
        0.5,
        1000,
        2e12,
        8e12,
        nvme_read_bytes=3_000_000_000,
        nvme_write_bytes=1_000_000_000,
        optimizer_params=100,
        optimizer_busy_s=0.25,
    )
    assert rec["step"] == 7 and rec["loss"] == 2.5 and rec["step_time_s"] == 0.5
    assert rec["tokens_per_s"] == 2000
    assert rec["tflops"] == pytest.approx(4.0)
    assert rec["mfu"] == pytest.approx(0.5)
    assert rec["nvme_read_gbs"] == pytest.approx(6.0)
    assert rec["nvme_write_gbs"] == pytest.approx(2.0)
    assert rec["optimizer_params_per_s"] == pytest.approx(400.0)
    bare = step_record(1, 2.5, 0.5, 1000, 2e12)  # no peak, no I/O, no optimizer work
    assert not {"mfu", "nvme_read_gbs", "optimizer_params_per_s"} & bare.keys()


def test_trace_in_memory_runtime(tiny, tmp_path):
    result = train(
        tiny(train=dict(steps=2, trace_every=1, eval_batches=0)), tmp_path, verbose=False
    )
    trace = json.loads((tmp_path / "trace" / "step_2.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["train step"] and spans[0]["cat"] == "compute"
    assert result.records[1]["trace_busiest_lane"] == "compute"
    assert (tmp_path / "trace" / "step_1.png").exists()


def test_merge_spans_and_off_is_noop():
    merged = timeline.merge_spans([(2.0, 3.0, "c"), (0.0, 1.0, "a"), (0.5, 1.5, "b")])
    assert merged == [(0.0, 1.5, "a + b"), (2.0, 3.0, "c")]
    assert timeline.active() is None
    with timeline.span("compute", "x"):  # no recorder: records nothing, costs nothing
        pass
    timeline.watch("compute", "x", np.zeros(3))
    rec = timeline.Recorder(7)
    with timeline.recording(rec):
        assert timeline.active() is rec
        with timeline.span("optimizer", "update"):
            pass
    assert timeline.active() is None
    tl = rec.finish()
    assert [name for _, _, name in tl.spans["optimizer"]] == ["update"]
    assert tl.overlap()["busiest_lane"] == "optimizer"


def test_log_lines_show_the_mean_loss_since_the_last_line(tmp_path, capsys):
    from hetjax.metrics import MetricsWriter

    out = MetricsWriter(tmp_path, total_steps=5, log_every=2)
    for step, loss in enumerate([1.0, 2.0, 3.0, 4.0, 5.0], start=1):
        out.step(dict(step=step, loss=loss, tokens_per_s=1.0, step_time_s=1.0, tflops=0.0))
    out.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    means = [(int(line.split()[1]), line.split("mean of")[1].split()[:2]) for line in lines]
    # step 1 and every 2nd step log; the last step logs what came since
    assert means == [
        (1, ["1", "1.0000"]),
        (2, ["1", "2.0000"]),
        (4, ["2", "3.5000"]),
        (5, ["1", "5.0000"]),
    ]


def test_trace_counts_the_bytes_each_copy_lane_moved(traced_run):
    # No device budget: no resident blocks and a prefetch window of depth 2 over the use
    # order block0 block1 | block1 block0, so a step copies embed and head once (after
    # the update), block 1 once (its forward and backward are adjacent) and block 0 twice,
    # leaf by leaf (the params alone: pages.LeafBuffers); each stage's gradient goes to
    # the host once, the embedding's twice (the tied head's part and its own backward),
    # in whole pages (TINY_SLAB_ELEMS). All fp32.
    from conftest import tiny_config

    from hetjax.parallel.single import SingleDevice
    from models import build_model

    workdir, _ = traced_run
    moved = json.loads((workdir / "trace" / "step_4.json").read_text())["otherData"]["moved_bytes"]
    config = _offloaded(tiny_config)
    layouts = SingleDevice().stage_layouts(build_model(config.model), config.memory.page_size)
    params = {name: layout.size for name, layout in layouts.items()}
    assert params["embed"] < 12288 and params["block"] < 16384  # padding left out
    embed, block, head = 12288, 16384, 4096
    assert moved == {
        "host_to_device": 4 * (params["embed"] + params["head"] + 3 * params["block"]),
        "device_to_host": 4 * (2 * embed + 2 * block + head),
    }
