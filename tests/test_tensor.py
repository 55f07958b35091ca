"""Tensor parallelism (``distributed.tensor_parallel``, hetjax/runtime/zero.py): each
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
from hetjax.runtime.grouped import GroupPages
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.runtime.zero import Zero3
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
def references(tmp_path_factory):
    """One device, ``grad_accum`` micro-batches (the data-parallel degree), per model."""
    runs = {}

    def reference(accum: int, model: dict | None = None):
        key = (accum, json.dumps(model, sort_keys=True))
        if key not in runs:
            config = tiny_config(optimizer=SGD_CLIP, train=dict(grad_accum=accum))
            if model:
                config = config.replace(model=model)
            runs[key] = train(config, tmp_path_factory.mktemp("ref"), verbose=False)
        return runs[key]

    return reference


def tp_config(data_parallel: int, tensor: int, tier: str = "host", **sections):
    """The tiny GPT on data x tensor devices (``sections`` replace the defaults here)."""
    defaults = dict(optimizer=SGD_CLIP, offload=TIERS[tier], memory=PAGES)
    return tiny_config(
        **{**defaults, **sections},
        distributed=dict(data_parallel=data_parallel, tensor_parallel=tensor),
    )


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
def test_tensor_parallel_equals_single_device(references, tmp_path, data, tensor, tier):
    """GPT: losses, validation loss, every final param and the logits equal one
    device's (grad_accum = the data degree) at 1e-5, with params and optimizer state
    in RAM or streamed from NVMe; every device stores 1/(data x tensor) of the pages."""
    config = tp_config(data, tensor, tier)
    result = train(config, tmp_path, verbose=False)
    reference = references(data)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    last = result.records[-1]
    assert last["all_gather_bytes"] > 0 and last["reduce_scatter_bytes"] > 0
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
    router whole; every expert copied, the routed fallback) and T5 (an encoder and a
    decoder group, relative position buckets whole) at tensor 2 equal one device's
    streaming run."""
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


def _block_backward_hlo(config) -> str:
    runtime = StreamingRuntime(config, placement=Zero3(config))
    try:
        B, sds = runtime.layouts["block"], jax.ShapeDtypeStruct
        zero, t = runtime.placement, config.train
        pages = zero.device_pages(B, np.float32)  # as the gather hands them over
        x = sds((t.micro_batch_size, t.seq_len, config.model.d_model), np.float32,
                sharding=zero.sharded.batch)  # fmt: skip
        return runtime.fns.block_bwd.lower(pages, x, x).compile().as_text()
    finally:
        runtime.close()


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
    if feature == "nvme_boundaries":  # through the disk, once per group: one device's bytes
        one = config.replace(distributed=dict(data_parallel=1, tensor_parallel=1))
        single = train(one, tmp_path / "one", verbose=False)
        for r, s in zip(result.records, single.records, strict=True):
            assert r["nvme_write_bytes"] == r["nvme_read_bytes"] == s["nvme_write_bytes"] > 0
    if feature == "swap_nvme":  # through the disk and back. Not one device's bytes since
        # the split weights' pages: a swapped block's residuals are then its pages, with
        # their padding (115,712 B a step against one device's leaves' 82,944; issue #42)
        assert all(r["nvme_write_bytes"] == r["nvme_read_bytes"] > 0 for r in result.records)
    if feature == "device_cache":  # embed and block 0: 8 pages of 4,096 each (16 KiB fp32),
        # updated once per step and again in each step whose update was redone (counted so
        # far). Pages by hand (runtime/tensor.py's layout at 2 x 2): a block's dense part, its
        # q|k|v kernel 32 x 96, biases 96 + 32 + 128 + 32 and norms 4 x 32 (3,488), is one
        # page padded to 4 (one a device); its split kernels, 32 x 128 + 32 x 32 + 128 x 32,
        # are 4,608 a model index, 2 pages (a multiple of the 2 data devices), so 4; the
        # embedding: positions 32 x 32 dense (1 page, padded to 4), the vocabulary's 256 x 32
        # split, 4,096 a model index (1 page, padded to 2), so 4.
        updated = sum(r["optimizer_device_params"] for r in result.records)
        redone = result.records[-1]["optimizer_redo"]
        assert updated == 2 * 8 * 4096 * (len(result.records) + redone)


def test_tensor_parallel_refusals_name_the_key():
    """What tensor parallelism does not support yet is refused at start-up, naming the
    key and the fix (hetjax/support.py)."""
    with pytest.raises(ConfigError, match=r"'distributed.tensor_parallel' \(2\).*expert"):
        tiny_config(distributed=dict(tensor_parallel=2, expert_parallel=2))
    with pytest.raises(ConfigError, match=r"'distributed.tensor_parallel'.*must be >= 1"):
        tiny_config(distributed=dict(tensor_parallel=0))
    with pytest.raises(ConfigError, match=r"'distributed.tensor_parallel' \(2\).*stream"):
        tiny_config(offload=dict(mode="none"), distributed=dict(tensor_parallel=2))


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
