"""Tensor parallelism with expert parallelism: the MoE Llama on a data x expert x model
mesh (``distributed.expert_parallel`` and ``distributed.tensor_parallel`` both > 1).

A block's experts are split over both axes (device (d, e, m) holds share d of expert
group e's slice m: ``parallel/layouts.py``'s ``ExpertTensorGrouping``), its attention
by model slice shared over data x expert (the layout's second part,
``layouts.groupings``), its norms and router dense pages; the embedding's and
head's split weights by slice, shared over data x expert (``parallel/groupings.py``).
Training equals one device's (fp32, SGD, as the expert- and tensor-parallel tests
compare: tests/test_moe.py, tests/test_tensor.py) and a checkpoint written on the 3-D
mesh resumes on one device."""

import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_training_equal, assert_trees_close, check_tokens
from test_moe import SGD, SHORT, TRAIN_MOE

from hetjax import support
from hetjax.parallel.grouped import GroupedSlabLayout, GroupPages
from hetjax.parallel.zero import Zero3
from hetjax.train import train
from models import build_model

TIERS = {
    "host": dict(mode="stream", optimizer="host", params="host"),
    "nvme": dict(mode="stream", optimizer="nvme", params="nvme"),
}


def etp_config(data: int, experts: int = 2, tensor: int = 2, tier: str = "host", **sections):
    """The tiny MoE (4 experts, d 32, d_ff 48) on data x expert x model devices, SGD."""
    defaults = dict(
        model=TRAIN_MOE,
        train=SHORT,
        optimizer=SGD,
        offload=TIERS[tier],
        memory=dict(page_size="16KiB"),
    )
    return tiny_config(
        **{**defaults, **sections},
        distributed=dict(data_parallel=data, expert_parallel=experts, tensor_parallel=tensor),
    )


# Pages a device gathers and sends in reduce-scatters per stage, by hand. Pages are
# fitted to 3,072 fp32 elements (12 KiB) at both meshes. A block has three parts, each
# padded to a multiple of the devices sharing it: its experts' group (2 experts' model
# slice of gate, up, down: 3 x 2 x 32 x 24 = 4,608 elements, 2 pages) shared over data;
# its attention's model slice (q 32 x 16, k and v 32 x 8, o 16 x 32: 1,536, 1 page)
# shared over data x expert; its dense rest (router 32 x 4, norms 2 x 32: 192, 1 page)
# padded to every device, gathered over all of them and scattered over data x expert.
# The embedding: its vocabulary's slice (128 x 32 = 4,096, 2 pages, a multiple of data x
# expert) over data x expert, no dense part. The head: lm_head's slice (32 x 128, 2
# pages) likewise, its norm (32) 1 dense page padded to every device, over data x
# expert. A ring over n devices moves (n-1)/n of the pages.
#   2 x 2 x 2: block experts 2 over 2 (1) + attention 4 over 4 (3) + dense 8: scattered
#     over 4 (6), gathered over 8 (7); embed 4 over 4 (3); head 4 over 4 (3) + 8 over 4
#     (6) = 9.
#   1 x 2 x 2: block experts 2 over 1 (0) + attention 2 over 2 (1) + dense 4: scattered
#     over 2 (2), gathered over 4 (3); embed 2 over 2 (1); head 2 over 2 (1) + 4 over 2
#     (2) = 3.
# Before the attention part (its 3,072 elements in the dense pages, gathered whole),
# a block's dense 3,264 elements made 2 pages padded to 8 (4 at 1 x 2 x 2) and it
# gathered 7 + 1 = 8 pages (3 + 0), scattered 6 + 1 = 7 (2 + 0): at this toy size the
# parts' padding to whole pages outweighs the 1/M of attention (a wider block's is
# below, ``WIDE``).
PAGE = 3072 * 4
SCATTER_PAGES = {2: dict(block=10, embed=3, head=9), 1: dict(block=3, embed=1, head=3)}
GATHER_PAGES = {2: 1 + 3 + 7, 1: 0 + 1 + 3}  # a block's: experts + attention + dense


def step_scatter_bytes(data: int) -> int:
    """A step's (one micro-batch's) reduce-scatter bytes: 2 blocks', the embedding's
    twice (its input's backward and the head function's, which hands out the
    embedding's gradient too) and the head's."""
    p = SCATTER_PAGES[data]
    return (2 * p["block"] + 2 * p["embed"] + p["head"]) * PAGE


def test_each_device_fetches_its_expert_groups_slice_and_scatters_hand_counted_bytes():
    """At data x expert x model = 2 x 2 x 2 a block's gather brings device (d, e, m),
    of each expert weight, experts [2e, 2e + 2) cut to model slice m on the hidden axis,
    and of each attention weight its model slice m on the heads' axis, the only pages
    of attention it holds (both cut here from the initial params by numpy slicing); the
    layout turns the pages back into the block; the byte counts of each stage's
    reduce-scatters and a block's gather are the hand counts above (``SCATTER_PAGES``,
    ``GATHER_PAGES``), at 1 x 2 x 2 too; routed experts and deferred updates (the
    defaults) are supported."""
    for data in (1, 2):
        config = etp_config(data)
        zero = Zero3(config)
        assert dict(zero.mesh.shape) == {"data": data, "expert": 2, "model": 2}
        layouts = zero.stage_layouts(build_model(config.model), config.memory.page_size)
        assert layouts["block"].page_elems * 4 == PAGE
        for stage, pages in SCATTER_PAGES[data].items():
            assert zero.scattered_size(layouts[stage]) * 4 == pages * PAGE, (data, stage)
        assert layouts["block"].gathered_size * 4 == GATHER_PAGES[data] * PAGE, data
    model = build_model(config.model)  # (the loop ends at 2 x 2 x 2)
    layout = layouts["block"]
    # one program for the init (op by op it compiles ~140) and block 0 cut in numpy
    params = jax.jit(model.init)(jax.random.key(0))
    block = jax.tree.map(lambda a: np.asarray(a)[0], params["blocks"])
    slab = layout.flatten_np(block)
    assert_trees_close(layout.unflatten(slab), block, rtol=0)
    split = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}  # each expert's hidden (mlp) axis
    host = jax.device_put(slab.reshape(-1, layout.page_elems), zero.sharded.slab_host)
    pages = zero.to_device(host, layout)
    assert zero.comm["all_gather"] == GATHER_PAGES[2] * PAGE
    assert isinstance(pages, GroupPages) and len(pages.groups) == 2
    P, (experts, attention) = layout.page_elems, layout.parts
    assert attention.grouping.share_axes == ("data", "expert")
    devices = list(zero.mesh.devices.flat)
    seen = set()
    for shard in pages.groups[0].addressable_shards:
        e, m = divmod(devices.index(shard.device) % 4, 2)  # (data, expert, model) order
        seen.add((e, m))
        got = np.asarray(shard.data).reshape(-1)
        assert got.size == experts.layout.num_pages * P
        for leaf in experts.layout.leaves:
            name = leaf.path[-1]
            whole = block["moe"][name][2 * e : 2 * e + 2]
            mine = np.split(whole, 2, axis=split[name])[m]
            np.testing.assert_array_equal(got[leaf.offset : leaf.offset + leaf.size], mine.ravel())
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # attention by heads: q, k, v on their output axis, o on its input axis
    heads = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 0}
    seen = set()
    for shard in pages.groups[1].addressable_shards:
        m = devices.index(shard.device) % 2
        seen.add(m)
        got = np.asarray(shard.data).reshape(-1)
        assert got.size == 4 * P  # 1 page of slice, padded to data x expert: no other slice
        for leaf in attention.layout.leaves:
            name = leaf.path[0]
            mine = np.split(block[name]["kernel"], 2, axis=heads[name])[m]
            np.testing.assert_array_equal(got[leaf.offset : leaf.offset + leaf.size], mine.ravel())
    assert seen == {0, 1} and {f.path[0] for f in attention.layout.leaves} == set(heads)
    # the mesh has its own row of the support matrix: routed experts (the default) are
    # fetched by expert group and slice (test_routed_on_the_3d_mesh_...), and deferred
    assert support.parallelism(config.distributed) == support.TENSOR_EXPERT
    assert support.fallbacks(config) == []


# A wider block (d 256: attention q and o 256 x 256, k and v 256 x 128, 196,608
# elements; router 256 x 4 and norms 2 x 256, 1,536; experts 3 x 4 x 256 x 48, 147,456),
# where attention is most of a device's gather as in a real MoE block. Its 345,600
# elements fit pages of 4,096 (16 KiB; 85 pages, 88 at a multiple of 4 or 8, 3,928
# elements a page rounded up to 1,024s). A device's model slice of attention: 98,304
# elements, 24 pages; its experts' group: 2 experts' slice, 3 x 2 x 256 x 24 = 36,864,
# 9 pages; the dense rest 1 page. By hand, pages a device gathers (a ring over n: (n-1)/n):
#   2 x 2 x 2 split: attention 24 (a multiple of data x expert 4) -> 18; experts 10 (a
#     multiple of data 2) -> 5; dense 8 -> 7: 30. Attention in the dense pages instead
#     (198,144 elements: 49 pages -> 56) -> 49; experts 5: 54.
#   1 x 2 x 2 split: attention 24 over 2 -> 12; experts 9 over 1 -> 0; dense 4 -> 3: 15.
#     Attention dense: 49 -> 52 over 4 -> 39; experts 0: 39.
WIDE = dict(TRAIN_MOE, d_model=256)
WIDE_PAGE = 4096 * 4


@pytest.mark.parametrize("data, split, dense", [(1, 15, 39), (2, 30, 54)], ids=["1x2x2", "2x2x2"])
def test_a_wide_blocks_attention_arrives_as_each_devices_model_slice(data, split, dense):
    """A wide MoE block's gather brings a device its 1/M model slice of attention (24
    of the 48 pages attention takes whole), shared over data x expert: the
    hand-counted pages (``WIDE``) against the same block laid out with its experts'
    part alone (attention in the dense pages, gathered whole, as before this layout)."""
    config = etp_config(data, model=WIDE)
    zero = Zero3(config)
    model = build_model(config.model)
    layout = zero.stage_layouts(model, config.memory.page_size)["block"]
    assert layout.page_elems * 4 == WIDE_PAGE
    experts, attention = layout.parts
    assert attention.layout.num_pages == 24 and attention.shares == 2 * data
    assert attention.grouping.share_axes == ("data", "expert")
    assert layout.gathered_size * 4 == split * WIDE_PAGE
    shapes = jax.eval_shape(model.init, jax.random.key(0))["blocks"]
    block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes)
    whole = GroupedSlabLayout.of(block, WIDE_PAGE, layout.devices, experts.grouping)
    assert whole.gathered_size * 4 == dense * WIDE_PAGE


@pytest.mark.slow  # ~6-15 s each on 2 cores
@pytest.mark.parametrize(
    "data, tier", [(1, "host"), (2, "nvme")], ids=["expert2xmodel2", "data2xexpert2xmodel2-nvme"]
)
@pytest.mark.guards(tier="host", parallel="tensor_expert", ids="expert2xmodel2")
@pytest.mark.guards(tier="nvme", parallel="tensor_expert", ids="data2xexpert2xmodel2-nvme")
def test_expert_and_tensor_parallel_equal_single_device(tmp_path, data, tier, reference_run):
    """On 1 x 2 x 2 (4 devices, state in RAM) and 2 x 2 x 2 (8 devices, params streamed
    from NVMe and optimizer state on NVMe): losses, the validation loss, every final
    param, the logits and the gradient norms equal one device's at 1e-5; every step's
    reduce-scatter bytes are the hand count (``step_scatter_bytes``)."""
    reference = reference_run(etp_config(1, 1, 1, "host"))
    config = etp_config(data, tier=tier)
    result = train(config, tmp_path / "etp", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())
    norms = [[r["grad_norm"] for r in run.records] for run in (result, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)
    assert {r["reduce_scatter_bytes"] for r in result.records} == {step_scatter_bytes(data)}
    assert all(r["all_gather_bytes"] > 0 for r in result.records)


@pytest.mark.slow  # ~5-20 s each (2 cores)
@pytest.mark.parametrize(
    "feature",
    [dict(keep_blocks=1, swap_blocks=1), dict(optimizer_device_stages=2)],
    ids=["keep_and_swap", "device_cache"],
)
def test_offload_features_on_expert2xmodel2_equal_single_device(tmp_path, feature, reference_run):
    """A kept block and a swapped one (their keep levels and residuals measured on one
    device inside the mesh, whose all-to-all and split experts they need), and the
    device cache of optimizer state (embed's and block 0's updates on each device), at
    1 x 2 x 2: losses, validation loss, every final param and the logits equal one
    device's at 1e-5."""
    reference = reference_run(etp_config(1, 1, 1, "host"))
    config = etp_config(1).replace(offload=dict(mode="stream", **feature))
    result = train(config, tmp_path / "etp", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


@pytest.mark.slow  # ~20-60 s each: two runs
@pytest.mark.parametrize("data", [1, 2], ids=["expert2xmodel2", "data2xexpert2xmodel2"])
def test_routed_on_the_3d_mesh_equals_fetching_every_expert(tmp_path, data):
    """Routed experts at 1 x 2 x 2 and 2 x 2 x 2 (16 experts, top-1, 4 KiB pages: an expert's rows
    span pages): each device copies in and gathers, over the data axis, its share of its
    expert group's model slice of the routed experts' pages, beside the attention slice
    and dense pages the window gathers. SGD with clipping, 3 steps: equal to copying
    every expert at 1e-5 (losses, validation loss, every param, logits), fewer experts
    fetched than the blocks hold."""
    from test_expert_fetch import SPARSE
    from test_expert_fetch_zero import _sgd

    def run(fetch):
        config = _sgd(fetch, data, 2).replace(
            offload=dict(mode="stream", expert_fetch=fetch, expert_updates="all"),
            distributed=dict(data_parallel=data, expert_parallel=2, tensor_parallel=2),
        )
        assert support.fallbacks(config) == []
        return train(config, tmp_path / fetch, verbose=False)

    routed, every = run("routed"), run("all")
    assert_training_equal(
        routed, every, build_model(etp_config(1, model=SPARSE).model), check_tokens()
    )
    # 2 micro-batches x 3 block copies (block 0's forward and backward, block 1's once)
    assert all(0 < r["experts_fetched"] < 16 * 2 * 3 for r in routed.records)
    assert not any("experts_fetched" in r for r in every.records)


@pytest.mark.slow  # ~30-60 s: three runs
def test_deferred_updates_on_expert2xmodel2_equal_every_expert():
    """Deferred expert updates at 1 x 2 x 2 (AdamW, state on NVMe; each process defers
    its pages wholly in experts no device routed to, of its expert group's slice): bit
    for bit the run updating every expert, the losses within 1e-5 of one device
    deferring, some pages deferred and some caught up (``deferred_equal_to_every_expert``)."""
    from test_expert_fetch_zero import deferred_equal_to_every_expert

    deferred_equal_to_every_expert(dict(data_parallel=1, expert_parallel=2, tensor_parallel=2))


@pytest.mark.slow  # ~10-25 s: three runs (and the shared reference)
def test_checkpoint_at_2x2x2_resumes_on_one_device_and_at_1x2x2(tmp_path, reference_run):
    """A checkpoint written at data x expert x model = 2 x 2 x 2 with state on NVMe (its
    block slabs cut by expert group and slice) resumes on one device and at 1 x 2 x 2
    (another layout: laid out anew from the params reassembled from its pieces), each
    ending where the uninterrupted run does: one device's 4 steps, the reference the
    equivalence tests here share (``reference_run``; state in RAM, no checkpoints)."""

    def run(steps, workdir, data=2, experts=2, tensor=2, tier="nvme"):
        config = etp_config(data, experts, tensor, tier).replace(
            train=dict(steps=steps),
            memory=dict(page_size="16KiB", nvme_path=str(tmp_path / workdir / "nvme")),
            checkpoint=dict(every_steps=2, at_end=False),
        )
        return train(config, tmp_path / workdir, verbose=False)

    straight = reference_run(etp_config(1, 1, 1, "host"))
    assert len(straight.losses) == 4
    run(2, "saved")
    for workdir, data, experts, tensor in [("one", 1, 1, 1), ("etp", 1, 2, 2)]:
        shutil.copytree(tmp_path / "saved" / "checkpoints", tmp_path / workdir / "checkpoints")
        resumed = run(4, workdir, data, experts, tensor)
        np.testing.assert_allclose(resumed.losses, straight.losses[2:], rtol=1e-5)
        assert_trees_close(resumed.params, straight.params)


@pytest.mark.slow  # ~1-4 s: the layouts and a plan of the tiny model
def test_planner_prices_the_3d_mesh_as_the_runtime_lays_it_out():
    """The planner's workload at 2 x 2 x 2 takes the runtime's layouts: a block's
    reduce-scatters send the hand-counted 10 pages (``SCATTER_PAGES``), the embedding's
    twice (the head function's and its input's backward's) and the head's, 2 x 3 + 9
    (as ``step_scatter_bytes``), its gather brings 7 of the 8 dense pages, 3 of its
    attention slice's 4 and 1 of its experts' group's 2 (``GATHER_PAGES``),
    and its all-to-all the fixed-capacity rows of its data group (by hand: the
    micro-batch's 4 rows over 4 data groups, 1 row x 16 tokens x 2 experts a token,
    sent to and back from the G = 2 expert devices, a send buffer of G slots, (G-1)/G
    of it leaving: 2 x 2 x 16 x 2 x 32 x 4 B / 2 = 8,192 B). A plan on an 8-device
    profile prices collectives; ``auto`` searches no tensor degree beside expert
    parallelism (the config's is taken as given)."""
    from hetjax.planning.hardware import get_profile
    from hetjax.planning.search import make_plan
    from hetjax.planning.split import tensor_degrees
    from hetjax.planning.workload import Workload

    config = etp_config(2)
    w = Workload.from_config(config, devices=8, tensor=2)
    page = PAGE // 4
    assert w.scattered_block_params == 10 * page
    assert w.scattered_rest_params == (2 * 3 + 9) * page
    assert w.gathered_block_params == (7 + 3 + 1) * page
    assert w.exchange_bytes == 8192
    plan = make_plan(config, get_profile("angel-a100-40g"))
    assert plan.tensor_parallel == 2 and plan.lanes["collectives"] > 0
    assert tensor_degrees(config, 8) == [2]
    assert tensor_degrees(etp_config(2, experts=1, tensor=1), 4) == [1, 2]  # searched
    assert tensor_degrees(etp_config(2, tensor=1), 4) == [1]  # not beside experts


@pytest.mark.slow  # two child processes compile everything anew (~60-90 s on 2 cores)
def test_two_processes_at_expert2xmodel2_equal_single_device(tmp_path, reference_run):
    """2 processes x 2 CPU devices over gloo at 1 x 2 x 2: each process holds one expert
    group's two model slices (the all-to-all crosses the processes, the model axis's
    all-reduces stay in each): losses, validation loss and final params equal one
    device's."""
    from test_zero import _params_like, _run_two_processes

    reference = reference_run(etp_config(1, 1, 1, "host"))
    model = [f"model.{k}={v}" for k, v in TRAIN_MOE.items()]
    saved = _run_two_processes(
        tmp_path / "two",
        *model,
        "train.steps=4",
        "train.eval_batches=1",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "distributed.expert_parallel=2",
        "distributed.tensor_parallel=2",
    )
    np.testing.assert_allclose(saved["losses"], reference.losses, rtol=1e-5)
    np.testing.assert_allclose(saved["val_loss"], reference.val_loss, rtol=1e-5)
    assert_trees_close(_params_like(saved, reference.params), reference.params)
