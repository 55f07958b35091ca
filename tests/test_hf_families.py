"""The Llama-shaped families beyond Llama and Mixtral, against transformers at fp32:
Qwen2/Qwen2.5 (q/k/v biases; tied here, as its small sizes are), Qwen3 (q/k RMSNorms
per head) and Mistral (a sliding window longer than the sequences). Each imports with
transformers' logits, takes an SGD step with transformers' losses, generates
transformers' greedy tokens, and exports back to a checkpoint transformers loads with
the same logits, before and after hetjax trained it; Qwen2 also streamed with its
params and optimizer state on NVMe, Qwen3 generating from params on NVMe. The default
run imports and exports each family; training and generation are ``-m slow``."""

import copy
import dataclasses

import jax
import numpy as np
import pytest
from hf_models import build_hf_model, hf_logits, hf_sgd_losses
from test_generate import hf_greedy

from hetjax.config import Config, ConfigError, load_config
from hetjax.export import export_hf, hf_config_json
from hetjax.hf import check_model_config, hf_model_fields, model_config_from_hf, open_checkpoint
from hetjax.inference import generate, open_blocks
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from models import build_model

FAMILIES = ["qwen2", "qwen3", "mistral"]
SGD = dict(name="sgd", momentum=0.0, lr=0.5, grad_clip=0.0, warmup_steps=0, schedule="constant")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its save_pretrained directory), built when first
    asked for."""
    built = {}

    def get(family):
        if family not in built:
            model = build_hf_model(family, tied=family == "qwen2")
            directory = tmp_path_factory.mktemp(family)
            model.save_pretrained(directory)
            built[family] = (model, directory)
        return built[family]

    return get


def _config(tiny, directory, **sections):
    model = model_config_from_hf(directory, tiny().model)
    return tiny(model=dataclasses.asdict(model), **sections)


def _tokens(shape=(2, 17), seed=3):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


def _assert_loads_in_transformers(config, params, out, expected_logits, tokens):
    """``params`` exported to ``out``: transformers loads the family's class with
    ``expected_logits``, and hetjax imports the same config and params back."""
    from transformers import AutoModelForCausalLM

    export_hf(config, params, out)
    loaded = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(loaded).__name__ == hf_config_json(config)["architectures"][0]
    np.testing.assert_allclose(hf_logits(loaded, tokens), expected_logits, rtol=0, atol=1e-5)
    again = model_config_from_hf(out, config)
    assert dataclasses.replace(again, init_from="") == dataclasses.replace(config, init_from="")
    jax.tree.map(np.testing.assert_array_equal, open_checkpoint(again).params(), params)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_equal_transformers(checkpoints, tiny, tmp_path, family):
    hf_model, directory = checkpoints(family)
    config = _config(tiny, directory)
    options = {k: getattr(config.model, k) for k in ("qkv_bias", "qk_norm", "sliding_window")}
    assert options == dict(
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=4096 * (family == "mistral"),
    )
    params = open_checkpoint(config.model).params()
    tokens = _tokens((2, 24))
    theirs = hf_logits(hf_model, tokens)
    ours = np.asarray(jax.jit(build_model(config.model).logits)(params, tokens))
    assert np.abs(theirs).max() > 1.0  # logits of a useful size
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    _assert_loads_in_transformers(config.model, params, tmp_path / "out", theirs, tokens)


def _sgd_step_then_export(runtime, hf_model, config, out):
    """One SGD step on both sides: losses before and after equal transformers' (1e-5
    relative); the trained params, exported, load in transformers with the logits of
    transformers' own trained model."""
    batch = _tokens((2, 17))
    loss = runtime.train_step(batch[None]).loss
    after = runtime.eval_loss(batch)
    trained = copy.deepcopy(hf_model)
    torch_loss, torch_after = hf_sgd_losses(trained, batch, SGD["lr"])
    assert after < loss - 0.01  # the step did something
    np.testing.assert_allclose([loss, after], [torch_loss, torch_after], rtol=1e-5)
    tokens = _tokens((2, 24), seed=4)
    params = jax.tree.map(np.asarray, runtime.params())
    _assert_loads_in_transformers(config.model, params, out, hf_logits(trained, tokens), tokens)


@pytest.mark.slow  # ~10-25 s each on a loaded machine (the training step's compile)
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_sgd_step_equals_transformers_and_exports(checkpoints, tiny, tmp_path, family):
    hf_model, directory = checkpoints(family)
    config = _config(tiny, directory, optimizer=SGD)
    _sgd_step_then_export(InMemoryRuntime(config), hf_model, config, tmp_path / "trained")


@pytest.mark.slow  # ~15 s: the streaming runtime's compiles
def test_qwen2_streamed_with_nvme_state_equals_transformers(checkpoints, tiny, tmp_path):
    """Qwen2 (tied, q/k/v biases) imported stage by stage onto NVMe (params and
    optimizer state): the SGD step's losses are transformers', and the trained model
    exports to one transformers loads with its trained logits."""
    hf_model, directory = checkpoints("qwen2")
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    config = _config(tiny, directory, optimizer=SGD, offload=offload)
    runtime = StreamingRuntime(config, workdir=tmp_path)
    try:
        _sgd_step_then_export(runtime, hf_model, config, tmp_path / "trained")
    finally:
        runtime.close()


@pytest.mark.slow  # ~10-15 s each: the prefill's and the decoding step's compiles
@pytest.mark.parametrize(
    "family, offload",
    [
        ("qwen2", dict(mode="none")),
        ("qwen3", dict(mode="stream", params="nvme")),
        ("mistral", dict(mode="none")),
    ],
)
def test_greedy_equals_transformers(checkpoints, tiny, tmp_path, family, offload):
    hf_model, directory = checkpoints(family)
    prompts = np.random.default_rng(5).integers(0, 256, (2, 7)).tolist()
    blocks, _ = open_blocks(_config(tiny, directory, offload=offload), scratch=tmp_path)
    try:
        assert generate(blocks, prompts, 12) == hf_greedy(hf_model, prompts, 12)
    finally:
        if hasattr(blocks, "runtime"):
            blocks.runtime.close()


# -- config.json: defaults, windows, what is refused --------------------------------------

SHAPE = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=16, intermediate_size=96,
    vocab_size=300,
)  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_fields_config_json_leaves_out_are_transformers_defaults(model_type):
    """A config.json with only the shape fields reads as transformers' full config of
    the model type (its key/value heads, norm epsilon, rope theta, Mistral's window of
    4096; Qwen3's default head_dim is 128, given here as hidden / heads)."""
    import transformers

    classes = dict(qwen2="Qwen2Config", qwen3="Qwen3Config", mistral="MistralConfig")
    shape = dict(SHAPE, hidden_size=16 * 128) if model_type == "qwen3" else SHAPE
    full = getattr(transformers, classes[model_type])(**shape).to_dict()
    assert hf_model_fields({"model_type": model_type, **shape}) == hf_model_fields(full)


def test_qwen_sliding_window_applies_only_when_used():
    qwen = dict(model_type="qwen2", **SHAPE, sliding_window=32)
    assert hf_model_fields(qwen)["sliding_window"] == 0  # use_sliding_window: false
    assert hf_model_fields({**qwen, "use_sliding_window": True})["sliding_window"] == 32


def test_sequence_longer_than_the_window_is_refused(tiny):
    model = dict(family="llama", sliding_window=16)
    assert tiny(model=model, train=dict(seq_len=16)).model.sliding_window == 16
    with pytest.raises(ConfigError, match=r"train.seq_len' \(17\) exceeds 'model.sliding_window"):
        Config().replace(model=model, train=dict(seq_len=17))


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(model_type="qwen3", attention_bias=True), "attention_bias = True is not supported"),
        (dict(model_type="qwen3", head_dim=32), "head_dim = 32 is not supported"),
        (dict(model_type="mistral", hidden_act="gelu"), "hidden_act = 'gelu' is not supported"),
    ],
)
def test_unsupported_fields_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        hf_model_fields({**SHAPE, **edit})


def test_options_without_an_architecture_are_not_exported(tiny, tmp_path):
    config = tiny(model=dict(family="llama", qkv_bias=True, qk_norm=True)).model
    with pytest.raises(ConfigError, match="no Hugging Face architecture has both"):
        export_hf(config, {}, tmp_path)


def test_generation_longer_than_the_window_is_refused(tiny):
    """Checked before anything runs: the blocks are not touched."""
    config = tiny(model=dict(family="llama", sliding_window=16)).model

    class Blocks:
        model = build_model(config)

    with pytest.raises(ConfigError, match=r"exceed model.sliding_window 16"):
        generate(Blocks(), [[1] * 10], 7)
    with pytest.raises(AttributeError):  # within the window: past the check, into the blocks
        generate(Blocks(), [[1] * 10], 6)


# The Hub's config.json of each model a config in configs/ names (as published)
HUB = {
    "qwen2_5_7b": dict(
        architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, hidden_act="silu",
        hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072,
        max_window_layers=28, model_type="qwen2", num_attention_heads=28, num_hidden_layers=28,
        num_key_value_heads=4, rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=131072,
        tie_word_embeddings=False, use_sliding_window=False, vocab_size=152064,
    ),
    "qwen3_8b": dict(
        architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        head_dim=128, hidden_act="silu", hidden_size=4096, intermediate_size=12288,
        max_position_embeddings=40960, max_window_layers=36, model_type="qwen3",
        num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8, rms_norm_eps=1e-06,
        rope_scaling=None, rope_theta=1000000, sliding_window=None, tie_word_embeddings=False,
        use_sliding_window=False, vocab_size=151936,
    ),
    "mistral_7b": dict(
        architectures=["MistralForCausalLM"], attention_dropout=0.0, hidden_act="silu",
        hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
        model_type="mistral", num_attention_heads=32, num_hidden_layers=32,
        num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, vocab_size=32768,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", HUB)
def test_config_describes_the_hub_checkpoint(name):
    check_model_config(load_config(name).model, HUB[name], "config.json")
