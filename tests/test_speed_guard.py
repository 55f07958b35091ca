"""The speed lead's guard (issue #58): offloaded (params and optimizer state on NVMe) over
in-memory s/step at a mid shape, measured in one run, against ``bench guard``'s bound."""

import json

import pytest

from hetjax.bench import main
from hetjax.bench.guard import GUARD_BOUND
from hetjax.bench.peer import against_previous


@pytest.mark.slow
@pytest.mark.alone  # a measured ratio against a bound: the machine to itself (.ci/run)
def test_offloaded_step_within_the_guard_bound(tmp_path, capsys):
    out = tmp_path / "guard.json"
    assert main(["guard", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    memory, offloaded = (
        result["rows"][n]["step_s"] for n in ("in memory", "params + optimizer on NVMe")
    )
    assert result["ratio"] == pytest.approx(offloaded / memory)
    assert f"offloaded / in memory: {result['ratio']:.3f}" in capsys.readouterr().out
    # the offloaded row moved its state through the disk (else the guard guards nothing)
    assert result["rows"]["params + optimizer on NVMe"]["read_bytes"] > 0
    assert result["ratio"] <= GUARD_BOUND, result


def test_rows_print_against_the_previous_results(capsys):
    rows = {"a": {"vs_limit": 1.5}, "b": {"vs_limit": 1.1}}
    against_previous(rows, {"date": "2026-11-28", "rows": {"a": {"vs_limit": 1.2}}})
    text = capsys.readouterr().out
    assert "against the previous results (2026-11-28)" in text
    assert "1.50 / 1.20 = 1.25" in text  # 1.5 / 1.2, a 25% regression of row a
    assert " b " not in text  # no previous figure: nothing printed for it
    against_previous(rows, None)
    assert "no previous results file" in capsys.readouterr().out
