"""Routed experts and deferred expert updates under tensor parallelism
(hetjax/runtime/experts/routed_zero.py's grouped fetcher, the experts one expert group cut
in slices): each device copies in and gathers, over the data axis, only its slice of the
pages of the experts some device routed to; training equals one
device's routed run and copying every expert (tests/test_expert_fetch_zero.py has data
and expert parallelism's)."""

import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_training_equal, check_tokens
from test_expert_fetch import SHORT, _config
from test_expert_fetch_zero import (
    SGD_CLIP,
    deferred_equal_to_every_expert,
    skewed_router_saves,
    two_processes_route_as_one_device,
)

from hetjax.train import train
from models import build_model

SPLITS = [(1, 2), (2, 2)]  # data x tensor, on 2 and 4 of the 8 virtual devices
IDS = ["tensor2", "data2xtensor2"]


def _sgd(fetch: str, data: int, tensor: int, **offload_and_train):
    """16 experts top-1, SGD with clipping, 4 KiB pages, on ``data`` x ``tensor``
    devices: 2 rows a micro-batch per data device (a model group's devices share them)."""
    train_section = {k: v for k, v in offload_and_train.items() if k in SHORT or k == "steps"}
    offload = {k: v for k, v in offload_and_train.items() if k not in train_section}
    return _config(tiny_config, fetch, **offload).replace(
        optimizer=SGD_CLIP,
        train={**SHORT, "batch_size": 4 * data, **train_section},
        distributed=dict(data_parallel=data, tensor_parallel=tensor),
    )


@pytest.mark.slow  # 6-26 s each on 2 cores (the first compiles most)
@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize("data, tensor", SPLITS, ids=IDS)
def test_routed_under_tensor_parallelism_trains_as_one_device(
    tmp_path, data, tensor, params, reference_run
):
    """The experts' MLPs split by their hidden units over 2 model devices (beside 1 or 2
    data devices), both blocks routed, params on the host or on NVMe, SHORT's 3 steps:
    each device copies in its slice of the routed experts' pages; losses, validation
    loss, every param and the logits equal one device's routed run at 1e-5, and the same
    experts were fetched (the union over the devices of the micro-batch's), fewer than
    all. One device's run keeps its params on the host for both tiers (the stores hold
    the same values; one device's routed NVMe params are tests/test_moe.py's
    test_stream_nvme_equals_none and tests/test_expert_fetch.py's
    test_routed_streaming_equals_fetching_every_expert): trained once per process
    (``reference_run``), and at 8 rows it is the one the two-process test compares."""
    config = _sgd("routed", data, tensor, params=params)
    many = train(config, tmp_path / "many", verbose=False)
    rows = config.train.batch_size
    one = _sgd("routed", 1, 1, batch_size=rows)
    single = reference_run(one)
    assert_training_equal(many, single, build_model(one.model), check_tokens())
    for record in many.records:
        # 2 micro-batches x 3 block copies (block0 forward and backward, block1 once)
        assert 0 < record["experts_fetched"] < 16 * 2 * 3
        assert 0 < record["experts_fetched_fraction"] < 1
    assert [r["experts_fetched"] for r in many.records] == [
        r["experts_fetched"] for r in single.records
    ]


# A block's slabs in 1024-element pages, hand-counted (parallel/layouts.py's layout: the
# 3-D mesh's with one expert group). Its experts' part, a group per model index m: slice
# m of every expert weight, in slab order down_proj 16 experts x 24 x 32 (12,288, 768 an
# expert), gate_proj 16 x 32 x 24, up_proj 16 x 32 x 24: 36 pages, all expert rows.
# Its attention's part, a group per m: k_proj 32 x 8 (256), o_proj 16 x 32 (512), q_proj
# 32 x 16 (512), v_proj 32 x 8 (256): 1,536 elements, 2 pages. The dense slab (router
# 32 x 16, two norms of 32: 576) is one page, padded to one a device. Device n = s M + m
# holds share s of both of group m's parts and share n of the dense slab. Experts 0-1's
# rows (1,536 elements of each expert leaf): down_proj [0, 1536) pages 0-1, gate_proj
# [12288, 13824) pages 12-13, up_proj [24576, 26112) pages 24-25: 0, 1, 12, 13, 24, 25
# (the same pages in both groups).
#
# tensor2 (S = 1 data device; a device's 39 pages: its group's 36 expert pages, 2
#   attention pages, 1 dense): copying every expert copies 2 x 39: 78. Routed: each
#   device's 2 attention and 1 dense pages (2 x 3), and experts 0-1's 6 pages a device
#   padded to a multiple of 36 // 8 = 4, 8: 2 x 8. 22 a copy.
# data2xtensor2 (S = 2; a device's 20 pages: 18 of its group's experts, 1 attention, 1
#   dense): every expert: 4 x 20: 80. Routed: the 2 pages but the experts' of each of the
#   4 devices (4 x 2); experts 0-1's, 0, 1, 12, 13 on data device 0 and 24, 25 on 1, the
#   busier's 4, a multiple of 18 // 8 = 2: 4 x 4. 24 a copy.
SAVED = {(1, 2): 78 - 6 - 16, (2, 2): 80 - 8 - 16}


@pytest.mark.slow  # ~10 s each
@pytest.mark.parametrize("data, tensor", SPLITS, ids=IDS)
def test_a_skewed_router_under_tensor_parallelism_copies_fewer_bytes(data, tensor):
    """A router sending every token to experts 0-1 of 16: a routed step copies host ->
    device (each device its own pages of its slice, padded to the busiest device's
    count) the block's pages but those wholly in experts 2-15 and the padding (SAVED's
    hand count), for the same loss."""
    config_of = lambda fetch: _sgd(fetch, data, tensor, grad_accum=1, batch_size=2 * data)
    skewed_router_saves(config_of, 2 * data, SAVED[data, tensor])


@pytest.mark.slow  # 20-50 s each: three runs of 4 steps
@pytest.mark.parametrize("data, tensor", SPLITS, ids=IDS)
def test_deferred_updates_under_tensor_parallelism_equal_one_device(data, tensor):
    """AdamW with weight decay and clipping, state and params on NVMe, tokens routed to
    8 of 16 experts, data x tensor devices: deferring the updates of the experts no
    device routed to (every slice of them, caught up before their next use) trains bit
    for bit as updating every expert under the same split, for losses within 1e-5 of one
    device deferring (tests/test_expert_fetch_zero.py's bound: the devices sum
    gradients in another order); some pages are deferred and some caught up."""
    deferred_equal_to_every_expert(dict(data_parallel=data, tensor_parallel=tensor))


@pytest.mark.slow  # 20 s (170 s on 2 cores busy with other sessions): two runs
def test_t5_switch_blocks_under_tensor_parallelism_train_as_one_device(tmp_path):
    """T5-MoE at data x tensor 1 x 2: the Switch blocks of both stacks routed (a decoder
    block's context, the encoder's output, whole on each model device), SGD with
    clipping: losses, validation loss, every param and the logits equal one device's
    routed run at 1e-5, with the same experts fetched, fewer than all."""
    from test_expert_fetch import T5_MOE
    from test_t5 import t5_config, t5_tokens

    runs = {}
    for tensor in (1, 2):
        config = t5_config(tiny_config, **T5_MOE).replace(
            train=dict(SHORT, seq_len=8),
            optimizer=SGD_CLIP,
            offload=dict(mode="stream", expert_fetch="routed"),
            memory=dict(page_size="4KiB"),
            distributed=dict(data_parallel=1, tensor_parallel=tensor),
        )
        runs[tensor] = train(config, tmp_path / str(tensor), verbose=False)
    assert_training_equal(runs[2], runs[1], build_model(config.model), t5_tokens())
    fetched = [[r["experts_fetched_fraction"] for r in runs[t].records] for t in (1, 2)]
    assert fetched[0] == fetched[1] and all(0 < f < 1 for f in fetched[1])


def test_the_pages_left_behind_are_every_slices_by_hand():
    """At data x tensor 2 x 2 (SAVED's layout: 20 pages a device, its group's 18 expert
    pages, then an attention and a dense one; device n = 2 s + m holds share s of group
    m), tokens routed to experts 0-1: a group's pages wholly in experts 2-15 are 2-11,
    14-23 and 26-35 (0, 1, 12, 13, 24 and 25 hold a row of expert 0 or 1). The pages the
    process's optimizer may leave alone are those, at each device's share of each
    group."""
    from types import SimpleNamespace

    from hetjax.parallel.zero import Zero3
    from hetjax.runtime.experts.routed_zero import GroupedExpertFetcher

    config = _sgd("routed", 2, 2)
    zero = Zero3(config)
    model = build_model(config.model)
    layout = zero.stage_layouts(model, config.memory.page_size)["block"]
    block = SimpleNamespace(layout=layout, is_expert=model.is_expert)
    fetcher = GroupedExpertFetcher(block, zero, np.float32, 16)
    assert fetcher.pages.routed(np.array([0, 1])).tolist() == [0, 1, 12, 13, 24, 25]
    by_hand = {
        0: [*range(2, 12), *range(14, 18)],  # (s 0, m 0): group pages 2-17 at 0-17
        1: [*range(22, 32), *range(34, 38)],  # (0, 1): at 20-37
        2: [*range(40, 46), *range(48, 58)],  # (1, 0): group pages 18-35 at 40-57
        3: [*range(60, 66), *range(68, 78)],  # (1, 1): at 60-77
    }
    expected = {p for pages in by_hand.values() for p in pages}
    assert fetcher.zero_pages(np.array([0, 1], np.int32)) == expected


@pytest.mark.slow  # two child processes compile everything anew: ~50 s on 2 cores
def test_routed_across_two_processes_at_2x2_trains_as_one_device(tmp_path, reference_run):
    """2 processes x 2 CPU devices over gloo at data x tensor 2 x 2 (each process one
    data index: both slices of its share), both blocks routed: every process copies in
    its own devices' pages of the routed experts and reads the same averaged counts, so
    every device dispatches the same gathers; losses, validation loss and final params
    equal one device's routed run, which fetched the same experts."""
    config = _sgd("routed", 1, 1, batch_size=8)  # 2 micro-batches of 4 rows: 2 a data index
    two_processes_route_as_one_device(
        tmp_path, reference_run, config, "distributed.tensor_parallel=2"
    )
