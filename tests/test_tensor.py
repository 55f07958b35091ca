"""Tensor parallelism (``distributed.tensor_parallel``, hetjax/parallel/zero.py): each
block's compute split over the mesh's ``model`` axis by the models' logical axes
(Megatron's split: attention by heads, the MLP by its hidden units, the vocabulary),
composed with ZeRO-3 over every device, equals single-device training.

The reference for D data-parallel devices is one device with ``train.grad_accum=D``, as
in tests/test_zero.py (the same sum over the same rows); SGD with clipping binding in
some steps, fp32, 1e-5. The model axis's devices share their rows: they add nothing to
that sum, only the all-reduces of the split matmuls (whose partial sums round
differently from one device's: measured ~5e-7 in the losses)."""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from equivalence import (
    assert_gpt_training_equal,
    assert_training_equal,
    assert_trees_close,
    check_tokens,
    without_key_bias,
)

from hetjax.config import ConfigError
from hetjax.parallel.grouped import GroupPages
from hetjax.parallel.zero import Zero3
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from models import build_model

SGD_CLIP = dict(name="sgd", lr=0.1, grad_clip=2.0)  # clipping binds in some of 5 steps
PAGES = dict(page_size="16KiB")
TIERS = {
    "host": dict(mode="stream", optimizer="host", params="host"),
    "nvme": dict(mode="stream", optimizer="nvme", params="nvme"),
}
LLAMA = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
    tie_embeddings=False, max_seq_len=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def references(reference_run):
    """One device, ``grad_accum`` micro-batches (the data-parallel degree), per model."""
    runs = {}

    def reference(accum: int, model: dict | None = None):
        key = (accum, json.dumps(model, sort_keys=True))
        if key not in runs:
            config = tiny_config(optimizer=SGD_CLIP, train=dict(grad_accum=accum))
            if model:
                config = config.replace(model=model)
            runs[key] = reference_run(config)
        return runs[key]

    return reference


def tp_config(data_parallel: int, tensor: int, tier: str = "host", **sections):
    """The tiny GPT on data x tensor devices (``sections`` replace the defaults here)."""
    defaults = dict(optimizer=SGD_CLIP, offload=TIERS[tier], memory=PAGES)
    return tiny_config(
        **{**defaults, **sections},
        distributed=dict(data_parallel=data_parallel, tensor_parallel=tensor),
    )


# Reduce-scatter bytes a device sends a step (one micro-batch), by hand: each gradient
# (n-1)/n of its pages over the n devices it is scattered on; the model axis's devices
# compute the same rows, so with S data devices both a stage's split weights' slice and
# its dense pages (padded to a multiple of all devices) go over S. A step sends 2 blocks'
# gradients, the embedding's twice (its input's backward and the tied head's) and the
# head's (64 norm elements, no split weight: plain pages). Pages (parallel/groupings.py's
# layout, as in the device-cache comment below): a block's dense part 3,488 elements and
# its split kernels 4,608 a model index, the embedding's positions 1,024 dense and its
# vocabulary 4,096 a model index.
#   1 x M: S = 1, nothing.
#   2 x 2, pages of 4,096 (16 KiB): a block's dense 1 page padded to 4 (sends 2) and slice
#     2 pages (sends 1), so 3; the embedding dense 4 (2) + slice 1 padded to 2 (1), 3; the
#     head 4 pages (2): 2 x 3 + 2 x 3 + 2 = 14 pages.
#   4 x 2, pages fitted to 2,048 (8 KiB; the block's 12,704 elements in 8 pages): a block's
#     dense 2 padded to 8 (sends 6) and slice 3 padded to 4 (3), so 9; the embedding dense
#     1 padded to 8 (6) + slice 2 padded to 4 (3), 9; the head 8 (6): 18 + 18 + 6 = 42.
SCATTERED = {(1, 2): 0, (2, 2): 14 * 16384, (1, 4): 0, (4, 2): 42 * 8192}


@pytest.mark.parametrize(
    "data, tensor, tier",
    [
        (1, 2, "host"),  # the default run's: TP2 alone
        pytest.param(2, 2, "nvme", marks=pytest.mark.slow),  # ~15 s each
        pytest.param(1, 4, "host", marks=pytest.mark.slow),
        pytest.param(4, 2, "nvme", marks=pytest.mark.slow),  # 8 devices
    ],
    ids=["tp2", "dp2xtp2-nvme", "tp4", "dp4xtp2-nvme"],
)
@pytest.mark.guards(tier="host", parallel="tensor", ids=("tp2", "tp4"))
@pytest.mark.guards(tier="nvme", parallel="tensor", ids=("dp2xtp2-nvme", "dp4xtp2-nvme"))
def test_tensor_parallel_equals_single_device(references, tmp_path, data, tensor, tier):
    """GPT: losses, validation loss, every final param and the logits equal one
    device's (grad_accum = the data degree) at 1e-5, with params and optimizer state
    in RAM or streamed from NVMe; every device stores 1/(data x tensor) of the pages. The
    gradients are reduce-scattered over the data axis only: the step's count of their
    bytes is the hand-derived one (``SCATTERED``)."""
    config = tp_config(data, tensor, tier)
    result = train(config, tmp_path, verbose=False)
    reference = references(data)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    assert all(r["all_gather_bytes"] > 0 for r in result.records)
    scattered = {r["reduce_scatter_bytes"] for r in result.records}  # every step's
    assert scattered == {SCATTERED[data, tensor]}, scattered
    zero = Zero3(config)
    assert dict(zero.mesh.shape) == {"data": data, "expert": 1, "model": tensor}
    layout = zero.stage_layouts(build_model(config.model), config.memory.page_size)["block"]
    assert zero.own_pages(layout)[1] == layout.num_pages  # one process holds every share
    assert layout.num_pages % (data * tensor) == 0  # an equal share per device


@pytest.mark.slow  # ~20 s
def test_tensor_parallel_llama_equals_single_device(references, tmp_path):
    """Llama (grouped-query attention split by query and kv heads, the gated MLP by its
    hidden units, untied vocabulary) at 2 x 2 with state on NVMe equals one device."""
    config = tp_config(2, 2, "nvme", model=LLAMA)
    result = train(config, tmp_path, verbose=False)
    reference = references(2, LLAMA)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


@pytest.mark.slow  # ~30 s: two runs each
@pytest.mark.parametrize("family", ["mixtral", "t5"])
def test_tensor_parallel_moe_and_t5_equal_single_device(tmp_path, family):
    """The mixture-of-experts block (experts' MLPs split by their hidden units, the
    router whole; its routed experts' slices copied, runtime/experts/routed_zero.py) and T5
    (an encoder and a decoder group, relative position buckets whole) at tensor 2 equal
    one device's streaming run."""
    from test_moe import SHORT as MOE_SHORT
    from test_moe import TRAIN_MOE
    from test_t5 import SHAPE as T5_SHAPE
    from test_t5 import SHORT as T5_SHORT

    sections = {
        "mixtral": dict(model=TRAIN_MOE, train=MOE_SHORT),
        "t5": dict(model=T5_SHAPE, train=T5_SHORT, data=dict(objective="prefix_lm")),
    }[family]
    runs = []
    for tensor in (1, 2):
        config = tp_config(1, tensor, **sections)
        runs.append(train(config, tmp_path / str(tensor), verbose=False))
    logits = (build_model(config.model), check_tokens()) if family != "t5" else ()
    assert_training_equal(runs[1], runs[0], *logits)  # T5's logits need targets: not here


def _backward_hlos(config, names=("block_bwd",)) -> dict[str, str]:
    """The compiled HLO of the stage functions ``names`` (of ``block_bwd``, ``embed_bwd``,
    ``head_fwd_bwd``), each on its abstract arguments, the pages as the gather hands them
    over."""
    runtime = StreamingRuntime(config, parallel=Zero3(config))
    try:
        sds, zero, t = jax.ShapeDtypeStruct, runtime.parallel, config.train
        pages = lambda stage: zero.device_pages(runtime.layouts[stage], np.float32)
        rows = lambda dtype, *shape: sds(
            (t.micro_batch_size, t.seq_len, *shape), dtype, sharding=zero.sharded.batch
        )
        x, tokens = rows(np.float32, config.model.d_model), rows(np.int32)
        scale = sds((), np.float32, sharding=zero.sharded.gathered)
        args = {
            "block_bwd": (pages("block"), x, x),
            "embed_bwd": (pages("embed"), tokens, x),
            "head_fwd_bwd": (pages("head"), pages("embed"), x, tokens, scale),
        }
        fns = runtime.fns
        return {n: getattr(fns, n).lower(*args[n]).compile().as_text() for n in names}
    finally:
        runtime.close()


def _block_backward_hlo(config) -> str:
    return _backward_hlos(config)["block_bwd"]


@pytest.mark.slow  # ~6 s: compiles two runtimes' block backward (tp2's equality: default run)
def test_block_compute_splits_over_the_model_axis(tmp_path):
    """The split is XLA's, from the params' logical axes (no layer code): a block's
    backward compiled for 2 model devices computes half the MLP's hidden units (its
    kernel's gradient (32, 64) of (32, 128)) and half the heads (scores (4 rows, 2 heads,
    8, 8)), and all-reduces the split matmuls' partial sums; for 2 data devices every
    device computes whole kernels and all heads on its 2 rows, reducing nothing but the
    gradient (a reduce-scatter). The tiny GPT: d 32, 4 heads, MLP 128, micro-batch 4 x 16
    (attention in tiles of 8)."""
    count = lambda text, op: text.count(f" {op}(") + text.count(f" {op}-start(")
    dots = lambda text: set(re.findall(r"= (f32\[[0-9,]+\])\{[^}]*\} dot\(", text))
    tp = _block_backward_hlo(tp_config(1, 2, memory=dict(PAGES, nvme_path=str(tmp_path / "a"))))
    dp = _block_backward_hlo(tp_config(2, 1, memory=dict(PAGES, nvme_path=str(tmp_path / "b"))))
    assert count(tp, "all-reduce") > 0 and count(dp, "all-reduce") == 0
    assert {"f32[32,64]", "f32[4,2,8,8]"} <= dots(tp), dots(tp)  # half the MLP, half the heads
    assert not {"f32[32,128]", "f32[32,96]"} & dots(tp), dots(tp)  # no whole kernel
    assert {"f32[32,128]", "f32[2,4,8,8]"} <= dots(dp), dots(dp)


# Pages of 16 KiB (4,096 fp32) each gradient's reduce-scatter sends a device, by hand
# (``SCATTERED``'s derivation): the block's, the embedding's (its input's backward), the
# head's, and the head function's (the head's and the tied embedding's).
SCATTER_PAGES = {
    (2, 2): dict(block=3, embed=3, head=2),
    (1, 2): dict(block=0, embed=0, head=0),
    (4, 1): dict(block=3, embed=3, head=3),  # every stage 4 pages over 4 devices
}


@pytest.mark.slow  # ~15 s: three runtimes' backwards compiled
@pytest.mark.parametrize("data, tensor", list(SCATTER_PAGES))
def test_reduce_scatter_counter_is_what_the_compiled_backwards_send(tmp_path, data, tensor):
    """The runtime's count of a gradient's reduce-scatter bytes
    (``Zero3.scattered_size``) is the hand-derived one and what XLA compiled the block's
    and the embedding's backward to send (their HLO's reduce-scatters, ring: (g-1)/g of
    the operand a device, ``bench.zero.wire_bytes``): over the data axis only under
    tensor parallelism (at 1 x 2 nothing), over every device without. The head's
    function sends the head's and the tied embedding's gradients, less under tensor
    parallelism: the embedding's dense pages there are its position table alone, whose
    gradient in the head is zeros, and XLA drops their scatter (2 pages at 2 x 2)."""
    from hetjax.bench.zero import wire_bytes

    config = tp_config(data, tensor, memory=dict(PAGES, nvme_path=str(tmp_path)))
    zero = Zero3(config)
    layouts = zero.stage_layouts(build_model(config.model), config.memory.page_size)
    pages = SCATTER_PAGES[data, tensor]
    page = 16384
    for stage, n in pages.items():
        assert zero.scattered_size(layouts[stage]) * 4 == n * page, stage
    hlos = _backward_hlos(config, ("block_bwd", "embed_bwd", "head_fwd_bwd"))
    sent = {name: wire_bytes(text).get("reduce-scatter", 0) for name, text in hlos.items()}
    dropped = 2 if (data, tensor) == (2, 2) else 0  # the head's zero position gradient's
    assert sent == {
        "block_bwd": pages["block"] * page,
        "embed_bwd": pages["embed"] * page,
        "head_fwd_bwd": (pages["head"] + pages["embed"] - dropped) * page,
    }


def test_each_device_fetches_only_its_slice_of_the_split_weights():
    """Streamed blocks arrive already split: at data x tensor = 2 x 2 each device's
    gather of a block brings the dense pages whole and, of every weight the rules split
    (the MLP's two kernels, the attention's output kernel), only its model index's slice,
    cut here from the initial params by hand (numpy slicing on the split axis); the
    bytes a device holds of the block are under the whole block's."""
    config = tp_config(2, 2)
    model = build_model(config.model)
    zero = Zero3(config)
    layout = zero.stage_layouts(model, config.memory.page_size)["block"]
    assert isinstance(layout.device_pages(np.float32), GroupPages)
    block = jax.tree.map(lambda a: np.asarray(a[0]), model.init(jax.random.key(0))["blocks"])
    split = {  # GPT's block: leaf -> the axis Megatron splits it on (tiny: d 32, MLP 128)
        ("c_fc", "kernel"): 1,  # column-parallel MLP in
        ("c_proj_mlp", "kernel"): 0,  # row-parallel MLP out
        ("c_proj", "kernel"): 0,  # row-parallel attention out (heads x head_dim rows)
    }
    assert dict(layout.grouping.axes) == split
    host = jax.device_put(
        layout.flatten_np(block).reshape(-1, layout.page_elems), zero.sharded.slab_host
    )
    pages = zero.to_device(host, layout)
    P, G = layout.page_elems, layout.group
    for shard in pages.group.addressable_shards:
        m = list(zero.mesh.devices.flat).index(shard.device) % 2  # the model index
        got = np.asarray(shard.data).reshape(-1)
        assert got.size == G.num_pages * P  # one group: half the split weights
        for leaf in G.leaves:  # the slice in its own shape, row-major
            whole = block[leaf.path[0]][leaf.path[1]]
            mine = np.split(whole, 2, axis=split[leaf.path])[m]
            np.testing.assert_array_equal(got[leaf.offset : leaf.offset + leaf.size], mine.ravel())
    held = (layout.dense.num_pages + G.num_pages) * P
    assert held < layout.num_pages * P, (held, layout.num_pages * P)


# Each offload feature once refused under tensor parallelism (hetjax/support.py), at data x
# tensor = 2 x 2 (the composition: rows over data, each block's compute over model)
TP_FEATURES = {
    "keep": dict(offload=dict(keep_blocks=1)),
    "swap_host": dict(offload=dict(swap_blocks=1)),
    "swap_nvme": dict(offload=dict(swap_blocks=2, swap_tier="nvme")),
    "nvme_boundaries": dict(offload=dict(activations="nvme")),
    "lockfree": dict(optimizer=dict(mode="lockfree", max_staleness=0)),
    "batch_chunks": dict(offload=dict(batch_chunks=2)),
    "device_cache": dict(offload=dict(optimizer_device_stages=2)),
}


@pytest.mark.slow  # ~5-25 s each (2 cores)
@pytest.mark.parametrize("feature", list(TP_FEATURES))
def test_formerly_refused_features_under_tensor_parallelism_equal_single_device(
    references, tmp_path, feature, monkeypatch
):
    """Kept and swapped blocks (host and NVMe), boundaries on NVMe, lock-free mode
    (staleness 0: its updates are sync's), batch chunks and the device cache of
    optimizer state (embed's and block 0's updates on the device) at data x tensor = 2 x 2:
    losses, validation loss, every final param and the logits equal one device's
    (grad_accum 2) at 1e-5. Read ahead one block, so one swapped row (of the boundaries:
    block 0's) goes through the disk each step. A model group's devices hold the same
    rows: the swaps write them once per group, as many bytes as one device writes
    (its run with the feature, measured here)."""
    from hetjax import memory

    monkeypatch.setattr(memory, "IO_READAHEAD", 1)
    change = TP_FEATURES[feature]
    optimizer = {**SGD_CLIP, **change.get("optimizer", {})}
    offload = {**TIERS["host"], **change.get("offload", {})}
    config = tp_config(2, 2, optimizer=optimizer, offload=offload)
    result = train(config, tmp_path / "tp", verbose=False)
    assert_gpt_training_equal(result, references(2), build_model(config.model), check_tokens())
    if feature in ("nvme_boundaries", "swap_nvme"):  # through the disk, once per group:
        # one device's bytes. A swapped block's are its input and the activations its level
        # saves, never its pages (fetched again for backward): with the split weights'
        # pages one dense page went too, 16 KiB a data device (115,712 B a step against
        # 82,944; issue #42)
        one = config.replace(distributed=dict(data_parallel=1, tensor_parallel=1))
        single = train(one, tmp_path / "one", verbose=False)
        for r, s in zip(result.records, single.records, strict=True):
            assert r["nvme_write_bytes"] == r["nvme_read_bytes"] == s["nvme_write_bytes"] > 0
    if feature == "device_cache":  # embed and block 0: 8 pages of 4,096 each (16 KiB fp32),
        # updated once per step and again in each step whose update was redone (counted so
        # far). Pages by hand (parallel/groupings.py's layout at 2 x 2): a block's dense part, its
        # q|k|v kernel 32 x 96, biases 96 + 32 + 128 + 32 and norms 4 x 32 (3,488), is one
        # page padded to 4 (one a device); its split kernels, 32 x 128 + 32 x 32 + 128 x 32,
        # are 4,608 a model index, 2 pages (a multiple of the 2 data devices), so 4; the
        # embedding: positions 32 x 32 dense (1 page, padded to 4), the vocabulary's 256 x 32
        # split, 4,096 a model index (1 page, padded to 2), so 4.
        updated = sum(r["optimizer_device_params"] for r in result.records)
        redone = result.records[-1]["optimizer_redo"]
        assert updated == 2 * 8 * 4096 * (len(result.records) + redone)


def test_tensor_parallel_refusals_name_the_key():
    """A tensor-parallel degree below 1 is refused at start-up, naming the key (nothing
    one device supports is refused under tensor parallelism: hetjax/support.py; a split
    the mesh does not divide: tests/test_in_memory_tensor.py)."""
    with pytest.raises(ConfigError, match=r"'distributed.tensor_parallel'.*must be >= 1"):
        tiny_config(distributed=dict(tensor_parallel=0))


@pytest.mark.slow  # two child processes compiling everything: ~90 s on 2 cores
def test_two_processes_of_two_devices_at_2x2_equal_one_process(references, tmp_path):
    """Data x tensor = 2 x 2 over 2 real processes x 2 CPU devices (each process one
    model group, its devices splitting the blocks' compute): losses, validation loss and
    every final param equal one device's with grad_accum 2 at 1e-5."""
    from test_zero import SGD_ARGS, _params_like, _run_two_processes

    saved = _run_two_processes(tmp_path, *SGD_ARGS, "distributed.tensor_parallel=2")
    reference = references(2)
    np.testing.assert_allclose(saved["losses"], reference.losses, rtol=1e-5)
    np.testing.assert_allclose(saved["val_loss"], reference.val_loss, rtol=1e-5)
    params = _params_like(saved, reference.params)
    assert_trees_close(without_key_bias(params), without_key_bias(reference.params))


NVME = ("offload.optimizer=nvme", "offload.params=nvme")


@pytest.mark.slow  # a 2-process run and a 1-process run: ~2 min on 2 cores, more under load
def test_checkpoint_of_two_processes_at_2x2_resumes_in_one_at_1x4(references, tmp_path):
    """With params and optimizer state on NVMe, a checkpoint written at data x tensor 2 x
    2 by 2 processes x 2 devices resumes in 1 process at 1 x 4, ending where the
    single-device run does."""
    from test_zero import SGD_ARGS, _run_two_processes

    two, one = tmp_path / "two", tmp_path / "one"
    ckpt = f"checkpoint.dir={two / 'ckpt'}"
    tp2 = "distributed.tensor_parallel=2"
    _run_two_processes(
        two, *SGD_ARGS, *NVME, tp2, ckpt, "checkpoint.at_end=true", "train.steps=3", timeout=480
    )
    shutil.copytree(two / "ckpt", one / "checkpoints")
    config = tp_config(
        1, 4, "nvme", memory=dict(PAGES, nvme_path=str(one / "nvme")), checkpoint=dict(at_end=True)
    )
    resumed = train(config, one, verbose=False)
    reference = references(2)
    np.testing.assert_allclose(resumed.losses, reference.losses[3:], rtol=1e-5)
    assert_trees_close(without_key_bias(resumed.params), without_key_bias(reference.params))


@pytest.mark.slow  # a 1-process run and a 2-process run: ~2 min on 2 cores, more under load
def test_checkpoint_of_one_process_at_2x2_resumes_in_two(references, tmp_path):
    """With params and optimizer state on NVMe, a checkpoint written at data x tensor 2 x
    2 by one process resumes in 2 processes x 2 devices at 2 x 2 (each process one model
    group), ending where the single-device run does."""
    from test_zero import SGD_ARGS, _params_like, _run_two_processes

    first = tp_config(2, 2, "nvme", train=dict(steps=3), checkpoint=dict(at_end=True))
    train(first, tmp_path / "first", verbose=False)
    back = tmp_path / "back"
    shutil.copytree(tmp_path / "first" / "checkpoints", back / "ckpt")
    ckpt = f"checkpoint.dir={back / 'ckpt'}"
    tp2 = "distributed.tensor_parallel=2"
    saved = _run_two_processes(
        back, *SGD_ARGS, *NVME, tp2, ckpt, "checkpoint.at_end=true", timeout=480
    )
    reference = references(2)
    np.testing.assert_allclose(saved["losses"], reference.losses[3:], rtol=1e-5)
    params = _params_like(saved, reference.params)
    assert_trees_close(without_key_bias(params), without_key_bias(reference.params))


@pytest.mark.slow  # four runs: ~60 s
def test_checkpoint_at_2x2_resumes_at_other_degrees(references, tmp_path):
    """A checkpoint written at data x tensor = 2 x 2 with state on NVMe resumes at 1 x 1,
    4 x 1 and 1 x 4 (its pages are whole leaves, split over the devices only as
    ZeRO-3's shards), each ending where the single-device run does."""
    ckpt = tmp_path / "ckpt"
    save = dict(dir=str(ckpt), at_end=True)
    first = tp_config(2, 2, "nvme", train=dict(steps=3), checkpoint=save)
    train(first, tmp_path / "first", verbose=False)
    reference = references(2)
    for data, tensor in [(1, 1), (4, 1), (1, 4)]:
        leg = tmp_path / f"{data}x{tensor}"
        shutil.copytree(ckpt, leg / "checkpoints")
        config = tp_config(
            data, tensor, "nvme",
            memory=dict(PAGES, nvme_path=str(leg / "nvme")),
            checkpoint=dict(at_end=True),
        )  # fmt: skip
        resumed = train(config, leg, verbose=False)
        np.testing.assert_allclose(resumed.losses, reference.losses[3:], rtol=1e-5)
        assert_trees_close(without_key_bias(resumed.params), without_key_bias(reference.params))
