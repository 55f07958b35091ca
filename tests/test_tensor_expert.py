"""Tensor parallelism with expert parallelism: the MoE Llama on a data x expert x model
mesh (``distributed.expert_parallel`` and ``distributed.tensor_parallel`` both > 1).

A block's experts are split over both axes (device (d, e, m) holds share d of expert
group e's slice m: ``runtime/experts.py``'s ``ExpertTensorGrouping``), its other
weights are dense pages; the embedding's and head's split weights by slice, shared over
data x expert (``runtime/tensor.py``). Training equals one device's (fp32, SGD, as the
expert- and tensor-parallel tests compare: tests/test_moe.py, tests/test_tensor.py) and
a checkpoint written on the 3-D mesh resumes on one device."""

import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import assert_training_equal, assert_trees_close, check_tokens
from test_moe import SGD, SHORT, TRAIN_MOE

from hetjax import support
from hetjax.runtime.grouped import ExpertPages
from hetjax.runtime.zero import Zero3
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


# Reduce-scatter pages a device sends per stage gradient, by hand. Pages are fitted to
# 3,072 fp32 elements (12 KiB) at both meshes. A block: dense part (norms 2 x 32,
# q 32 x 32, k and v 32 x 16, o 32 x 32, router 32 x 4: 3,264 elements, 2 pages) padded
# to a multiple of every device and scattered over data x expert; its group (2 experts'
# slice of gate, up, down: 3 x 2 x 32 x 24 = 4,608, 2 pages) over data only. The
# embedding: its vocabulary's slice (128 x 32 = 4,096, 2 pages, a multiple of data x
# expert) over data x expert, no dense part. The head: lm_head's slice (32 x 128, 2
# pages) likewise, its norm (32) 1 dense page padded to every device, over data x expert.
#   2 x 2 x 2: block dense 8 pages over 4 (6) + group 2 over 2 (1) = 7; embed 4 over 4
#     (3); head 4 over 4 (3) + 8 over 4 (6) = 9.
#   1 x 2 x 2: block dense 4 over 2 (2) + group 2 over 1 (0) = 2; embed 2 over 2 (1);
#     head 2 over 2 (1) + 4 over 2 (2) = 3.
PAGE = 3072 * 4
SCATTER_PAGES = {2: dict(block=7, embed=3, head=9), 1: dict(block=2, embed=1, head=3)}


def step_scatter_bytes(data: int) -> int:
    """A step's (one micro-batch's) reduce-scatter bytes: 2 blocks', the embedding's
    twice (its input's backward and the head function's, which hands out the
    embedding's gradient too) and the head's."""
    p = SCATTER_PAGES[data]
    return (2 * p["block"] + 2 * p["embed"] + p["head"]) * PAGE


def test_each_device_fetches_its_expert_groups_slice_and_scatters_hand_counted_bytes():
    """At data x expert x model = 2 x 2 x 2 a block's gather brings device (d, e, m),
    of each expert weight, experts [2e, 2e + 2) cut to model slice m on the hidden axis
    (cut here from the initial params by numpy slicing); the layout turns the pages
    back into the block; the byte count of each stage's reduce-scatters is the hand
    count above (``SCATTER_PAGES``); routed experts fall back as under tensor
    parallelism."""
    config = etp_config(2)
    model = build_model(config.model)
    zero = Zero3(config)
    assert dict(zero.mesh.shape) == {"data": 2, "expert": 2, "model": 2}
    layouts = zero.stage_layouts(model, config.memory.page_size)
    layout = layouts["block"]
    assert layout.page_elems * 4 == PAGE
    for stage, pages in SCATTER_PAGES[2].items():
        assert zero.scattered_size(layouts[stage]) * 4 == pages * PAGE, stage
    block = jax.tree.map(lambda a: np.asarray(a[0]), model.init(jax.random.key(0))["blocks"])
    slab = layout.flatten_np(block)
    assert_trees_close(layout.unflatten(slab), block, rtol=0)
    split = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}  # each expert's hidden (mlp) axis
    host = jax.device_put(slab.reshape(-1, layout.page_elems), zero.sharded.slab_host)
    pages = zero.to_device(host, layout)
    assert isinstance(pages, ExpertPages)
    P, G = layout.page_elems, layout.group
    devices = list(zero.mesh.devices.flat)
    seen = set()
    for shard in pages.group.addressable_shards:
        e, m = divmod(devices.index(shard.device) % 4, 2)  # (data, expert, model) order
        seen.add((e, m))
        got = np.asarray(shard.data).reshape(-1)
        assert got.size == G.num_pages * P
        for leaf in G.leaves:
            name = leaf.path[-1]
            whole = block["moe"][name][2 * e : 2 * e + 2]
            mine = np.split(whole, 2, axis=split[name])[m]
            np.testing.assert_array_equal(got[leaf.offset : leaf.offset + leaf.size], mine.ravel())
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # the mesh has its own row of the support matrix: routed experts (the default) fall
    # back to copying every expert (no routed gather reads the group-and-slice layout)
    assert support.parallelism(config.distributed) == support.TENSOR_EXPERT
    assert [line.split(":")[0] for line in support.fallbacks(config)] == [
        "offload.expert_fetch",
        "offload.expert_updates",
    ]


@pytest.mark.slow  # ~6-15 s each on 2 cores
@pytest.mark.parametrize(
    "data, tier", [(1, "host"), (2, "nvme")], ids=["expert2xmodel2", "data2xexpert2xmodel2-nvme"]
)
def test_expert_and_tensor_parallel_equal_single_device(tmp_path, data, tier):
    """On 1 x 2 x 2 (4 devices, state in RAM) and 2 x 2 x 2 (8 devices, params streamed
    from NVMe and optimizer state on NVMe): losses, the validation loss, every final
    param, the logits and the gradient norms equal one device's at 1e-5; every step's
    reduce-scatter bytes are the hand count (``step_scatter_bytes``)."""
    reference = train(etp_config(1, 1, 1, "host"), tmp_path / "one", verbose=False)
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
def test_offload_features_on_expert2xmodel2_equal_single_device(tmp_path, feature):
    """A kept block and a swapped one (their keep levels and residuals measured on one
    device inside the mesh, whose all-to-all and split experts they need), and the
    device cache of optimizer state (embed's and block 0's updates on each device), at
    1 x 2 x 2: losses, validation loss, every final param and the logits equal one
    device's at 1e-5."""
    reference = train(etp_config(1, 1, 1), tmp_path / "one", verbose=False)
    config = etp_config(1).replace(offload=dict(mode="stream", **feature))
    result = train(config, tmp_path / "etp", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


@pytest.mark.slow  # ~10-25 s: four runs
def test_checkpoint_at_2x2x2_resumes_on_one_device_and_at_1x2x2(tmp_path):
    """A checkpoint written at data x expert x model = 2 x 2 x 2 with state on NVMe (its
    block slabs cut by expert group and slice) resumes on one device and at 1 x 2 x 2
    (another layout: laid out anew from the params reassembled from its pieces), each
    ending where the uninterrupted run does."""

    def run(steps, workdir, data=2, experts=2, tensor=2, tier="nvme"):
        config = etp_config(data, experts, tensor, tier).replace(
            train=dict(steps=steps),
            memory=dict(page_size="16KiB", nvme_path=str(tmp_path / workdir / "nvme")),
            checkpoint=dict(every_steps=2, at_end=False),
        )
        return train(config, tmp_path / workdir, verbose=False)

    straight = run(4, "straight", 1, 1, 1)
    run(2, "saved")
    for workdir, data, experts, tensor in [("one", 1, 1, 1), ("etp", 1, 2, 2)]:
        shutil.copytree(tmp_path / "saved" / "checkpoints", tmp_path / workdir / "checkpoints")
        resumed = run(4, workdir, data, experts, tensor)
        np.testing.assert_allclose(resumed.losses, straight.losses[2:], rtol=1e-5)
        assert_trees_close(resumed.params, straight.params)


@pytest.mark.slow  # ~1-4 s: the layouts and a plan of the tiny model
def test_planner_prices_the_3d_mesh_as_the_runtime_lays_it_out():
    """The planner's workload at 2 x 2 x 2 takes the runtime's layouts: a block's
    reduce-scatters send the hand-counted 7 pages (``SCATTER_PAGES``), the embedding's
    twice (the head function's and its input's backward's) and the head's, 2 x 3 + 9
    (as ``step_scatter_bytes``), its gather brings 7 of the 8 dense pages and 1 of its group's 2,
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
    assert w.scattered_block_params == 7 * page
    assert w.scattered_rest_params == (2 * 3 + 9) * page
    assert w.gathered_block_params == (7 + 1) * page
    assert w.exchange_bytes == 8192
    plan = make_plan(config, get_profile("angel-a100-40g"))
    assert plan.tensor_parallel == 2 and plan.lanes["collectives"] > 0
    assert tensor_degrees(config, 8) == [2]
    assert tensor_degrees(etp_config(2, experts=1, tensor=1), 4) == [1, 2]  # searched
    assert tensor_degrees(etp_config(2, tensor=1), 4) == [1]  # not beside experts


@pytest.mark.slow  # two child processes compile everything anew (~60-90 s on 2 cores)
def test_two_processes_at_expert2xmodel2_equal_single_device(tmp_path):
    """2 processes x 2 CPU devices over gloo at 1 x 2 x 2: each process holds one expert
    group's two model slices (the all-to-all crosses the processes, the model axis's
    all-reduces stay in each): losses, validation loss and final params equal one
    device's."""
    from test_zero import _params_like, _run_two_processes

    reference = train(etp_config(1, 1, 1), tmp_path / "one", verbose=False)
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
