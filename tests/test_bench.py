import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hetjax.bench import main


@pytest.mark.slow  # a benchmark smoke test (14 s cold)
def test_slabs_quick(tmp_path, capsys):
    out = tmp_path / "slabs.json"
    assert main(["slabs", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["slab_s"] > 0 and result["per_leaf_s"] > 0 and result["pages_s"] > 0
    assert "pages" in capsys.readouterr().out
    # a block's forward copies no weight out of pages when it takes leaf buffers
    for dtype in ("float32", "bfloat16"):
        assert result[f"{dtype}_block_fwd_leaves_concatenates"] == 0
        assert result[f"{dtype}_block_fwd_pages_concatenates"] > 0
        assert result[f"{dtype}_block_bwd_leaves_temp_bytes"] > 0


@pytest.mark.slow  # 11-18 s warm, twice that with a cold compilation cache
def test_overhead_quick(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["overhead", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in (
        "none_s",
        "stream_s",
        "stream_swap_s",
        "stream_keep_s",
        "traced_step_s",
        "untraced_step_s",
    ):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["trace_step_over_busiest"] >= 1.0  # a step is never shorter than a lane
    text = capsys.readouterr().out
    assert "params host, opt NVMe" in text
    # the ratios saved are the ones printed
    assert f"stream / none step time: {result['ratio']:.3f}" in text, text
    assert f"all blocks kept / none: {result['ratio_keep']:.3f}" in text, text
    ratios = f"{result['ratio']:.3f} / {result['ratio_swap']:.3f} / {result['ratio_keep']:.3f}"
    assert f"recompute / swap / keep: {result['stream_s']:.4f} / " in text, text
    assert f"s/step; / none: {ratios}" in text, text
    assert f"traced / untraced steps of one run: {result['trace_cost']:.3f}" in text, text


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
    text = capsys.readouterr().out
    assert f"optimizer+params on NVMe, sync: {result['step_s']:.3f} s/step" in text, text
    assert f"step / max = {result['step_vs_max']:.2f}" in text, text  # saved as printed


@pytest.mark.slow  # a benchmark smoke test
def test_lockfree_quick(tmp_path, capsys):
    out = tmp_path / "lockfree.json"
    assert main(["lockfree", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sync_step_s"] > 0 and result["lockfree_step_s"] > 0
    assert math.isfinite(result["sync_last10_loss"] + result["lockfree_last10_loss"])
    text = capsys.readouterr().out
    assert f"lockfree - sync loss: {result['loss_gap']:+.4f} nats" in text, text


def test_io_quick(tmp_path, capsys):
    out = tmp_path / "io.json"
    assert main(["io", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("raw_write", "raw_read", "ts_write", "ts_read", "tier_read"):
        assert result[key] > 0, key
    # the bandwidths and ratios saved are the ones printed
    rows = {line[:33].strip(): line[33:].split() for line in capsys.readouterr().out.splitlines()}
    assert rows["raw O_DIRECT, sequential"] == [
        f"{result[k]:.2f}" for k in ("raw_write", "raw_read")
    ]
    assert rows["TensorStore PageStore"] == [f"{result[k]:.2f}" for k in ("ts_write", "ts_read")]
    ratios = [f"{result[k]:.2f}" for k in ("write_vs_raw", "read_vs_raw")]
    assert rows["achieved / raw"] == ratios
    # the sweep of TensorStore's settings: every file_io_mode, two more concurrencies
    # and page sizes, each measured
    settings = result["settings"]
    assert {s["mode"] for s in settings} == {"default", "direct", "memmap"}
    assert {s["concurrency"] for s in settings} >= {4, 16, 64}
    assert {s["page"] >> 20 for s in settings} == {1, 4, 16}
    assert all(s["write"] > 0 and s["read"] > 0 for s in settings)
    # the tier's reads and writes with and without the live page checksums
    names = {f"{w}, {c}" for w in ("write", "read") for c in ("checked", "unchecked")}
    assert set(result["checksums"]) == names
    assert all(row["GBps"] > 0 for row in result["checksums"].values())
    for what in ("write", "read"):  # checked over unchecked, as saved
        checked, unchecked = (
            result["checksums"][f"{what}, {c}"]["GBps"] for c in ("checked", "unchecked")
        )
        assert result["checksum_cost"][what] == pytest.approx(checked / unchecked)
    assert set(result["checksum_rates"]) == {
        "CRC-32C (storage/checksums.py)",
        "zlib CRC-32 (before)",
        "page copy (memory bound)",
    }
    assert all(rate > 0 for rate in result["checksum_rates"].values())


def test_optimizer_quick(tmp_path, capsys):
    out = tmp_path / "optimizer.json"
    assert main(["optimizer", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["optimizer_params_s"] > 0 and result["memory_gbs"] > 0
    rows = result["rows"]
    assert {"optax spare", "optax in place"} <= set(rows)
    assert result["kernel"] == ("native" if "native in place" in rows else "optax")
    # the NVMe tier's update: the native kernel over host buffers, or optax in place
    headline = rows["native host" if result["kernel"] == "native" else "optax in place"]
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
        # one copy of fp32 master, m and v (no clipping: written in place), page padding
        assert 12 <= a["disk_bytes_per_param"] < 18
    assert result["stream_largest_params"] > result["none_largest_params"] > 0
    text = capsys.readouterr().out
    assert (
        f"largest that trains 3 steps: offloaded {result['stream_largest_params'] / 1e6:.1f}M"
        in text
    )
    assert f"ratio {result['ratio']:.1f}x" in text, text  # saved as printed


def test_gpu_skips_without_gpu_and_never_starts_jax(tmp_path):
    """``bench gpu`` in a fresh process: it skips without a GPU (or runs gpucheck's mfu
    rows on one) and never starts JAX's backend itself (its rows' children need the
    device's whole pool)."""
    out = tmp_path / "gpu.json"
    code = (
        "import sys; from hetjax.bench import main; rc = main(sys.argv[1:]); "
        "from jax._src import xla_bridge; print('backends', len(xla_bridge._backends)); "
        "sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "gpu", "--quick", "--out", str(out)],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backends 0" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    if result["platform"] in ("cuda", "rocm"):
        checks = {r["check"]: r for r in result["checks"]}
        assert checks["offloaded_vs_in_hbm"]["in_hbm_mfu"] > 0
    else:
        assert "no GPU" in result["skipped"] and "skipped" in proc.stdout


@pytest.mark.slow  # 11-18 s warm, twice that with a cold compilation cache
def test_zero_quick(tmp_path, capsys):
    out = tmp_path / "zero.json"
    assert main(["zero", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2, 4, 2, 2, 4, 4]
    assert rows[0]["measured_bytes"] == 0 and rows[2]["measured_bytes"] > rows[1]["measured_bytes"]
    assert rows[2]["hlo_collectives"]["all-gather"] and rows[2]["hlo_collectives"]["reduce-scatter"]
    for fp32, bf16 in ((rows[3], rows[4]), (rows[5], rows[6])):  # bf16: reduce fp32, bf16
        assert fp32["compute_dtype"] == bf16["compute_dtype"] == "bfloat16"
        assert fp32["all_gather_bytes"] == bf16["all_gather_bytes"]
        assert bf16["reduce_scatter_bytes"] < fp32["reduce_scatter_bytes"]
    assert "6(p-1)/p M" in capsys.readouterr().out
    tensor = json.loads(out.read_text())["tensor_rows"]
    assert [(r["data"], r["tensor"]) for r in tensor] == [
        (1, 1),
        (2, 1),
        (4, 1),
        (1, 2),
        (1, 4),
        (2, 2),
    ]
    for r in tensor:  # the blocks all-reduce over the model axis only with tensor parallelism
        assert (r["tensor_bytes"] > 0) == (r["tensor"] > 1), r
        assert (r["tensor_ops"].get("all-reduce", 0) > 0) == (r["tensor"] > 1), r
    assert tensor[3]["zero_bytes"] > 0 and tensor[3]["megatron_bytes"] > 0


def test_zero_formula_bytes_by_hand():
    """bench zero's ZeRO-3 bytes a device moves a step, fp32, from M params of which some
    are split over the model axis: 3(p-1)/p M x 4 without tensor parallelism; with it the
    dense params gathered twice over all p devices, a device's slice of the split ones
    over the S data devices, and the gradient of both scattered over S."""
    from hetjax.bench.zero import zero_formula_bytes

    assert zero_formula_bytes(1000, 0, 4, 1) == 4 * 3 * 750  # 3/4 of 1,000, three times
    assert zero_formula_bytes(1000, 600, 1, 2) == 4 * 2 * 200  # dense 400 over 2; no scatter
    # 2 x 2: dense 400 over 4 (300 sent) and the slice 300 over 2 (150), twice; their
    # gradient (400 + 300) over 2 (350)
    assert zero_formula_bytes(1000, 600, 2, 2) == 4 * (2 * (300 + 150) + 350)


def test_wire_bytes_of_hlo_collectives_by_hand():
    """Bytes a device sends for collectives in compiled HLO text, each counted by hand
    (ring algorithms over groups of g: all-reduce 2(g-1)/g of its bytes, all-gather
    (g-1)/g of its result, reduce-scatter (g-1)/g of its operand, all-to-all (g-1)/g,
    a permute its bytes), the three ways XLA writes replica groups."""
    from hetjax.bench.zero import wire_bytes

    hlo = "\n".join([
        "%all-reduce.2 = f32[16,64,64]{2,1,0} all-reduce(%x), channel_id=27, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=2] {'axis_2'}, to_apply=%add",
        "%all-gather.4 = f32[4,13312]{0,1} all-gather(%y), channel_id=32, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=2] {'axis_1'}, dimensions={1}",
        "%reduce_scatter.6 = f32[1,4096]{1,0} reduce-scatter(%z), channel_id=1, "
        "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add",
        "%all-to-all.8 = (f32[1,8,64,32]{3,2,1,0}, f32[1,8,64,32]{3,2,1,0}) all-to-all(%a, %b), "
        "channel_id=17, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1] {'axis_0'}",
        "%collective-permute.1 = f32[256]{0} collective-permute(%c), channel_id=3, "
        "source_target_pairs={{0,1},{1,0}}",
        "%all-reduce.9 = bf16[8]{0} all-reduce(%d), replica_groups=[2,2]<=[4], to_apply=%add",
        "%fusion.1 = f32[13312]{0} fusion(%all-reduce.2, %c), kind=kCustom",  # a use: no
    ])  # fmt: skip
    assert wire_bytes(hlo) == {
        "all-reduce": 16 * 64 * 64 * 4 + 8 * 2,  # 2 x 1/2 of 262,144 B; of 16 B
        "all-gather": 4 * 13312 * 4 // 2,
        "reduce-scatter": 4 * 4096 * 4 * 3 // 4,  # the operand is 4 x the 16 KiB result
        "all-to-all": 2 * 8 * 64 * 32 * 4 // 2,
        "collective-permute": 256 * 4,
    }


@pytest.mark.slow
@pytest.mark.alone  # a measured ratio against a bound: the machine to itself (.ci/run)
def test_plan_quick(tmp_path, capsys):
    """The planner's prediction and the measured step of the plan it made, one run: the
    ratio within the bench's bounds."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--quick", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["tiny"]
    _check_plan_row(row, 1)
    assert "predicted s" in capsys.readouterr().out


def _check_plan_row(row: dict, devices: int) -> None:
    from hetjax.bench.plan import RATIO_BOUNDS

    assert row["devices"] == devices and row["plan"].startswith("stream"), row
    assert row["predicted_s"] > 0 and row["measured_s"] > 0, row
    lo, hi = RATIO_BOUNDS
    assert lo <= row["measured_s"] / row["predicted_s"] <= hi, row


@pytest.mark.slow
@pytest.mark.alone  # a measured ratio against a bound: the machine to itself (.ci/run)
def test_plan_data_parallel_row():
    """bench plan's ``tiny dp2`` row: ZeRO-3 on 2 virtual CPU devices, a child process;
    the ratio within the bench's bounds."""
    from hetjax.bench.plan import _plan_row_on_cpu_devices

    overrides = {"memory.device_budget": "72MiB"}  # as the bench: gpt_tiny's host budget
    row = _plan_row_on_cpu_devices(2, "gpt_tiny", overrides, 8)
    _check_plan_row(row, 2)


@pytest.mark.slow  # a benchmark smoke test
def test_keep_quick(tmp_path, capsys):
    out = tmp_path / "keep.json"
    assert main(["keep", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    held = result["held_bytes"]
    assert list(held) == ["matmuls", "all", "recompute"]  # no probs: blockwise attention
    assert 0 < held["matmuls"] < held["all"]
    assert all(t > 0 for t in result["backward_s"].values())
    assert "saved / all" in capsys.readouterr().out


@pytest.mark.slow  # a benchmark smoke test
def test_attention_quick(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert main(["attention", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [128, 256]
    for r in rows:  # tiles of 32: the blockwise backward holds no T x T scores
        assert 0 < r["blockwise_temp_bytes"] < r["reference_temp_bytes"]
        assert r["blockwise_backward_s"] > 0 and r["reference_backward_s"] > 0
    assert "blockwise / reference" in capsys.readouterr().out


def test_io_over_drives_probes_each_device_once_and_prints_the_planners_sum(
    tmp_path, capsys, monkeypatch
):
    """bench io --nvme-path a,b,c with a and b on one device (stat faked) and c on
    another: two probes (a's and c's, the planner's measure_nvme faked at 1.0/0.5 and
    2.0/1.0 GB/s read/write), the sum printed and saved is 3.0/1.5 GB/s; the pages
    striped over the three directories are measured for real."""
    import os

    from hetjax.bench import io
    from hetjax.planning import hardware

    dirs = [tmp_path / name for name in "abc"]
    for d in dirs:
        d.mkdir()
    device = {"a": 1, "b": 1, "c": 2}
    real_stat = os.stat

    class Stat:  # the real stat, on the faked device
        def __init__(self, real, st_dev):
            self._real, self.st_dev = real, st_dev

        def __getattr__(self, name):
            return getattr(self._real, name)

    def stat(p, *a, **k):
        real = real_stat(p, *a, **k)
        return Stat(real, device[Path(p).name]) if Path(p) in dirs else real

    monkeypatch.setattr(os, "stat", stat)
    probed = []

    def measure_nvme(d):
        probed.append(d.name)
        return (1.0e9, 0.5e9) if d.name == "a" else (2.0e9, 1.0e9)

    monkeypatch.setattr(hardware, "measure_nvme", measure_nvme)
    monkeypatch.setattr(io, "_raw_disk_bandwidth", lambda d, n: (0.75, 1.25))
    out = tmp_path / "io.json"
    assert main(["io", "--quick", "--nvme-path", ",".join(map(str, dirs)), "--out", str(out)]) == 0
    assert probed == ["a", "c"]
    result = json.loads(out.read_text())
    assert (result["drives_read"], result["drives_write"]) == (3.0e9, 1.5e9)
    assert [d["dir"] for d in result["drives"]] == [str(dirs[0]), str(dirs[2])]
    assert result["striped_write"] > 0 and result["striped_read"] > 0
    text = capsys.readouterr().out
    assert "sum (the planner's NVMe lane)" + " " * 15 + "1.50       3.00" in text, text
    assert f"({dirs[1]}: on a device already measured, counted once)" in text
    left = [p for d in dirs for p in d.rglob("*")]
    assert not left, left  # the probes' files removed


def test_scale_from_names_the_sizes_when_unknown(tmp_path):
    with pytest.raises(SystemExit, match="not one of the sizes: 2x32, 4x128"):
        main(["scale", "--quick", "--from", "3x99", "--out", str(tmp_path / "s.json")])
    with pytest.raises(SystemExit):  # argparse: --from is for scale only
        main(["io", "--quick", "--from", "4x128"])


@pytest.mark.slow  # four training runs in child processes, ~25 s each
def test_peer_quick(tmp_path, capsys):
    """bench peer's rows on the small peer shape: each its own child run with its peak
    RSS; offloaded rows move bytes to and from the disk, the in-memory row none; the
    limit is max(compute, disk time). One copy of the NVMe state is the quick
    shape's, counted by hand: each step of the optimizer-only row reads and writes it
    exactly once."""
    out = tmp_path / "peer.json"
    assert main(["peer", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == [
        "in memory",
        "optimizer on NVMe",
        "params + optimizer on NVMe",
        "the same, host budget",
    ]
    assert rows["in memory"]["read_bytes"] == rows["in memory"]["write_bytes"] == 0
    for name, row in rows.items():
        assert row["peak_rss"] > 0 and row["step_s"] > 0, name
        assert row["limit_s"] >= result["compute_s"], name
    # The quick shape (hetjax/bench/common.py's PEER_SHAPE: GPT, d 256, vocab 8192, T
    # 128, 4 layers) by hand: embed 8192 x 256 + 128 x 256 = 2,129,920 params, a block
    # 12 d^2 + 13 d = 789,760, the head's norm 2 d = 512. Pages are fitted to the block
    # (4 MiB pages hold it whole: one page of 789,760 rounded up to 1024, 790,528): 3
    # pages the embed, 1 each block and the head, 8 pages. fp32 master, mu and nu: 12
    # bytes an element.
    copy = 8 * 790_528 * 12
    for name in list(rows)[1:]:
        row = rows[name]
        assert row["nvme_copy_bytes"] == copy, name
        assert row["read_bytes"] > 0 and row["write_bytes"] > 0, name
        # every byte on NVMe written once a step (a cached stage's only when evicted)
        assert row["write_bytes"] <= copy, name
    # no host budget (no state cache) and no clipping (no redo): every stage's state
    # read and written once
    assert rows["optimizer on NVMe"]["read_bytes"] == copy
    assert rows["optimizer on NVMe"]["write_bytes"] == copy
    # params on NVMe add their reads (forward and backward) to the optimizer's
    assert (
        rows["params + optimizer on NVMe"]["read_bytes"] > rows["optimizer on NVMe"]["read_bytes"]
    )
    assert "host budget 256MiB: peak RSS" in capsys.readouterr().out


@pytest.mark.slow  # three training runs in child processes
def test_checkpoint_quick(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    assert main(["checkpoint", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert not rows["no checkpoints"]["saves"]
    linked, copied = rows["hard-linked"]["saves"], rows["copied"]["saves"]
    assert [s["step"] for s in linked] == [s["step"] for s in copied] == [2, 4]
    assert all(s["linked"] > 0 and s["written"] == 0 for s in linked)
    assert all(s["linked"] == 0 and s["written"] == linked[0]["linked"] for s in copied)
    assert "vs disk" in capsys.readouterr().out


@pytest.mark.slow  # a benchmark smoke test: two child processes (~20 s)
def test_generate_quick(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert main(["generate", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["none", "stream"]
    assert all(r["decode_tokens_per_s"] > 0 and r["peak_rss_gib"] > 0 for r in rows)
    assert "streamed decode at" in capsys.readouterr().out
