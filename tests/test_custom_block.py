"""A user-defined Flax block (tests/user_blocks.py) plugged in with model.family=custom:
it trains, and offload.mode=stream equals offload.mode=none (its last block keeping its
matmul outputs: offload.keep_level=matmuls needs no tags in the block)."""

import jax
import numpy as np
import pytest
from equivalence import assert_training_equal

from hetjax.config import ConfigError
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from models import FlaxStages, build_model

CUSTOM = dict(family="custom", custom="user_blocks:make_model")


def test_custom_model_is_built_from_the_factory(tiny):
    model = build_model(tiny(model=CUSTOM).model)
    assert isinstance(model, FlaxStages)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    assert shapes["blocks"]["q"]["kernel"].shape == (2, 32, 32)  # stacked on L
    assert shapes["head"]["out"]["kernel"].shape == (32, 256)


@pytest.mark.slow
def test_custom_block_stream_equals_none(tiny, tmp_path):
    short = dict(steps=4, eval_batches=1)  # the validation loss is compared too
    ref = train(tiny(model=CUSTOM, train=short), tmp_path / "ref", verbose=False)
    offload = dict(mode="stream", prefetch_depth=1, keep_blocks=1, keep_level="matmuls")
    config = tiny(model=CUSTOM, train=short, offload=offload)
    result = train(config, tmp_path / "stream", verbose=False)
    assert ref.losses[-1] < ref.losses[0]
    tokens = np.random.default_rng(7).integers(0, 256, (2, 16)).astype(np.int32)
    assert_training_equal(result, ref, build_model(config.model), tokens)


def test_custom_block_without_tags_cannot_keep_probs(tiny):
    offload = dict(mode="stream", keep_blocks=1, keep_level="probs")
    with pytest.raises(ConfigError, match=r"supports only matmuls, all.*'attn_probs'"):
        StreamingRuntime(tiny(model=CUSTOM, offload=offload))


@pytest.mark.parametrize(
    "custom, message",
    [
        ("no_such_module:make", "cannot import module 'no_such_module'"),
        ("user_blocks:missing", "has no function 'missing'"),
        ("user_blocks:Embed", "lacks"),
    ],
)
def test_custom_errors(tiny, custom, message):
    with pytest.raises(ConfigError, match=message):
        build_model(tiny(model=dict(family="custom", custom=custom)).model)
