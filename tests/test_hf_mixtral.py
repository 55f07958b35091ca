"""Hugging Face import (model.init_from) and export of Mixtral (MixtralForCausalLM),
checked against transformers: the Hub's per-expert layout and transformers 5's fused one."""

import copy
import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from equivalence import assert_losses_close, assert_trees_close
from hf_models import build_hf_model, hf_logits, hf_sgd_losses
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hetjax import export
from hetjax.config import ConfigError, ModelConfig, load_config
from hetjax.export import export_hf
from hetjax.hf import (
    HFCheckpoint,
    check_model_config,
    hf_model_fields,
    model_config_from_hf,
    open_checkpoint,
)
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from models import build_model


def _tokens(shape=(2, 24), seed=3):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(transformers Mixtral, {layout: its save_pretrained directory}): ``per_expert``
    (the default, the Hub's layout), ``fused`` (save_original_format=False) and
    ``sharded`` (per-expert, in 40 KB shards)."""
    model = build_hf_model("mixtral")
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("per_expert", "fused", "sharded")}
    model.save_pretrained(dirs["per_expert"])
    model.save_pretrained(dirs["fused"], save_original_format=False)
    model.save_pretrained(dirs["sharded"], max_shard_size="40KB")
    assert (dirs["sharded"] / "model.safetensors.index.json").is_file()
    return model, dirs


def _tensor_names(directory):
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        return set(f.keys())


def test_save_pretrained_layouts(checkpoints):
    """The two layouts the import reads are what this transformers version writes."""
    _, dirs = checkpoints
    per_expert, fused = _tensor_names(dirs["per_expert"]), _tensor_names(dirs["fused"])
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in per_expert
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert not any(".mlp." in n for n in per_expert)
    assert not any("block_sparse_moe" in n for n in fused)


def _config(tiny, directory, **sections):
    """The tiny test config with the model read off the checkpoint's config.json."""
    model = model_config_from_hf(directory, tiny().model)
    return tiny(model=dataclasses.asdict(model), **sections)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_import_logits_equal_transformers(checkpoints, tiny, layout):
    hf_model, dirs = checkpoints
    config = _config(tiny, dirs[layout])
    assert (config.model.num_experts, config.model.experts_per_token) == (4, 2)
    assert config.model.router_aux_loss_coef == 0.02
    params = open_checkpoint(config.model).params()
    tokens = _tokens()
    ours = np.asarray(jax.jit(build_model(config.model).logits)(params, tokens))
    theirs = hf_logits(hf_model, tokens)
    assert np.abs(theirs).max() > 1.0  # logits of a useful size, not all near zero
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_layouts_and_shards_import_identically(checkpoints, tiny):
    _, dirs = checkpoints
    params = {
        name: open_checkpoint(_config(tiny, directory).model).params()
        for name, directory in dirs.items()
    }
    jax.tree.map(np.testing.assert_array_equal, params["fused"], params["per_expert"])
    jax.tree.map(np.testing.assert_array_equal, params["sharded"], params["per_expert"])


# transformers' MixtralConfig with every field below at a value other than hetjax's
# default (so a mapping that is dropped, and leaves the default, fails) -> fields.
MIXTRAL_JSON = dict(
    model_type="mixtral", num_hidden_layers=3, hidden_size=48, num_attention_heads=6,
    num_key_value_heads=2, intermediate_size=80, vocab_size=300, rms_norm_eps=1e-3,
    tie_word_embeddings=False, num_local_experts=6, num_experts_per_tok=3,
    router_aux_loss_coef=0.05, rope_parameters=dict(rope_type="default", rope_theta=5000.0),
)  # fmt: skip
MIXTRAL_FIELDS = dict(
    family="llama", num_layers=3, d_model=48, num_heads=6, num_kv_heads=2, d_ff=80,
    vocab_size=300, layer_norm_eps=1e-3, tie_embeddings=False, rope_theta=5000.0,
    num_experts=6, experts_per_token=3, router_aux_loss_coef=0.05,
)  # fmt: skip


def test_config_json_fields_map_to_non_default_values(tmp_path):
    defaults = ModelConfig()
    assert all(getattr(defaults, k) != v for k, v in MIXTRAL_FIELDS.items() if k != "family")
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_JSON))
    config = model_config_from_hf(tmp_path)
    assert {k: getattr(config, k) for k in MIXTRAL_FIELDS} == MIXTRAL_FIELDS


# mistralai/Mixtral-8x7B-v0.1's config.json on the Hub (written by transformers 4.36)
MIXTRAL_8X7B_JSON = dict(
    architectures=["MixtralForCausalLM"], attention_dropout=0.0, bos_token_id=1,
    eos_token_id=2, hidden_act="silu", hidden_size=4096, initializer_range=0.02,
    intermediate_size=14336, max_position_embeddings=32768, model_type="mixtral",
    num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32,
    num_key_value_heads=8, num_local_experts=8, output_router_logits=False,
    rms_norm_eps=1e-05, rope_theta=1000000.0, router_aux_loss_coef=0.02,
    sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, vocab_size=32000,
)  # fmt: skip


def test_mixtral_8x7b_config_describes_the_hub_checkpoint():
    check_model_config(load_config("mixtral_8x7b").model, MIXTRAL_8X7B_JSON, "config.json")


@pytest.mark.parametrize("model_type", ["mixtral", "llama"])
def test_fields_config_json_leaves_out_are_transformers_defaults(model_type):
    """A config.json with only the shape fields reads as transformers' full config of
    the same model does (its defaults: Mixtral's 8 key/value heads, rms eps 1e-5, rope
    theta 1e6, aux loss weight 0.001; Llama's as many key/value heads as heads, 1e-6,
    10000)."""
    import transformers

    shape = dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=16, intermediate_size=96,
        vocab_size=300,
    )  # fmt: skip
    if model_type == "mixtral":
        shape.update(num_local_experts=4, num_experts_per_tok=2)
        full = transformers.MixtralConfig(**shape).to_dict()
    else:
        full = transformers.LlamaConfig(**shape).to_dict()
    assert hf_model_fields({"model_type": model_type, **shape}) == hf_model_fields(full)


def test_one_sgd_step_equals_transformers(checkpoints, tiny):
    """Loss before and after one SGD step on the same batch, hetjax vs PyTorch: the
    cross-entropy plus 0.02 x the load-balancing loss on both sides."""
    hf_model, dirs = checkpoints
    lr = 0.5
    optimizer = dict(
        name="sgd", momentum=0.0, lr=lr, grad_clip=0.0, warmup_steps=0, schedule="constant"
    )
    runtime = InMemoryRuntime(_config(tiny, dirs["per_expert"], optimizer=optimizer))
    batch = _tokens((2, 17))
    loss = runtime.train_step(batch[None]).loss
    after = runtime.eval_loss(batch)
    torch_loss, torch_after = hf_sgd_losses(copy.deepcopy(hf_model), batch, lr)
    assert after < loss - 0.01  # the step did something
    np.testing.assert_allclose([loss, after], [torch_loss, torch_after], rtol=1e-5)


def test_export_round_trip_and_transformers_load(checkpoints, tiny, tmp_path):
    """Export writes the Hub's per-expert layout (the very tensor names save_pretrained
    writes), re-imports exactly, single and sharded, and transformers loads it as the
    model it came from."""
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    hf_model, dirs = checkpoints
    config = _config(tiny, dirs["fused"])
    params = open_checkpoint(config.model).params()
    export_hf(config.model, params, tmp_path / "single")
    export_hf(config.model, params, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert _tensor_names(tmp_path / "single") == _tensor_names(dirs["per_expert"])
    for out in ("single", "sharded"):
        again = model_config_from_hf(tmp_path / out, config.model)
        assert dataclasses.replace(again, init_from="") == dataclasses.replace(
            config.model, init_from=""
        )
        jax.tree.map(np.testing.assert_array_equal, open_checkpoint(again).params(), params)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "single").float().eval()
    assert isinstance(loaded, MixtralForCausalLM)
    assert loaded.config.output_router_logits  # transformers' loss adds the aux loss too
    tokens = _tokens()
    np.testing.assert_allclose(
        hf_logits(loaded, tokens), hf_logits(hf_model, tokens), rtol=0, atol=1e-5
    )


def test_export_cli_writes_mixtral_tiny(tmp_path):
    """python -m hetjax.export --config mixtral_tiny: a MixtralForCausalLM checkpoint
    of the config's shape that imports as the config's initial params."""
    out = tmp_path / "hf"
    assert export.main(["--config", "mixtral_tiny", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    run = load_config("mixtral_tiny")
    config = model_config_from_hf(out, run.model)
    assert dataclasses.replace(config, init_from="") == run.model
    initial = jax.jit(build_model(run.model).init)(jax.random.key(run.train.seed))
    jax.tree.map(np.testing.assert_array_equal, open_checkpoint(config).params(), initial)


def test_stream_nvme_import_equals_in_memory(checkpoints, tiny, tmp_path):
    """A Mixtral imported stage by stage (from shards) into params and optimizer state
    on NVMe holds the params the in-memory import does."""
    directory = checkpoints[1]["sharded"]
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    stream = StreamingRuntime(_config(tiny, directory, offload=offload), workdir=tmp_path)
    try:
        expected = open_checkpoint(_config(tiny, directory).model).params()
        jax.tree.map(np.testing.assert_array_equal, stream.params(), expected)
    finally:
        stream.close()


@pytest.mark.slow  # ~10 s on 2 cores with a cold compilation cache: 2 runtimes, 2 steps each
def test_stream_nvme_training_from_import_equals_none(checkpoints, tiny, tmp_path):
    """Two SGD steps from the imported Mixtral, streamed with NVMe state and in memory:
    the same losses and params. SGD compares the gradients themselves: AdamW's first
    steps divide an element's gradient by its own magnitude, so a near-zero one (3e-8
    against a median of 3e-3 in this model's q_proj) turns summation-order rounding
    into an update-sized difference (tests/equivalence.py)."""
    directory = checkpoints[1]["sharded"]
    sgd = dict(optimizer=dict(name="sgd", lr=0.1))
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    stream = StreamingRuntime(_config(tiny, directory, offload=offload, **sgd), workdir=tmp_path)
    reference = InMemoryRuntime(_config(tiny, directory, **sgd))
    try:
        for step in range(2):
            batch = _tokens((1, 4, 17), seed=step)
            assert_losses_close(stream.train_step(batch).loss, reference.train_step(batch).loss)
        stream.settle()
        assert_trees_close(stream.params(), reference.params())
    finally:
        stream.close()


# -- errors: each names the problem and what to do ---------------------------------------


def _copy_with(directory, out, edit_tensors=None, edit_config=None):
    """A copy of a single-file checkpoint with its tensors or config.json edited."""
    config = json.loads((directory / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (out / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(directory / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    else:
        shutil.copy(directory / "model.safetensors", out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("router_jitter_noise", 0.01, r"router_jitter_noise = 0.01 is not supported.*"
         r'"router_jitter_noise": 0.0 in config.json'),
        ("hidden_act", "gelu", r"hidden_act = 'gelu' is not supported.*needs 'silu'"),
        ("attention_dropout", 0.1, r"attention_dropout = 0.1 is not supported.*needs 0.0"),
    ],
)  # fmt: skip
def test_error_config_json_field_hetjax_cannot_honour(
    checkpoints, tiny, tmp_path, key, value, message
):
    directory = checkpoints[1]["per_expert"]
    broken = _copy_with(directory, tmp_path, edit_config=lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=message):
        HFCheckpoint(broken, _config(tiny, directory).model)
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(broken)


def test_sliding_window_is_read_and_checked(checkpoints, tiny, tmp_path):
    """A window is model.sliding_window (sequences past it refused: tests/
    test_hf_families.py), checked against the model config like the shape."""
    directory = checkpoints[1]["per_expert"]
    windowed = _copy_with(directory, tmp_path, edit_config=lambda c: c.update(sliding_window=64))
    assert model_config_from_hf(windowed).sliding_window == 64
    with pytest.raises(ConfigError, match="model.sliding_window is 0 but the checkpoint has 64"):
        HFCheckpoint(windowed, _config(tiny, directory).model)


def test_error_missing_expert_count(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in MIXTRAL_JSON.items() if k != "num_local_experts"})
    )
    with pytest.raises(ConfigError, match="num_local_experts is missing"):
        model_config_from_hf(tmp_path)


@pytest.mark.parametrize(
    "model, message",
    [
        (dict(num_experts=0), "model.num_experts is 0 but the checkpoint has 4.*"
         "--config.model.num_experts=4"),
        (dict(experts_per_token=1), "model.experts_per_token is 1 but the checkpoint has 2.*"
         "--config.model.experts_per_token=2"),
        (dict(router_aux_loss_coef=0.01), "model.router_aux_loss_coef is 0.01 but the "
         "checkpoint has 0.02.*--config.model.router_aux_loss_coef=0.02"),
    ],
)  # fmt: skip
def test_error_config_mismatch_names_both_values(checkpoints, tiny, model, message):
    directory = checkpoints[1]["per_expert"]
    config = _config(tiny, directory).model
    with pytest.raises(ConfigError, match=message):
        HFCheckpoint(directory, dataclasses.replace(config, **model))


def test_error_llama_checkpoint_for_a_mixture_of_experts(tiny, tmp_path):
    build_hf_model("llama").save_pretrained(tmp_path)
    config = dataclasses.replace(_config(tiny, tmp_path).model, num_experts=4)
    with pytest.raises(ConfigError, match="model.num_experts is 4 but the checkpoint has 0"):
        HFCheckpoint(tmp_path, config)


def test_error_missing_expert_tensor(checkpoints, tiny, tmp_path):
    directory = checkpoints[1]["per_expert"]
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    broken = _copy_with(directory, tmp_path, lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=f"missing: '{name}'.*wrong model_type"):
        HFCheckpoint(broken, _config(tiny, directory).model)


@pytest.mark.parametrize(
    "layout, name, message",
    [
        ("per_expert", "model.layers.0.block_sparse_moe.experts.2.w1.weight",
         r"has shape \(90, 64\), but block0 moe/gate_proj needs \(4, 64, 96\) "
         r"\(its row 2, transposed: \(96, 64\)\)"),
        ("fused", "model.layers.0.mlp.experts.gate_up_proj",
         r"has shape \(4, 90, 64\), but block0 moe/gate_proj needs \(4, 64, 96\) "
         r"\(1 of 2 slices of axis -2, transposed: \(4, 192, 64\)\)"),
    ],
)  # fmt: skip
def test_error_expert_tensor_shape_mismatch(checkpoints, tiny, tmp_path, layout, name, message):
    directory = checkpoints[1][layout]

    def shrink(tensors):
        tensors[name] = np.ascontiguousarray(tensors[name][..., :90, :])

    broken = _copy_with(directory, tmp_path, shrink)
    checkpoint = HFCheckpoint(broken, _config(tiny, directory).model)
    with pytest.raises(ConfigError, match=message):
        checkpoint.stage("block0")
