"""``offload.mode=none`` under data parallelism (``runtime/in_memory.py``): the state
replicated on every device, a micro-batch's rows split over them, XLA's all-reduce
summing the gradients in the one jitted step. It trains as one device does on the same
global batch (the same mean over the same rows; the sum over devices rounds as float32
does, ~1e-7, so SGD compares at the usual tolerance: tests/test_zero.py's docstring),
and its checkpoints move to and from one device."""

import shutil

import jax
import numpy as np
import pytest
from equivalence import assert_gpt_training_equal, check_tokens
from test_zero import SGD_CLIP

from hetjax import support
from hetjax.train import train
from models import build_model

NONE = dict(mode="none")


@pytest.fixture(scope="module")
def one_device(reference_run):
    from conftest import tiny_config

    return reference_run(tiny_config(optimizer=SGD_CLIP, offload=NONE))


@pytest.mark.guards(tier="device", parallel="data")
def test_data_parallel_in_memory_equals_one_device(one_device, tiny, tmp_path):
    """4 devices: losses, validation loss, every final param and the logits equal one
    device's at 1e-5; the params are replicated on the 4 devices of the mesh."""
    from hetjax.runtime.in_memory import InMemoryRuntime

    config = tiny(optimizer=SGD_CLIP, offload=NONE, distributed=dict(data_parallel=4))
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, one_device, build_model(config.model), check_tokens())
    runtime = InMemoryRuntime(config)
    leaf = jax.tree.leaves(runtime.state.params)[0]
    assert len(leaf.sharding.device_set) == 4 and leaf.sharding.is_fully_replicated


@pytest.mark.slow  # ~10 s
def test_a_data_parallel_checkpoint_resumes_on_one_device(one_device, tiny, tmp_path):
    """Stopped at step 3 at data_parallel=2, resumed on one device: the rest of the run
    equals the uninterrupted one-device run's."""
    ckpt = dict(every_steps=0, at_end=True)
    cut = tiny(optimizer=SGD_CLIP, offload=NONE, distributed=dict(data_parallel=2))
    train(cut.replace(train=dict(steps=3), checkpoint=ckpt), tmp_path, verbose=False)
    rest = train(tiny(optimizer=SGD_CLIP, offload=NONE, checkpoint=ckpt), tmp_path, verbose=False)
    np.testing.assert_allclose(rest.losses, one_device.losses[3:], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        rest.params,
        one_device.params,
    )


def test_in_memory_builds_under_every_parallelism_and_is_planned_but_with_experts_split():
    """The matrix refuses in-memory training under no parallelism (expert and tensor
    parallelism: tests/test_in_memory_tensor.py), and the planner offers it on one
    device and under data and tensor parallelism (a device's share of the state:
    tests/test_in_memory_plan.py), not where experts split over devices (their exchange
    is not priced)."""
    from conftest import tiny_config
    from test_split import MOE

    experts = {support.EXPERT, support.TENSOR_EXPERT}
    for p in support.PARALLELISMS:
        assert support.supports("in_memory", p) is None
        assert (support.planned("in_memory", p) is None) == (p not in experts), p
    tiny_config(offload=NONE, distributed=dict(tensor_parallel=2, data_parallel=2))
    tiny_config(model=MOE, offload=NONE, distributed=dict(expert_parallel=2, tensor_parallel=2))


@pytest.mark.slow  # ~50 s: two child processes compile everything anew
def test_two_processes_in_memory_train_like_one_device_and_resume_on_one(
    one_device, tiny, tmp_path
):
    """2 processes x 2 CPU devices over gloo, each passing its own rows, train 3 steps
    as one device does and checkpoint (each process writes the replicated state, whole);
    one device resumes it: the losses, validation loss and every final param equal the
    uninterrupted one-device run's."""
    from test_zero import SGD_ARGS, _run_two_processes

    ckpt = tmp_path / "ckpt"
    cut = ("offload.mode=none", f"checkpoint.dir={ckpt}", "checkpoint.at_end=true")
    saved = _run_two_processes(tmp_path, *SGD_ARGS, *cut, "train.steps=3")
    np.testing.assert_allclose(saved["losses"], one_device.losses[:3], rtol=1e-5)
    shutil.copytree(ckpt, tmp_path / "one" / "checkpoints")
    config = tiny(optimizer=SGD_CLIP, offload=NONE, checkpoint=dict(at_end=True))
    rest = train(config, tmp_path / "one", verbose=False)
    np.testing.assert_allclose(rest.losses, one_device.losses[3:], rtol=1e-5)
    np.testing.assert_allclose(rest.val_loss, one_device.val_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        rest.params,
        one_device.params,
    )
