"""Routed experts and deferred expert updates under ZeRO-3 data parallelism
(hetjax/runtime/experts/routed_zero.py): each device copies in and gathers only the pages of the
experts some device routed to; training equals one device's routed run and copying every
expert (tests/test_expert_fetch.py and tests/test_deferred_updates.py have the one-device
versions)."""

import functools

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_training_equal, check_tokens
from test_deferred_updates import _adamw, _run
from test_expert_fetch import SHORT, SPARSE, _config, _moved, _skewed

from hetjax.parallel.zero import Zero3
from hetjax.runtime.streaming import StreamingRuntime
from models import build_model

SGD_CLIP = dict(name="sgd", lr=0.1, grad_clip=2.0)  # clipping binds in some steps
P = 4096 // 4  # elements of a 4 KiB page (the configs' memory.page_size)


def _sgd(fetch: str, data: int, experts: int = 1, **train_section):
    """16 experts top-1, SGD with clipping, 4 KiB pages, on ``data`` x ``experts``
    devices: 2 rows a micro-batch (4 with 4 devices), one a device."""
    rows = 2 * max(1, data * experts // 2)
    config = _config(tiny_config, fetch).replace(
        optimizer=SGD_CLIP,
        train={**SHORT, "batch_size": 2 * rows, **train_section},
        distributed=dict(data_parallel=data, expert_parallel=experts),
    )
    return config


def _trains_as_one_device(reference_run, data: int, experts: int, steps: int):
    """Trains the routed model ``steps`` steps on ``data`` x ``experts`` devices and on
    one: losses, validation loss, every param and the logits equal at 1e-5, and the same
    experts fetched (the union over the devices of the micro-batch's), fewer than all.
    Both runs once per process (``reference_run``): at SHORT's 3 steps the routed run
    on the devices is the one ``test_routed_under_zero3_equals_fetching_every_expert``
    compares, one device's at 8 rows the one the two-process test compares."""
    config = _sgd("routed", data, experts, steps=steps)
    many = reference_run(config)
    rows = config.train.batch_size
    one = reference_run(_sgd("routed", 1, steps=steps, batch_size=rows))
    assert_training_equal(many, one, build_model(tiny_config(model=SPARSE).model), check_tokens())
    for record in many.records:
        # 2 micro-batches x 3 block copies (block0 forward and backward, block1 once)
        assert 0 < record["experts_fetched"] < 16 * 2 * 3
        assert 0 < record["experts_fetched_fraction"] < 1
    assert [r["experts_fetched"] for r in many.records] == [
        r["experts_fetched"] for r in one.records
    ]


def test_routed_under_data_parallelism_trains_as_one_device(reference_run):
    """Data parallelism over 2 devices, both blocks routed (each device copying in and
    gathering the pages of the experts either device routed to; 16 experts, top-1,
    2 x 8 tokens a micro-batch): trains as one device's routed run (2 steps)."""
    _trains_as_one_device(reference_run, 2, 1, steps=2)


@pytest.mark.slow  # 60 s (data2xexpert2: 150 s on 2 busy cores)
@pytest.mark.parametrize("data, experts", [(1, 2), (2, 2)], ids=["expert2", "data2xexpert2"])
def test_routed_under_expert_parallelism_trains_as_one_device(reference_run, data, experts):
    """Experts split over 2 devices (beside 2 data-parallel ones): each device copies in
    and gathers, over the data axis only, the pages of its group's experts some device
    routed to; trains as one device's routed run (SHORT's 3 steps)."""
    _trains_as_one_device(reference_run, data, experts, steps=SHORT["steps"])


@pytest.mark.slow  # 40 s: two runs of 4 steps
@pytest.mark.parametrize("data, experts", [(2, 1), (1, 2)], ids=["data2", "expert2"])
def test_routed_under_zero3_equals_fetching_every_expert(reference_run, data, experts):
    """SGD with clipping, 3 steps: routed equals expert_fetch=all under the same
    parallelism at 1e-5 (the routed run at expert2 is the one
    ``test_routed_under_expert_parallelism_trains_as_one_device`` trains)."""
    routed = reference_run(_sgd("routed", data, experts))
    every = reference_run(_sgd("all", data, experts))
    model = build_model(tiny_config(model=SPARSE).model)
    assert_training_equal(routed, every, model, check_tokens())
    assert not any("experts_fetched" in r for r in every.records)


def _zero3(config) -> StreamingRuntime:
    """``config``'s runtime under ZeRO-3 (``hetjax.train``'s for data_parallel != 1)."""
    return StreamingRuntime(config, parallel=Zero3(config))


# The block's slabs in 1024-element pages, hand-counted from its leaves in slab order
# (k_proj 512, down_proj 16 x 32 x 48 = 24,576, gate_proj 24,576, router 32 x 16 = 512,
# up_proj 24,576, o_proj 1,024, q_proj 1,024, v_proj 512, two norms of 32), with tokens
# routed to experts 0-1 (3,072 elements of each expert leaf, 3 pages' worth):
#
# data2: 77,376 elements, 76 pages, device 0 owning pages 0-37, device 1 38-75. Pages
#   holding something but expert rows: 0 (k_proj), 48 (router), 73-75 (o, q, v, norms):
#   device 0 has 1, device 1 4, so the window's gather copies 2 x 4. Experts 0-1's pages:
#   1-3 of down_proj (page 0 is dense), 24-27 of gate_proj, 49-51 of up_proj: device 0
#   7, device 1 3, padded to a multiple of 38 // 8 = 4: 2 x 8. Copying every expert
#   copies all 76; routed 8 + 16.
# expert2: a group's slab holds experts 0-7 of the 3 expert leaves (12 pages each), a
#   dense slab the rest (both copied whole either way). Group 0's device holds experts
#   0-1's pages 0-2, 12-14 and 24-26 of its slab (9 pages), group 1's none: each copies
#   9 padded to a multiple of 36 // 8 = 4, 12. Copying every expert copies 2 x 36.
SAVED = {(2, 1): 76 - 8 - 16, (1, 2): 2 * 36 - 2 * 12}


@pytest.mark.slow  # 15 s each
@pytest.mark.parametrize("data, experts", [(2, 1), (1, 2)], ids=["data2", "expert2"])
def test_a_skewed_router_under_zero3_copies_fewer_bytes(data, experts):
    """A router sending every token to experts 0-1 of 16, 2 devices: a routed step copies
    host -> device (each device its own pages, padded to the busier device's count) the
    block's pages but those wholly in experts 2-15 and the padding (SAVED's count), for
    the same loss."""
    config_of = lambda fetch: _sgd(fetch, data, experts, grad_accum=1, batch_size=2)
    skewed_router_saves(config_of, 2, SAVED[data, experts])


@pytest.mark.slow  # 60 s each: three runs of 4 steps
@pytest.mark.parametrize("data, experts", [(2, 1), (1, 2)], ids=["data2", "expert2"])
@pytest.mark.guards(tier="nvme", parallel="data", ids="data2")
@pytest.mark.guards(tier="nvme", parallel="expert", ids="expert2")
def test_deferred_updates_under_zero3_equal_one_device(data, experts):
    """AdamW with weight decay and clipping, state and params on NVMe, tokens routed to
    8 of 16 experts, 2 devices (data- or expert-parallel): deferring the updates of the
    experts no device routed to (and catching them up before their next use) trains
    bit for bit as updating every expert under the same parallelism, for losses within
    1e-5 of one device deferring (its params differ by more: the devices sum gradients
    in another order, which AdamW's first steps amplify, as tests/test_zero.py says);
    some pages are deferred and some caught up, under data parallelism as many as one
    device's (the same pages: expert parallelism lays the experts out by group)."""
    deferred, one = deferred_equal_to_every_expert(
        dict(data_parallel=data, expert_parallel=experts)
    )
    metrics = deferred[1]
    if experts == 1:  # the same pages as one device's (expert parallelism has others)
        for kind in ("expert_pages_deferred", "expert_pages_caught_up"):
            assert [m[kind] for m in metrics] == [m[kind] for m in one[1]], kind


@pytest.mark.slow  # two child processes compile everything anew: ~70 s on 2 cores
def test_routed_across_two_processes_trains_as_one_device(tmp_path, reference_run):
    """2 processes x 2 CPU devices over gloo, data-parallel, both blocks routed: every
    process reads the same averaged counts, so every device dispatches the same gathers;
    losses, validation loss and final params equal one device's routed run, which
    fetched the same experts."""
    config = _sgd("routed", 1, batch_size=8)  # 2 micro-batches of 4 rows: 1 a device
    two_processes_route_as_one_device(tmp_path, reference_run, config)


def deferred_equal_to_every_expert(distributed: dict):
    """Routes 8 tokens a micro-batch of the tiny MoE to 8 of 16 experts for 4 steps of
    AdamW (state and params on NVMe) on ``distributed``'s devices, deferring updates and
    updating every expert: checks the two equal bit for bit, the deferred run's losses
    within 1e-5 of one device deferring, and some pages deferred and some caught up.
    -> (the deferred run's, one device's) ``_run`` results."""
    batches = _deferred_batches()
    runs = {
        u: _run(_deferred_config(u, distributed), batches, used=8, runtime_of=_zero3)
        for u in ("deferred", "all")
    }
    one = _one_device_deferring()
    deferred, every = runs["deferred"], runs["all"]
    assert deferred[0] == every[0] and deferred[2] == every[2]  # losses, evaluation loss
    for a, b in zip(jax.tree.leaves(deferred[4]), jax.tree.leaves(every[4]), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(deferred[0], one[0], rtol=1e-5)
    np.testing.assert_allclose(deferred[2], one[2], rtol=1e-5)
    metrics = deferred[1]
    assert all(m["expert_pages_deferred"] > 0 for m in metrics)
    assert sum(m["expert_pages_caught_up"] for m in metrics) > 0
    return deferred, one


def _deferred_batches() -> list:
    """4 steps' batches: 2 micro-batches of 2 rows x 4 tokens, 8 tokens a micro-batch, so
    that experts routed in one step go unrouted in the next."""
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, (2, 2, 5), dtype=np.int32) for _ in range(4)]


def _deferred_config(updates: str, distributed: dict):
    return _adamw(tiny_config, updates).replace(
        train=dict(batch_size=4, seq_len=4), distributed=distributed
    )


@functools.cache
def _one_device_deferring():
    """One device deferring on ``_deferred_batches``, the run every
    ``deferred_equal_to_every_expert`` compares against: once per process (the tests
    read it, never change it)."""
    config = _deferred_config("deferred", dict(data_parallel=1))
    return _run(config, _deferred_batches(), used=8)


def two_processes_route_as_one_device(tmp_path, reference_run, config, *distributed: str):
    """Trains ``config`` (routed, one device; once per process: ``reference_run``) and
    the same in 2 processes x 2 CPU devices with the ``distributed.*`` overrides
    ``distributed`` (default: data-parallel): losses, validation loss and final params
    equal, and the same experts fetched, fewer than all."""
    import json

    from equivalence import assert_trees_close
    from test_zero import _params_like, _run_two_processes

    one = reference_run(config)
    t = config.train
    saved = _run_two_processes(
        tmp_path / "two",
        *[f"model.{k}={v}" for k, v in SPARSE.items()],
        *[f"optimizer.{k}={v}" for k, v in SGD_CLIP.items()],
        "memory.page_size=4KiB",
        *distributed,
        *[f"train.{k}={getattr(t, k)}" for k in ("steps", "eval_batches", "batch_size")],
        *[f"train.{k}={getattr(t, k)}" for k in ("grad_accum", "seq_len")],
    )
    np.testing.assert_allclose(saved["losses"], one.losses, rtol=1e-5)
    np.testing.assert_allclose(saved["val_loss"], one.val_loss, rtol=1e-5)
    assert_trees_close(_params_like(saved, one.params), one.params)
    metrics = tmp_path / "two" / "proc0" / "metrics.jsonl"
    fetched = [json.loads(line).get("experts_fetched") for line in metrics.open()]
    assert fetched == [r["experts_fetched"] for r in one.records]
    assert all(r["experts_fetched_fraction"] < 1 for r in one.records)


def skewed_router_saves(config_of, rows: int, saved_pages: int) -> None:
    """One step of ``config_of(fetch)`` (routed, and every expert fetched) on ``rows``
    rows, the router sending every token to experts 0-1 of 16: the same loss, experts
    0-1 fetched in each of the step's 3 block copies, and the routed step copying host
    -> device ``saved_pages`` pages fewer a copy (the tests' hand counts)."""
    batch = np.random.default_rng(1).integers(0, 256, (1, rows, 9), dtype=np.int32)
    moved, losses = {}, {}
    for fetch in ("routed", "all"):
        skew = lambda r: _skewed(r, 2)
        moved[fetch], losses[fetch], metrics = _moved(
            config_of(fetch), batch, skew, runtime_of=_zero3
        )
        if fetch == "routed":
            fetched = metrics["experts_fetched"]
    np.testing.assert_allclose(losses["routed"], losses["all"], rtol=1e-6)
    copies = 3  # block0's forward and backward, block1's forward
    assert fetched == 2 * copies  # experts 0 and 1, in every copy
    h2d = {f: m["host_to_device"] for f, m in moved.items()}
    assert h2d["all"] - h2d["routed"] == copies * saved_pages * P * 4
