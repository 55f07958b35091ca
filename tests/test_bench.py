import json
import math

import pytest

from hetjax.bench import main


def test_slabs_quick(tmp_path, capsys):
    out = tmp_path / "slabs.json"
    assert main(["slabs", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["slab_s"] > 0 and result["per_leaf_s"] > 0 and result["pages_s"] > 0
    assert "pages" in capsys.readouterr().out


@pytest.mark.slow  # 11-18 s warm, twice that with a cold compilation cache
def test_overhead_quick(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["overhead", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["none_s"] > 0 and result["stream_s"] > 0
    assert abs(result["ratio"] - result["stream_s"] / result["none_s"]) < 1e-9
    assert abs(result["ratio_keep"] - result["stream_keep_s"] / result["none_s"]) < 1e-9
    assert abs(result["trace_cost"] - result["traced_step_s"] / result["untraced_step_s"]) < 1e-9
    assert result["trace_step_over_busiest"] >= 1.0  # a step is never shorter than a lane
    text = capsys.readouterr().out
    assert "stream / none step time" in text and "params host, opt NVMe" in text
    assert "all blocks kept / none" in text


def test_nvme_quick(tmp_path, capsys, monkeypatch):
    """bench nvme's own rows: the offloaded step against its parts alone. Its disk rows
    (1) and optimizer rows (2) are bench io's and bench optimizer's, run and checked by
    test_io_quick and test_optimizer_quick (the same keys > 0, the same "achieved" lines):
    here they are stubbed out so as not to run them twice."""
    from hetjax.bench import nvme

    monkeypatch.setattr(nvme, "_disk_rows", lambda directory, quick, label="": {})
    monkeypatch.setattr(nvme, "_optimizer_rows", lambda quick, label="": {})
    out = tmp_path / "nvme.json"
    assert main(["nvme", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("step_s", "compute_s", "optimizer_s", "io_s", "io_cold_s"):
        assert result[key] > 0, key
    parts = max(result["compute_s"], result["optimizer_s"], result["io_s"])
    assert abs(result["step_vs_max"] - result["step_s"] / parts) < 1e-9
    assert "optimizer+params on NVMe" in capsys.readouterr().out


@pytest.mark.slow  # a benchmark smoke test
def test_lockfree_quick(tmp_path, capsys):
    out = tmp_path / "lockfree.json"
    assert main(["lockfree", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sync_step_s"] > 0 and result["lockfree_step_s"] > 0
    assert (
        abs(result["loss_gap"] - (result["lockfree_last10_loss"] - result["sync_last10_loss"]))
        < 1e-9
    )
    assert "lockfree - sync loss" in capsys.readouterr().out


def test_io_quick(tmp_path, capsys):
    out = tmp_path / "io.json"
    assert main(["io", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("raw_write", "raw_read", "ts_write", "ts_read"):
        assert result[key] > 0, key
    assert result["read_vs_raw"] == result["ts_read"] / result["raw_read"]
    assert result["write_vs_raw"] == result["ts_write"] / result["raw_write"]
    assert "achieved / raw" in capsys.readouterr().out


def test_optimizer_quick(tmp_path, capsys):
    out = tmp_path / "optimizer.json"
    assert main(["optimizer", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["optimizer_params_s"] > 0 and result["memory_gbs"] > 0
    assert result["bound_params_s"] == result["memory_gbs"] * 1e9 / 28
    rows = result["rows"]
    assert {"optax spare", "optax in place"} <= set(rows)
    assert result["kernel"] == ("native" if "native in place" in rows else "optax")
    headline = rows[f"{result['kernel']} in place"]
    assert result["optimizer_vs_bound"] == headline["vs_bound"] > 0
    assert result["optimizer_params_s"] == headline["median"] <= headline["best"]
    assert "achieved / bound" in capsys.readouterr().out


@pytest.mark.slow  # 11-18 s warm, twice that with a cold compilation cache
def test_scale_quick(tmp_path, capsys):
    """Each size in a child process; the in-memory run stops at the first shape whose
    step needs more than the (tiny) device budget, the offloaded one trains it."""
    out = tmp_path / "scale.json"
    assert main(["scale", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    by_mode = {m: [a for a in result["attempts"] if a["mode"] == m] for m in ("none", "stream")}
    assert [a["fits"] for a in by_mode["none"]] == [True, False]
    assert by_mode["none"][1]["device_bytes"] > result["device_budget"]
    assert all(a["fits"] for a in by_mode["stream"])
    for a in by_mode["stream"]:
        assert 0 < a["device_bytes_peak"] <= result["device_budget"]
        assert a["peak_rss"] > a["host_bytes"] > 0  # the process, measured by the OS
    assert result["stream_largest_params"] > result["none_largest_params"] > 0
    assert result["ratio"] == result["stream_largest_params"] / result["none_largest_params"]
    assert "largest that trains 3 steps" in capsys.readouterr().out


def test_gpu_skips_without_gpu(tmp_path, capsys):
    import jax

    out = tmp_path / "gpu.json"
    assert main(["gpu", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    if jax.devices()[0].platform != "gpu":
        assert "no GPU" in result["skipped"] and "skipped" in capsys.readouterr().out
    else:
        assert result["stream"]["mfu"] > 0 and result["none"]["mfu"] > 0


@pytest.mark.slow  # 11-18 s warm, twice that with a cold compilation cache
def test_zero_quick(tmp_path, capsys):
    out = tmp_path / "zero.json"
    assert main(["zero", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2, 4]
    assert rows[0]["measured_bytes"] == 0 and rows[2]["measured_bytes"] > rows[1]["measured_bytes"]
    assert rows[2]["hlo_collectives"]["all-gather"] and rows[2]["hlo_collectives"]["reduce-scatter"]
    assert "6(p-1)/p M" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_quick(tmp_path, capsys):
    """The planner's prediction and the measured step of the plan it made, one run."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--quick", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["tiny"]
    _check_plan_row(row, 1)
    assert "predicted s" in capsys.readouterr().out


def _check_plan_row(row: dict, devices: int) -> None:
    assert row["devices"] == devices and row["plan"].startswith("stream"), row
    assert row["predicted_s"] > 0 and math.isfinite(row["ratio"]), row
    assert row["ratio"] == row["measured_s"] / row["predicted_s"]


@pytest.mark.slow
def test_plan_data_parallel_row():
    """bench plan's ``tiny dp2`` row: ZeRO-3 on 2 virtual CPU devices, a child process."""
    from hetjax.bench.plan import _plan_row_on_cpu_devices

    row = _plan_row_on_cpu_devices(2, "gpt_tiny", {"memory.device_budget": "88MiB"}, 4)
    _check_plan_row(row, 2)


@pytest.mark.slow  # a benchmark smoke test
def test_keep_quick(tmp_path, capsys):
    out = tmp_path / "keep.json"
    assert main(["keep", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    held = result["held_bytes"]
    assert 0 < held["matmuls"] < held["probs"] < held["all"]
    assert all(t > 0 for t in result["backward_s"].values())
    assert "saved / all" in capsys.readouterr().out


def test_scale_from_names_the_sizes_when_unknown(tmp_path):
    with pytest.raises(SystemExit, match="not one of the sizes: 2x32, 4x128"):
        main(["scale", "--quick", "--from", "3x99", "--out", str(tmp_path / "s.json")])
    with pytest.raises(SystemExit):  # argparse: --from is for scale only
        main(["io", "--quick", "--from", "4x128"])
