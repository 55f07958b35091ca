"""Step timelines (train.trace_every) and the metrics.jsonl fields of issue #9."""

import json

import numpy as np
import pytest

from hetjax import timeline
from hetjax.data import make_datasets
from hetjax.metrics import peak_flops
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


def test_metrics_fields_consistent_with_ledger(traced_run, tiny, tmp_path):
    workdir, result = traced_run
    lines = result.records  # what metrics.jsonl gets (verbose=False writes no file)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    fields = (
        "device_bytes_peak",
        "host_bytes",
        "nvme_bytes",
        "mfu",
        "nvme_read_gbs",
        "nvme_write_gbs",
        "optimizer_params_per_s",
    )
    peak = peak_flops("float32")
    for r in lines:
        for f in fields:
            assert f in r and r[f] > 0, f
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / peak)
        for io in ("read", "write"):
            assert r[f"nvme_{io}_gbs"] == pytest.approx(
                r[f"nvme_{io}_bytes"] / r["step_time_s"] / 1e9
            )
        assert r["optimizer_params_per_s"] == pytest.approx(
            r["optimizer_params"] / r["optimizer_busy_s"]
        )

    # The same config, stepped by hand: the fields against the runtime's own books.
    config = _offloaded(tiny)
    runtime = StreamingRuntime(config, workdir=tmp_path)
    try:
        data, _, _ = make_datasets(config)
        t = config.train
        batch = data.batch(0).reshape(1, t.batch_size, t.seq_len + 1)
        m = runtime.train_step(batch).metrics
        assert m["device_bytes_peak"] == runtime.ledger.peak["device"] > 0
        assert m["device_bytes_peak"] <= runtime.plan.required
        state = sum(
            runtime.optimizer.state_bytes(runtime.layout_name(n)) for n in runtime.stage_names
        )
        # No cache (no host budget): every stage's state is read and written once a step.
        assert m["nvme_read_bytes"] == m["nvme_write_bytes"] == state
        assert m["nvme_bytes"] == 2 * state  # two generations on disk
        params = sum(
            runtime.layouts[runtime.layout_name(n)].padded_size for n in runtime.stage_names
        )
        assert m["optimizer_params"] == params
        # Host bytes: the param slabs and gradient buffers, within the host plan. (No
        # clipping: gradients are dropped once updated, so how many were held at once
        # depends on the optimizer thread; the embed's is held until backward ends.)
        plan = runtime.host_plan
        embed_grad = runtime.layouts["embed"].nbytes(np.float32)
        assert plan.param_slabs + embed_grad <= m["host_bytes"] <= plan.required
        # The next step reports its own work, not the sum of both steps'.
        again = runtime.train_step(batch).metrics
        assert again["nvme_read_bytes"] == m["nvme_read_bytes"]
        assert again["optimizer_params"] == params
    finally:
        runtime.close()


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
