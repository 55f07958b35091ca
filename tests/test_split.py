"""The data x model split a plan takes (hetjax/planning/split.py): Megatron's
tensor-parallel all-reduce volume against bytes counted by hand, its price in the
collectives lane, the split the planner chooses where tensor parallelism wins and where
it loses, and ``offload.mode=auto`` training with the split it chose."""

import dataclasses
import json

import pytest
from conftest import tiny_config
from equivalence import assert_gpt_training_equal, assert_training_equal, check_tokens

from hetjax.placement import Placement
from hetjax.planning.cost import Candidate, lanes
from hetjax.planning.hardware import PROFILES
from hetjax.planning.search import make_plan
from hetjax.planning.split import tensor_allreduce_bytes, tensor_degrees
from hetjax.planning.workload import Workload
from models import build_model

# the tiny MoE (tests/test_moe.py's, 32 positions) and T5 (tests/test_t5.py's)
MOE = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
    num_experts=4, experts_per_token=2, router_aux_loss_coef=0.02, tie_embeddings=False,
    vocab_size=256, max_seq_len=32, rope_theta=5000.0,
)  # fmt: skip
T5 = dict(
    family="t5", num_layers=2, num_decoder_layers=3, d_model=32, num_heads=4, d_ff=64,
    layer_norm_eps=1e-6, tie_embeddings=False, relative_attention_num_buckets=8,
    relative_attention_max_distance=12,
)  # fmt: skip
PREFIX_LM = dict(objective="prefix_lm")  # T5's encoder reads a prefix


def test_megatron_all_reduce_bytes_by_hand():
    """The tiny GPT (2 blocks, d 32, fp32), a global batch of 16 x 16 on 8 devices: a
    device's rows are 2; at 2 devices a model group its data group's 4 rows make a (4,
    16, 32) activation of 8,192 B, and each recomputing block all-reduces it 6 times a
    micro-batch (2 forward, 2 recomputed, 2 backward), each sending 2(t-1)/t of it:
    2 x 6 x 8,192 = 98,304 B; at 4: 8 rows, 16,384 B, 2 x 6 x 1.5 x 16,384 = 294,912 B;
    a kept block all-reduces 4 times (no recomputed forward)."""
    config = tiny_config(train=dict(batch_size=16, seq_len=16))
    w = Workload.from_config(config, devices=8)
    streamed = Placement()
    assert tensor_allreduce_bytes(w, streamed, 1) == 0
    assert tensor_allreduce_bytes(w, streamed, 2) == pytest.approx(98_304)
    assert tensor_allreduce_bytes(w, streamed, 4) == pytest.approx(294_912)
    kept = Placement(keep_blocks=1)  # one block of the two: 6 + 4 all-reduces
    assert tensor_allreduce_bytes(w, kept, 2) == pytest.approx(10 * 8_192)
    # the same volume from the workload planned at 2 devices a model group
    at2 = Workload.from_config(config, devices=8, tensor=2)
    assert tensor_allreduce_bytes(at2, streamed, 2) == pytest.approx(98_304)


def test_collectives_lane_prices_the_all_reduces_and_the_grouped_gathers():
    """The tiny GPT (2 blocks; a 4 x 16 micro-batch; 16 KiB pages, 16,384 B of fp32) on
    2 GPUs of a profile: the collectives lane is the bytes counted by hand over its
    interconnect. At data x tensor 1 x 2 a block's slab is 2 dense pages (a multiple of
    the 2 devices) and 2 slices of 2 pages (tests/test_memory_model.py): a device
    gathers half the dense pages (1 page) and none of its slice (one data device), in
    forward and again in the recomputed forward (2 blocks: 4 pages); gradients are
    reduce-scattered over the data axis only (zero.Zero3.grad_slab), one device: none;
    Megatron's all-reduces: 6 a block of the (4, 16, 32) fp32 activation (8,192
    B), 2(t-1)/t of it sent each: 2 x 6 x 8,192 B = 6 pages. 10 pages in all. At 2 x 1
    a block's 4 whole pages: half gathered, 2 pages a block (8 pages), scattered (4),
    and half of the embed's 4 pages, sent twice (the head's gradient of it and its
    input's: runtime/streaming.py), and of the head's 2: 5. 17 pages, no all-reduce."""
    config = tiny_config(memory=dict(page_size="16KiB"))
    hw = dataclasses.replace(PROFILES["angel-a100-40g"], num_devices=2)
    page = 4096 * 4
    streamed = Candidate(placement=Placement())
    for tensor, allreduces, pages in ((2, 6 * page, 10), (1, 0, 17)):
        w = Workload.from_config(config, devices=2, backend="gpu", tensor=tensor)
        assert tensor_allreduce_bytes(w, streamed.placement, tensor) == allreduces
        _, by_lane = lanes(w, hw, streamed, 0.0)
        assert by_lane["collectives"] == pytest.approx(pages * page / hw.interconnect_bw)
    # at 2 x 2 a block's slab is 4 dense pages and 2 slices of 2 pages (parallel/groupings.py's
    # layout, tests/test_tensor.py): a device sends half its slice's 2 pages and half the
    # 4 dense ones over the 2 data devices, 3 pages, not the 4 of its gather
    w = Workload.from_config(config, devices=4, backend="gpu", tensor=2)
    assert w.scattered_block(4) == 3 * 4096 and w.gathered_block(4) == 4 * 4096
    # at 4 x 1 every stage is 4 pages: each device sends 3/4 of 2 blocks', the head's
    # and the embed's twice: the runtime's count (tests/test_zero.py), 5 x 3 pages
    w = Workload.from_config(config, devices=4, backend="gpu")
    grads = 4 * w.scattered_rest(4) + w.block_grad_bytes * w.num_layers * w.scattered_block(4)
    assert grads == 5 * 3 * page


def test_tensor_degrees_divide_the_model_and_the_rows():
    """t where t divides the devices, the heads (4), the MLP units (128) and the vocab
    (256), and the micro-batch's 4 rows divide over devices/t data groups, for GPT and
    (since the planner splits them) the MoE and T5 blocks; a config's own
    tensor_parallel is taken as given."""
    assert tensor_degrees(tiny_config(), 4) == [1, 2, 4]
    assert tensor_degrees(tiny_config(), 8) == [2, 4]  # not 1: 4 rows; not 8: 4 heads
    assert tensor_degrees(tiny_config(model=dict(num_heads=2, d_model=32)), 4) == [1, 2]
    assert tensor_degrees(tiny_config(train=dict(batch_size=2)), 4) == [2, 4]  # rows 2
    assert tensor_degrees(tiny_config(distributed=dict(tensor_parallel=2)), 8) == [2]
    # the tiny MoE (4 heads, 2 key/value heads, experts of 48 hidden units) and T5 (4
    # heads, 64 hidden units), vocab 256
    assert tensor_degrees(tiny_config(model=MOE), 4) == [1, 2]
    assert tensor_degrees(tiny_config(model=T5, data=PREFIX_LM), 4) == [1, 2, 4]


def test_the_planner_routes_experts_where_the_runtime_does():
    """The tiny MoE's routed experts (4 experts, each 3 matrices of 32 x 48: 18,432
    params a block) are priced as routed on one device, under data parallelism and at
    a tensor-parallel split, where the runtime routes them (each device its slice:
    runtime/experts/routed_zero.py's grouped fetcher), every slice of them counted."""
    moe = tiny_config(model=MOE)
    routed = lambda devices, tensor: (
        Workload.from_config(moe, devices=devices, tensor=tensor).routed_expert_params
    )
    assert routed(1, 1) == routed(2, 1) == routed(2, 2) == routed(4, 2) == 4 * 3 * 32 * 48


@pytest.mark.parametrize("devices, tensor", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_routed_experts_save_each_device_its_share_of_the_copies(devices, tensor):
    """With half the experts routed, the tiny MoE's 2 streamed blocks (each 18,432 expert
    params of fp32) copy in forward and again in backward half their experts less: a
    device, which copies its 1/n of every page (ZeRO-3; under tensor parallelism its
    share of its slice), saves 2 x 2 x 18,432 x 4 B x 1/2 / n a micro-batch."""
    moe = tiny_config(model=MOE)
    w = Workload.from_config(moe, devices=devices, backend="gpu", tensor=tensor)
    w = dataclasses.replace(w, expert_fetch_fraction=0.5)
    hw = dataclasses.replace(PROFILES["angel-a100-40g"], num_devices=devices)
    every = Candidate(placement=Placement(expert_fetch="all"))
    h2d = lambda c: lanes(w, hw, c, 0.0)[1]["host->device"]
    saved = w.micro_batches * 2 * 2 * 18_432 * 4 * 0.5 / devices / hw.h2d_bw
    assert h2d(every) - h2d(every.replace(expert_fetch="routed")) == pytest.approx(saved)


@pytest.mark.slow  # ~8 s: the MoE's and T5's workloads from their shapes
def test_all_reduces_of_moe_and_t5_blocks_by_hand():
    """The tiny MoE (experts of 48 hidden units, 2 a token) and T5 (2 encoder and 3
    decoder blocks) on 8 devices at 2 a model group, a global batch of 16 x 16: a data
    group's (4, 16, 32) fp32 activation, 8,192 B, 2(t-1)/t of it sent each all-reduce. Every block
    recomputing: the MoE's 2 blocks all-reduce the attention's output and each token's
    2 expert rows (3 activations) in forward, again in the recomputed forward and their
    inputs' gradients in backward: 2 x 9 x 8,192 = 147,456 B; T5's 2 encoder blocks 2
    in forward and recomputed and 2 in backward (6), its 3 decoder blocks 3 (self- and
    cross-attention, MLP) in forward and recomputed and 4 in backward (the context's
    gradient besides): (2 x 6 + 3 x 10) x 8,192 = 344,064 B."""
    moe = tiny_config(model=MOE)
    t5 = tiny_config(model=T5, data=PREFIX_LM)
    streamed = Placement()
    batch = dict(batch_size=16, seq_len=16)
    for config, by_hand in ((moe, 2 * 9 * 8_192), (t5, (2 * 6 + 3 * 10) * 8_192)):
        w = Workload.from_config(config.replace(train=batch), devices=8, tensor=2)
        assert tensor_allreduce_bytes(w, streamed, 2) == pytest.approx(by_hand)


SPLIT_MODEL = dict(d_model=64, num_heads=4, d_ff=256)


def test_plan_takes_tensor_parallelism_where_only_a_slice_fits():
    """2 GPUs, the d-64 GPT (a block 50,048 params: 50 pages of 1,024 fp32 elements
    whole; at 1 x 2 a device computes with its dense pages and a slice: 32 pages) and
    a per-device budget of 900 KiB: at 2 x 1 a device cannot hold its window (the
    planner's least: 1.05 MiB), at 1 x 2 it can (800 KiB), so the plan takes
    tensor_parallel=2, says why, and gives the config the split to train with."""
    hw = dataclasses.replace(PROFILES["angel-a100-40g"], num_devices=2)
    config = tiny_config(model=SPLIT_MODEL, memory=dict(page_size="4KiB", device_budget="900KiB"))
    plan = make_plan(config, hw)
    assert plan.tensor_parallel == 2
    assert plan.split.startswith("data x model: 1 x 2 (distributed.tensor_parallel=2)")
    assert "1: does not fit (device short by" in plan.split
    assert plan.config_overrides()["distributed"] == dict(data_parallel=1, tensor_parallel=2)
    assert sum(plan.device.values()) <= 900 * 1024


def test_plan_keeps_data_parallelism_where_the_all_reduces_cost_more():
    """The same model and GPUs with room for a whole block (1 GiB) but 128 rows of 512
    tokens a micro-batch and links of 1 GB/s: Megatron's all-reduces (6 a block of a
    data group's (128, 512, 64) fp32 activation, 16 MiB, 2(t-1)/t of it sent each:
    2 x 6 x 16 MiB = 201 MB a step; 4, not 6, a block that keeps its activations, as a
    plan at 2 x 2 may now choose, and offload.mode=none without model.remat, which
    fits 1 GiB a device since the tenth session) cost more than tensor parallelism saves (half a
    block's gather), so the plan stays 2 x 1 and prices the split it did not take."""
    hw = dataclasses.replace(PROFILES["angel-a100-40g"], num_devices=2, interconnect_bw=1e9)
    train = dict(batch_size=128, seq_len=512)
    model = dict(SPLIT_MODEL, max_seq_len=512)
    config = tiny_config(model=model, train=train, memory=dict(device_budget="1GiB"))
    plan = make_plan(config, hw)
    assert plan.tensor_parallel == 1 and plan.allreduce_bytes == 0
    assert plan.split.startswith("data x model: 2 x 1 (distributed.tensor_parallel=1)")
    at2 = make_plan(config, hw, Workload.from_config(config, devices=2, backend="gpu", tensor=2))
    # 4 a block (2 forward, 2 backward), 2 more a block that recomputes (not one that
    # keeps or swaps its activations, which the plan may choose)
    c = at2.candidate
    recomputed = c.placement.recomputed_blocks(2) if c.mode == "stream" else 2 * c.remat
    allreduces = (2 * 4 + recomputed * 2) * (128 * 512 * 64 * 4)
    assert at2.allreduce_bytes == allreduces
    assert at2.lanes["collectives"] >= allreduces / 1e9  # priced, over the 1 GB/s links
    assert f"2: {at2.step_s:.4g} s/step" in plan.split
    assert at2.step_s > plan.step_s * 1.02
    assert "distributed" not in plan.config_overrides()


def test_plan_for_llama_70b_on_eight_a100s_says_its_split():
    """--plan for configs/llama_70b.py on Angel-PTM's 8 x A100-40G fits and names its
    split: a micro-batch of 1 row leaves 1 x 8 the only split (a row cannot split over
    data groups)."""
    from hetjax.config import load_config

    config = load_config("configs/llama_70b.py")
    plan = make_plan(config, PROFILES["angel-a100-40g"])
    assert plan.tensor_parallel == 8
    assert plan.split.startswith("data x model: 1 x 8 (distributed.tensor_parallel=8)")
    assert plan.split in plan.table()


def _train_auto_2x2(monkeypatch, tmp_path, device_budget: str, **sections):
    """Trains ``offload.mode=auto`` on 4 devices (4 KiB pages, ``device_budget`` a device,
    8 MiB of host) for a tiny config of ``sections``, watching the run plan and build its
    runtime (``train.plan_auto`` and ``train.build_runtime``, each called once, as they
    are): the config, the planned config, the plan and its log lines (``log`` and
    ``detail``), the runtime the run built and its result; checked to split data x model
    2 x 2. (One plan and one runtime: the run's own, not a second of each beside it.)"""
    import hetjax.train
    from hetjax.train import train

    config = tiny_config(
        **sections, offload=dict(mode="auto"),
        memory=dict(page_size="4KiB", device_budget=device_budget, host_budget="8MiB"),
        distributed=dict(data_parallel=4),
    )  # fmt: skip
    logs: list[str] = []
    plans, runtimes = [], []
    plan_auto, build_runtime = hetjax.train.plan_auto, hetjax.train.build_runtime

    def planning(config, workdir=None, log=print, detail=None):
        kept = lambda to: lambda line: (logs.append(line), to(line))
        plans.append(plan_auto(config, workdir, kept(log), kept(detail or log)))
        return plans[-1]

    def building(config, workdir=None):
        runtimes.append(build_runtime(config, workdir))
        return runtimes[-1]

    monkeypatch.setattr(hetjax.train, "plan_auto", planning)
    monkeypatch.setattr(hetjax.train, "build_runtime", building)
    result = train(config, tmp_path / "run", verbose=False)
    assert len(plans) == 1 and len(runtimes) == 1, (plans, runtimes)
    (planned, plan), runtime = plans[0], runtimes[0]
    assert plan is not None and plan.tensor_parallel == 2, logs
    assert planned.distributed.tensor_parallel == 2 and planned.distributed.data_parallel == 2
    assert any("data x model: 2 x 2" in line for line in logs), logs
    ran = json.loads((tmp_path / "run" / "config.json").read_text())
    assert ran["distributed"]["tensor_parallel"] == 2
    return config, planned, plan, logs, runtime, result


@pytest.mark.slow  # ~40 s: measures this machine, then trains 2 runs
def test_auto_picks_tensor_parallelism_on_4_devices_and_trains_equal_to_none(tmp_path, monkeypatch):
    """offload.mode=auto on 4 virtual devices, the d-64 GPT with 2 heads (tensor
    parallelism 1 or 2) and a per-device budget of 800 KiB, under which a device cannot
    hold a whole block's window (the planner's least at 4 x 1: ~900 KiB) but can hold a
    1/2 slice's (~730 KiB): the plan takes data x model 2 x 2, and the run trains with
    it equal to offload.mode=none on one device (SGD, fp32, 1e-5)."""
    from hetjax.train import train

    sgd = dict(name="sgd", lr=0.1, grad_clip=2.0)
    model = dict(d_model=64, num_heads=2, d_ff=256)
    *_, result = _train_auto_2x2(monkeypatch, tmp_path, "800KiB", model=model, optimizer=sgd)
    reference = tiny_config(model=model, optimizer=sgd, offload=dict(mode="none"))
    expected = train(reference, tmp_path / "none", verbose=False)
    assert_gpt_training_equal(result, expected, build_model(reference.model), check_tokens())


@pytest.mark.slow  # ~85 s each: measures this machine, then trains 2 runs
@pytest.mark.parametrize("family", ["moe", "t5"])
def test_auto_splits_moe_and_t5_blocks_on_4_devices_and_trains_equal_to_none(
    tmp_path, monkeypatch, family
):
    """offload.mode=auto on 4 virtual devices, the tiny MoE (4 experts of 48 hidden
    units, 2 a token; tensor parallelism 1 or 2) and the tiny T5 (2 encoder and 3
    decoder blocks; 1, 2 or 4), under a per-device budget in which a device cannot
    hold what it needs at 4 x 1 (the planner's least: the MoE ~655 KiB, T5 ~357 KiB)
    but can at 2 x 2 (with 4 KiB pages: 500 KiB, 345 KiB): the plan takes data x model
    2 x 2, the run trains with it equal to offload.mode=none on one device (SGD, fp32,
    1e-5), and its device bytes as the run's runtime plans them (from the same mesh
    measurement) are the plan's, within its budget."""
    from hetjax.train import train

    model, data, budget = {
        "moe": (MOE, {}, "500KiB"),
        "t5": (T5, PREFIX_LM, "345KiB"),
    }[family]
    sgd = dict(name="sgd", lr=0.1, grad_clip=2.0)
    _, _, plan, logs, runtime, result = _train_auto_2x2(
        monkeypatch, tmp_path, budget, model=model, data=data, optimizer=sgd
    )
    assert any("data x model: 2 x 2" in line and "1: does not fit" in line for line in logs)
    assert runtime.plan.parts == plan.device
    assert sum(plan.device.values()) <= plan.budgets["device"]
    reference = tiny_config(model=model, data=data, optimizer=sgd, offload=dict(mode="none"))
    expected = train(reference, tmp_path / "none", verbose=False)
    logits = (build_model(reference.model), check_tokens()) if family == "moe" else ()
    assert_training_equal(result, expected, *logits)
