import json

from hetjax.bench import main


def test_slabs_quick(tmp_path, capsys):
    out = tmp_path / "slabs.json"
    assert main(["slabs", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["slab_s"] > 0 and result["per_leaf_s"] > 0 and result["pages_s"] > 0
    assert "pages" in capsys.readouterr().out


def test_overhead_quick(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["overhead", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["none_s"] > 0 and result["stream_s"] > 0
    assert abs(result["ratio"] - result["stream_s"] / result["none_s"]) < 1e-9
    assert "stream / none step time" in capsys.readouterr().out


def test_nvme_quick(tmp_path, capsys):
    out = tmp_path / "nvme.json"
    assert main(["nvme", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("raw_write", "raw_read", "ts_write", "ts_read", "optimizer_params_s"):
        assert result[key] > 0, key
    parts = max(result["compute_s"], result["optimizer_s"], result["io_s"])
    assert abs(result["step_vs_max"] - result["step_s"] / parts) < 1e-9
    assert "achieved / raw" in capsys.readouterr().out


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


def test_zero_quick(tmp_path, capsys):
    out = tmp_path / "zero.json"
    assert main(["zero", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2, 4]
    assert rows[0]["measured_bytes"] == 0 and rows[2]["measured_bytes"] > rows[1]["measured_bytes"]
    assert rows[2]["hlo_collectives"]["all-gather"] and rows[2]["hlo_collectives"]["reduce-scatter"]
    assert "6(p-1)/p M" in capsys.readouterr().out
