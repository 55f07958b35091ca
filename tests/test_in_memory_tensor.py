"""``offload.mode=none`` under tensor and expert parallelism (``runtime/in_memory.py``,
``parallel/in_memory.py``): params and optimizer state split by the streaming
runtime's logical-axis rules, over the ``model`` axis as Megatron splits them (GPT's
MLP by its hidden units, attention's output projection by heads, the vocabulary) or a
mixture of experts' experts over the ``expert`` axis, whole over ``data``; the rows
split over the data axes; one jitted step with gradient accumulation, XLA's partitioner
adding the collectives. It trains as one device does on the same global batch (the
same sums, over devices in another order, rounding as float32 does, ~1e-7: SGD, and
AdamW against its matching reference, compare at the usual 1e-5), and its checkpoints
move to and from one device.

The expected shard shapes are the tiny models' (conftest.tiny_config: L 2, D 32, F 4D
= 128, V 256; test_split.MOE: E 4 experts of D 32 x F 48) halved on the split axis, by
hand."""

import shutil

import jax
import numpy as np
import pytest
from equivalence import (
    assert_gpt_training_equal,
    assert_losses_close,
    assert_training_equal,
    assert_trees_close,
    check_tokens,
    training_batches,
)
from test_adamw_mesh import ADAMW
from test_split import MOE
from test_tensor import LLAMA
from test_zero import SGD_CLIP

from hetjax.config import ConfigError
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.train import train
from models import build_model

NONE = dict(mode="none")
ACCUM = dict(grad_accum=2)  # two micro-batches a step: the accumulation under the split
TP2 = dict(tensor_parallel=2)
TP2_DP2 = dict(tensor_parallel=2, data_parallel=2)
# a mixture of experts' rows split over data x expert devices (4): 8 rows a step, in two
# micro-batches of 4
MOE_TRAIN = dict(ACCUM, batch_size=8)


def _config(tiny, optimizer=SGD_CLIP, distributed=None, train=ACCUM, **sections):
    config = tiny(optimizer=optimizer, offload=NONE, train=train, **sections)
    return config.replace(distributed=distributed) if distributed else config


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    from conftest import tiny_config

    return train(_config(tiny_config), tmp_path_factory.mktemp("one"), verbose=False)


def assert_split(leaf, shard_shape: tuple, copies: int) -> None:
    """``leaf``'s every shard has ``shard_shape`` and each distinct shard is held by
    ``copies`` devices (the data axis's)."""
    shards = leaf.addressable_shards
    assert {s.data.shape for s in shards} == {shard_shape}, (leaf.shape, leaf.sharding)
    distinct = {tuple((i.start, i.stop) for i in s.index) for s in shards}
    assert len(shards) == copies * len(distinct), (len(shards), distinct)


def assert_gpt_split(runtime: InMemoryRuntime, copies: int) -> None:
    """GPT's MLP (D, F) and (F, D) kernels and its embedding (V, D) split in two over the
    model axis, in the params and in the optimizer state that mirrors them."""
    params = runtime.state.params
    expected = {
        (2, 32, 128): (2, 32, 64),  # blocks' c_fc kernel, split by hidden units
        (2, 128, 32): (2, 64, 32),  # blocks' c_proj_mlp kernel
        (256, 32): (128, 32),  # the token embedding, by vocabulary
    }
    leaves = [params["blocks"]["c_fc"]["kernel"], params["blocks"]["c_proj_mlp"]["kernel"]]
    for leaf in [*leaves, params["embed"]["wte"]]:
        assert_split(leaf, expected[leaf.shape], copies)
    moments = [a for a in jax.tree.leaves(runtime.state.opt_state) if a.shape in expected]
    assert moments  # SGD's momentum trace, AdamW's mu and nu
    for leaf in moments:
        assert_split(leaf, expected[leaf.shape], copies)


@pytest.mark.slow  # ~15 s each: two runs' compiles on 2 cores
@pytest.mark.parametrize("distributed", [TP2, TP2_DP2], ids=["tp2", "tp2_dp2"])
@pytest.mark.guards(tier="device", parallel="tensor")
def test_tensor_parallel_in_memory_equals_one_device(one_device, tiny, tmp_path, distributed):
    """Losses, validation loss, every final param and the logits equal one device's at
    1e-5 (SGD); the params and the momentum are split in two over the model axis (on
    each of the data axis's devices), before and after a step."""
    config = _config(tiny, distributed=distributed)
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, one_device, build_model(config.model), check_tokens())
    runtime = InMemoryRuntime(config)
    copies = distributed.get("data_parallel", 1)
    assert_gpt_split(runtime, copies)
    runtime.train_step(training_batches(config, 1)[0])
    assert_gpt_split(runtime, copies)


@pytest.mark.slow  # ~20 s: two runs' compiles on 2 cores
def test_tensor_parallel_in_memory_adamw_trains_as_one_device(tiny, tmp_path):
    """AdamW at TP2 x DP2, against the matching reference (tests/test_adamw_mesh.py's:
    eps 1e-3, so that its first steps do not turn the float32 rounding of another
    summation order into differences of ~5e-5, as eps 1e-8 does here, measured at GPT's
    ``blocks.c_fc.bias``), on Llama as there (GPT's row-parallel bias reaches 7.3e-6 of
    its largest element even so: that module's docstring): losses, validation loss,
    every param and the final logits equal one device's at 1e-5; GPT's moments are
    split as its params."""
    llama = dict(model=LLAMA)
    one = train(_config(tiny, ADAMW, **llama), tmp_path / "one", verbose=False)
    result = train(_config(tiny, ADAMW, TP2_DP2, **llama), tmp_path / "tp", verbose=False)
    model = build_model(_config(tiny, **llama).model)
    assert_training_equal(result, one, model, check_tokens())
    config = _config(tiny, ADAMW, TP2_DP2)
    assert_gpt_split(InMemoryRuntime(config), copies=2)


@pytest.mark.slow  # ~15 s
def test_a_tensor_parallel_checkpoint_resumes_on_one_device(one_device, tiny, tmp_path):
    """Stopped at step 3 at TP2 x DP2, resumed on one device: the rest of the run (its
    losses, validation loss and final params) equals the uninterrupted one-device run's."""
    ckpt = dict(every_steps=0, at_end=True)
    cut = _config(tiny, distributed=TP2_DP2, checkpoint=ckpt)
    train(cut.replace(train=dict(steps=3)), tmp_path, verbose=False)
    rest = train(_config(tiny, checkpoint=ckpt), tmp_path, verbose=False)
    assert_losses_close(rest.losses, one_device.losses[3:])
    assert_losses_close([rest.val_loss], [one_device.val_loss])
    assert_trees_close(rest.params, one_device.params)


@pytest.mark.slow  # ~15 s
def test_a_one_device_checkpoint_resumes_under_tensor_parallelism(one_device, tiny, tmp_path):
    """Stopped at step 3 on one device, resumed at TP2: the rest of the run equals the
    uninterrupted one-device run's; a one-device state loaded at TP2 x DP2 is split over
    the model axis and saves back the same state."""
    ckpt = dict(every_steps=0, at_end=True)
    cut = _config(tiny, checkpoint=ckpt)
    train(cut.replace(train=dict(steps=3)), tmp_path, verbose=False)
    rest = train(_config(tiny, distributed=TP2, checkpoint=ckpt), tmp_path, verbose=False)
    assert_losses_close(rest.losses, one_device.losses[3:])
    assert_losses_close([rest.val_loss], [one_device.val_loss])
    assert_trees_close(rest.params, one_device.params)

    one = InMemoryRuntime(_config(tiny))
    one.train_step(training_batches(one.config, 1)[0])  # a momentum that is not zero
    saved = one.save_state()
    split = InMemoryRuntime(_config(tiny, distributed=TP2_DP2))
    split.load_state(saved)
    assert_gpt_split(split, copies=2)
    again = split.save_state()
    assert sorted(again.kinds) == sorted(saved.kinds)
    jax.tree.map(np.testing.assert_array_equal, again.stages, saved.stages)


@pytest.mark.slow  # ~60 s: two child processes compile everything anew
def test_two_processes_at_tp2_dp2_in_memory_equal_one_device(one_device, tmp_path):
    """2 processes x 2 CPU devices over gloo, offload.mode=none at data x model 2 x 2
    (each process one model group, its devices splitting the state and the compute, each
    passing its own rows): losses, validation loss and every final param (gathered
    whole from both processes) equal one device's at 1e-5."""
    from test_zero import SGD_ARGS, _params_like, _run_two_processes

    tensor = ("offload.mode=none", "distributed.tensor_parallel=2", "train.grad_accum=2")
    saved = _run_two_processes(tmp_path, *SGD_ARGS, *tensor)
    assert_losses_close(saved["losses"], one_device.losses)
    assert_losses_close([saved["val_loss"]], [one_device.val_loss])
    assert_trees_close(_params_like(saved, one_device.params), one_device.params)


@pytest.mark.slow  # ~10 s
def test_int8_moments_split_their_codes_and_round_trip(tiny):
    """With ``optimizer.state_dtype=int8`` at TP2 x DP2, AdamW's moments' codes are split
    as the params (their block scales whole on every device), and a saved state loads
    back and saves the same."""
    from hetjax.optimizer.moments import Int8Blocks

    config = _config(tiny, dict(ADAMW, state_dtype="int8"), TP2_DP2)
    runtime = InMemoryRuntime(config)
    runtime.train_step(training_batches(config, 1)[0])
    is_blocks = lambda x: isinstance(x, Int8Blocks)
    leaves = jax.tree.leaves(runtime.state.opt_state, is_leaf=is_blocks)
    fc = [m for m in leaves if is_blocks(m) and m.codes.shape == (2, 32, 128)]
    assert len(fc) == 2  # mu and nu of blocks.c_fc.kernel
    for m in fc:
        assert_split(m.codes, (2, 32, 64), copies=2)
        assert m.scales.sharding.is_fully_replicated
    saved = runtime.save_state()
    again = InMemoryRuntime(config)
    again.load_state(saved)
    jax.tree.map(np.testing.assert_array_equal, again.save_state().stages, saved.stages)


@pytest.fixture(scope="module")
def moe_one_device(tmp_path_factory):
    from conftest import tiny_config

    config = _config(tiny_config, model=MOE, train=MOE_TRAIN)
    return train(config, tmp_path_factory.mktemp("moe"), verbose=False)


@pytest.mark.slow  # ~12 s each
@pytest.mark.parametrize(
    "distributed",
    [dict(expert_parallel=2, data_parallel=2), dict(expert_parallel=2, tensor_parallel=2)],
    ids=["ep2_dp2", "ep2_tp2"],
)
@pytest.mark.guards(tier="device", parallel="expert", ids="ep2_dp2")
@pytest.mark.guards(tier="device", parallel="tensor_expert", ids="ep2_tp2")
def test_expert_parallel_in_memory_equals_one_device(moe_one_device, tiny, tmp_path, distributed):
    """A mixture of experts (4 experts, top 2, SGD) with its experts split over the
    expert axis (and under tensor parallelism their hidden units over the model axis):
    losses, validation loss, every final param and the logits equal one device's at
    1e-5; each device holds 2 of the 4 experts of each block."""
    config = _config(tiny, model=MOE, distributed=distributed, train=MOE_TRAIN)
    result = train(config, tmp_path, verbose=False)
    model = build_model(config.model)
    assert_training_equal(result, moe_one_device, model, check_tokens())
    moe = InMemoryRuntime(config).state.params["blocks"]["moe"]
    F = 48 // distributed.get("tensor_parallel", 1)  # (L, E, D, F) -> (L, E/2, D, F/M)
    copies = distributed.get("data_parallel", 1)
    assert_split(moe["gate_proj"], (2, 2, 32, F), copies)
    assert_split(moe["down_proj"], (2, 2, F, 32), copies)


@pytest.mark.slow  # ~60 s: two child processes compile everything anew
def test_two_processes_at_ep4_in_memory_checkpoint_and_resume_on_one_device(
    moe_one_device, tiny, tmp_path
):
    """2 processes x 2 CPU devices, offload.mode=none with the 4 experts split over the
    4 devices (each process holds 2 experts of each block, so the state is gathered
    across processes to be saved): 3 steps equal one device's, and one device resumes
    their checkpoint: the rest of the run (losses, validation loss, every final param)
    equals the uninterrupted one-device run's at 1e-5."""
    from test_zero import SGD_ARGS, _run_two_processes

    value = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    moe = [f"model.{k}={value(v)}" for k, v in MOE.items()]
    ckpt = tmp_path / "ckpt"
    run = ("offload.mode=none", "distributed.expert_parallel=4", "train.grad_accum=2")
    cut = (f"checkpoint.dir={ckpt}", "checkpoint.at_end=true", "train.steps=3")
    saved = _run_two_processes(tmp_path, *SGD_ARGS, *moe, *run, "train.batch_size=8", *cut)
    assert_losses_close(saved["losses"], moe_one_device.losses[:3])
    shutil.copytree(ckpt, tmp_path / "one" / "checkpoints")
    config = _config(tiny, model=MOE, train=MOE_TRAIN, checkpoint=dict(at_end=True))
    rest = train(config, tmp_path / "one", verbose=False)
    assert_losses_close(rest.losses, moe_one_device.losses[3:])
    assert_losses_close([rest.val_loss], [moe_one_device.val_loss])
    assert_trees_close(rest.params, moe_one_device.params)


def test_a_split_the_mesh_does_not_divide_is_refused_naming_the_key(tiny):
    """A vocabulary of 255 rows cannot split in two over the model axis: the runtime
    stops at start-up naming the key and the param, instead of splitting it unevenly."""
    config = _config(tiny, model=dict(vocab_size=255), distributed=TP2)
    with pytest.raises(ConfigError, match=r"'distributed.tensor_parallel' \(2\).*'wte'.*\(255\)"):
        InMemoryRuntime(config)
