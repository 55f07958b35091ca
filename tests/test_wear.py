"""SSD wear (``hetjax/planning/wear.py``): the arithmetic, the planner's wear budget, and
the plan's projection of the bytes a step writes against the bytes a run wrote."""

import json
import statistics

import pytest
from conftest import tiny_config

from hetjax.config import ConfigError, load_config
from hetjax.planning.auto import plan_auto
from hetjax.planning.hardware import PROFILES
from hetjax.planning.search import WEAR_TIE, PlanError, _choose, make_plan
from hetjax.planning.wear import Wear
from hetjax.train import train


def test_wear_arithmetic_by_hand():
    # 1 TB a step every 86.4 s: 1000 steps a day, 1000 TB a day; 1000 steps on two
    # drives rated 7000 TBW each: 1000 / 14000 of their life, 14 days of it
    wear = Wear(written_per_step=1e12, step_s=86.4, steps=1000, drives=2, tbw=7000)
    assert wear.bytes_per_day == pytest.approx(1e15)
    assert wear.run_bytes == pytest.approx(1e15)
    assert wear.life_fraction == pytest.approx(1 / 14)
    assert wear.life_days == pytest.approx(14)
    assert "0.0714 of the drives' rated 7000 TBW" in wear.describe()
    assert wear.over_budget(0.1) == ""
    # at most 0.05 * 14000 TB / 1 TB = 700 steps
    assert "at most 700 steps" in wear.over_budget(0.05)
    assert Wear(1e12, 86.4, 1000).life_fraction is None  # no rating: no fraction


def test_wear_is_a_warning_only_past_a_fraction_of_the_drives_life():
    """The run's output warns about wear only when a run of train.steps uses more than
    WARN_FRACTION of the drives' life (rated, else ASSUMED_TBW): never for the default
    run's 60 steps of 54 MiB (7 TB a day at its speed, but 3.4 GB in all)."""
    from hetjax.planning.wear import ASSUMED_TBW, TB, WARN_FRACTION

    assert Wear(54.28 * 2**20, 0.8, 60).warning() == ""  # the demo
    over = WARN_FRACTION * ASSUMED_TBW * TB * 1.01  # bytes just past the threshold
    warning = Wear(over / 1000, 1.0, 1000).warning()
    assert warning.startswith("warning: SSD wear: a run of 1000 steps writes 6.06 TB"), warning
    assert "1.01% of the life of 1 drive(s) at 600 TBW assumed (memory.nvme_tbw)" in warning
    assert Wear(over / 1000, 1.0, 1000, drives=2).warning() == ""  # the writes shared
    rated = Wear(over / 1000, 1.0, 1000, tbw=300).warning()  # a drive rated lower
    assert "2.02% of the life of 1 drive(s) at rated 300 TBW each" in rated, rated
    assert Wear(over / 1000 / 1.02, 1.0, 1000).warning() == ""


def test_a_wear_budget_prefers_writing_less_when_it_costs_little_time():
    # (step s, rank, name, ..., NVMe bytes written a step), as the planner evaluates them
    plans = [
        (100.0, 12, "fastest", 2e12),
        (101.0, 11, "less offloaded, as fast", 2e12),
        (105.0, 13, "writes half, 5% slower", 1e12),
        (108.0, 12, "writes half too, 8% slower", 1e12),
        (150.0, 10, "writes nothing, 50% slower", 0.0),
    ]
    plans = [(s, r, name, *[None] * 6, w) for s, r, name, w in plans]
    assert _choose(plans)[2] == "less offloaded, as fast"  # within 2%: less offloaded
    assert WEAR_TIE == 1.10
    assert _choose(plans, write_less=True)[2] == "writes half, 5% slower"


def test_wear_budget_needs_a_rating():
    with pytest.raises(ConfigError, match="memory.nvme_tbw"):
        tiny_config(memory=dict(nvme_wear_budget=0.1))


def _gpt175b(**memory):
    config = load_config(
        "gpt175b",
        {"train.seq_len": "1024", "train.batch_size": "8", "model.compute_dtype": "bfloat16"},
    )
    return config.replace(memory=memory, train=dict(steps=1000))


@pytest.mark.slow  # ~25 s: three plans of GPT-3 175B; the arithmetic above in the default run
def test_planner_refuses_a_run_over_the_wear_budget_and_prefers_writing_less():
    hw = PROFILES["a100-80g"]  # Fuyou's server: GPT-3 175B's state on its SSDs
    free = make_plan(_gpt175b(nvme_tbw=7000), hw)
    assert free.placement.optimizer == "nvme"
    wear = free.wear
    # by definition: the run's bytes over the drives' rated bytes (one drive named)
    assert wear.life_fraction == pytest.approx(wear.written_per_step * 1000 / 7000e12)
    with pytest.raises(PlanError, match=r"wear budget.*over memory.nvme_wear_budget=0.001"):
        make_plan(_gpt175b(nvme_tbw=7000, nvme_wear_budget=0.001), hw)
    within = make_plan(_gpt175b(nvme_tbw=7000, nvme_wear_budget=0.5), hw)
    assert within.wear.life_fraction <= 0.5
    # writing less is worth up to WEAR_TIE of the time
    assert within.wear.written_per_step <= wear.written_per_step
    assert within.step_s <= WEAR_TIE * free.step_s


@pytest.mark.slow  # ~25 s: the local machine measured, then 5 steps
def test_plan_wear_projection_equals_the_bytes_written(tmp_path):
    """A plan with the state on NVMe (budgets too small for the device and RAM), one
    copy written in place: the bytes a step writes that the plan projects are
    those the run's steps measured, within 10%, and so is the run summary's wear."""
    config = tiny_config(
        model=dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32),
        memory=dict(device_budget="540KiB", host_budget="1300KiB", page_size="4KiB", nvme_tbw=1),
        optimizer=dict(warmup_steps=2, lr=3e-3, speculation="never"),
        train=dict(steps=5, eval_batches=0),
    )
    planned, plan = plan_auto(config, tmp_path, log=lambda s: None)
    assert planned.offload.optimizer == "nvme"
    run = train(planned, tmp_path)  # (verbose: the run summary is written)
    written = [r["nvme_write_bytes"] for r in run.records]
    assert sum(written) == pytest.approx(plan.wear.run_bytes, rel=0.10)
    summary = json.loads((tmp_path / "summary.json").read_text())["run"]["wear"]
    assert summary["written_per_step"] == statistics.median(written[1:])
    assert summary["life_fraction"] == pytest.approx(sum(written) / 1e12, rel=0.10)
