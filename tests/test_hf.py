"""Hugging Face import (model.init_from) and export, checked against transformers."""

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
from equivalence import assert_losses_close, assert_trees_close
from hf_models import build_hf_model, hf_logits, hf_sgd_losses
from safetensors.numpy import load_file, save_file

from hetjax import export
from hetjax.config import ConfigError, ModelConfig
from hetjax.export import export_hf
from hetjax.hf import HFCheckpoint, model_config_from_hf, open_checkpoint
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.runtime.streaming import StreamingRuntime
from models import build_model

FAMILIES = ["gpt2", "llama", "llama_tied", "llama_rope"]


def _tokens(shape=(2, 17), seed=3):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its save_pretrained directory); GPT-2 and Llama
    also saved in small shards."""
    out = {}
    for name in FAMILIES:
        family, tied, rope = name.split("_")[0], name.endswith("_tied"), name.endswith("_rope")
        model = build_hf_model(family, tied=tied, rope_scaling=rope)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        out[name] = (model, directory)
        if name in ("gpt2", "llama"):
            sharded = tmp_path_factory.mktemp(f"{name}_sharded")
            model.save_pretrained(sharded, max_shard_size="40KB")
            assert (sharded / "model.safetensors.index.json").is_file()
            out[f"{name}_sharded"] = (model, sharded)
    return out


def _config(tiny, directory, **sections):
    """The tiny test config with the model read off the checkpoint's config.json."""
    model = model_config_from_hf(directory, tiny().model)
    return tiny(model=dataclasses.asdict(model), **sections)


@pytest.mark.parametrize("name", [*FAMILIES, "gpt2_sharded", "llama_sharded"])
def test_import_logits_equal_transformers(checkpoints, tiny, name):
    hf_model, directory = checkpoints[name]
    config = _config(tiny, directory)
    params = open_checkpoint(config.model).params()
    tokens = _tokens((2, 24))
    ours = np.asarray(jax.jit(build_model(config.model).logits)(params, tokens))
    theirs = hf_logits(hf_model, tokens)
    assert np.abs(theirs).max() > 1.0  # logits of a useful size, not all near zero
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


# Every field the import reads off config.json, at a value other than hetjax's default
# (so a mapping that is dropped, and leaves the default, fails): config.json -> fields.
MAPPED = {
    "gpt2": (
        dict(
            model_type="gpt2", n_layer=3, n_embd=48, n_head=6, n_inner=80, vocab_size=300,
            n_positions=40, layer_norm_epsilon=1e-3,
        ),
        dict(
            num_layers=3, d_model=48, num_heads=6, d_ff=80, vocab_size=300, max_seq_len=40,
            layer_norm_eps=1e-3,
        ),
    ),
    "llama": (
        dict(
            model_type="llama", num_hidden_layers=3, hidden_size=48, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=80, vocab_size=300, rms_norm_eps=1e-3,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=5000.0, factor=4.0, low_freq_factor=2.0,
                high_freq_factor=8.0, original_max_position_embeddings=16,
            ),
        ),
        dict(
            family="llama", num_layers=3, d_model=48, num_heads=6, num_kv_heads=2, d_ff=80,
            vocab_size=300, layer_norm_eps=1e-3, tie_embeddings=False, rope_theta=5000.0,
            rope_scaling_factor=4.0, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0,
            rope_original_max_len=16,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", MAPPED)
def test_config_json_fields_map_to_non_default_values(tmp_path, family):
    hf, expected = MAPPED[family]
    defaults = ModelConfig()
    assert all(getattr(defaults, k) != v for k, v in expected.items())  # each one can fail
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = model_config_from_hf(tmp_path)
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_import_norm_eps_other_than_the_default(tiny, tmp_path, family):
    """Norms with epsilon 0.1 (the default is 1e-5): the imported model's logits equal
    transformers'; with the default epsilon they would not (checked, so the comparison
    can tell)."""
    hf_model = build_hf_model(family, norm_eps=0.1)
    hf_model.save_pretrained(tmp_path)
    config = _config(tiny, tmp_path)
    assert config.model.layer_norm_eps == 0.1
    params = open_checkpoint(config.model).params()
    tokens = _tokens((2, 24))
    theirs = hf_logits(hf_model, tokens)
    logits = lambda model: np.asarray(jax.jit(build_model(model).logits)(params, tokens))
    np.testing.assert_allclose(logits(config.model), theirs, rtol=0, atol=1e-4)
    default_eps = dataclasses.replace(config.model, layer_norm_eps=1e-5)
    assert np.abs(logits(default_eps) - theirs).max() > 1e-2


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sharded_import_is_identical(checkpoints, tiny, name):
    single = open_checkpoint(_config(tiny, checkpoints[name][1]).model).params()
    sharded = open_checkpoint(_config(tiny, checkpoints[f"{name}_sharded"][1]).model).params()
    jax.tree.map(np.testing.assert_array_equal, sharded, single)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_one_sgd_step_equals_transformers(checkpoints, tiny, name):
    """Loss before and after one SGD step on the same batch, hetjax vs PyTorch."""
    hf_model, directory = checkpoints[name]
    lr = 0.5
    optimizer = dict(
        name="sgd", momentum=0.0, lr=lr, grad_clip=0.0, warmup_steps=0, schedule="constant"
    )
    runtime = InMemoryRuntime(_config(tiny, directory, optimizer=optimizer))
    batch = _tokens((2, 17))
    loss = runtime.train_step(batch[None]).loss
    after = runtime.eval_loss(batch)
    torch_loss, torch_after = hf_sgd_losses(copy.deepcopy(hf_model), batch, lr)
    assert after < loss - 0.01  # the step did something
    np.testing.assert_allclose([loss, after], [torch_loss, torch_after], rtol=1e-5)


def test_stream_nvme_import_and_training_equal_none(checkpoints, tiny, tmp_path):
    """A Llama imported stage by stage into NVMe optimizer state: the same params as
    the in-memory import, then the same losses and params after three AdamW steps."""
    directory = checkpoints["llama"][1]
    stream = StreamingRuntime(
        _config(tiny, directory, offload=dict(mode="stream", optimizer="nvme", params="nvme")),
        workdir=tmp_path,
    )
    reference = InMemoryRuntime(_config(tiny, directory))
    try:
        jax.tree.map(np.testing.assert_array_equal, stream.params(), reference.params())
        for step in range(3):
            batch = _tokens((1, 4, 17), seed=step)
            assert_losses_close(stream.train_step(batch).loss, reference.train_step(batch).loss)
        stream.settle()
        assert_trees_close(stream.params(), reference.params())
    finally:
        stream.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_export_round_trip_and_transformers_load(checkpoints, tiny, tmp_path, name):
    from transformers import AutoModelForCausalLM

    hf_model, directory = checkpoints[name]
    config = _config(tiny, directory)
    params = open_checkpoint(config.model).params()
    export_hf(config.model, params, tmp_path / "single")
    export_hf(config.model, params, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for out in ("single", "sharded"):
        again = model_config_from_hf(tmp_path / out, config.model)
        assert dataclasses.replace(again, init_from="") == dataclasses.replace(
            config.model, init_from=""
        )
        jax.tree.map(np.testing.assert_array_equal, open_checkpoint(again).params(), params)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "single").float().eval()
    tokens = _tokens((2, 24))
    np.testing.assert_allclose(
        hf_logits(loaded, tokens), hf_logits(hf_model, tokens), rtol=0, atol=1e-5
    )


def test_export_cli_converts_a_checkpoint(checkpoints, tmp_path):
    """python -m hetjax.export with model.init_from: re-shards a checkpoint, params unchanged."""
    source = checkpoints["llama"][1]
    out = tmp_path / "hf"
    overrides = [
        f"--config.model.{k}={v}"
        for k, v in dict(
            num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, max_seq_len=128,
            rope_theta=5000.0, init_from=f"hf:{source}",
        ).items()
    ]  # fmt: skip
    rc = export.main(["--config", "llama_tiny", *overrides, "--out", str(out)])
    assert rc == 0
    config = model_config_from_hf(out)
    assert (config.family, config.num_layers, config.kv_heads) == ("llama", 2, 2)
    source_config = model_config_from_hf(source, config)
    jax.tree.map(
        np.testing.assert_array_equal,
        open_checkpoint(config).params(),
        open_checkpoint(source_config).params(),
    )


# -- errors: each names the problem and what to do ---------------------------------------


def _import(tiny, directory, **model):
    config = tiny(model=dict(family="llama", init_from=f"hf:{directory}", **model))
    return HFCheckpoint(directory, config.model)


def test_error_missing_directory(tiny, tmp_path):
    with pytest.raises(ConfigError, match="no such directory .*save_pretrained"):
        _import(tiny, tmp_path / "nope")


def test_error_missing_config_json(tiny, tmp_path):
    with pytest.raises(ConfigError, match="config.json is missing"):
        _import(tiny, tmp_path)


def test_error_unsupported_model_type(tiny, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="model_type 'bert' is not supported.*gpt2, llama"):
        _import(tiny, tmp_path)


def test_error_config_mismatch_names_both_values(checkpoints, tiny):
    directory = checkpoints["llama"][1]
    with pytest.raises(ConfigError) as e:
        _import(tiny, directory, num_kv_heads=2, d_ff=96)  # d_model 32 vs the checkpoint's 64
    assert "model.d_model is 32 but the checkpoint has 64" in str(e.value)
    assert "--config.model.d_model=64" in str(e.value)


def test_error_missing_safetensors(checkpoints, tiny, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["llama"][1] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="neither model.safetensors .*pytorch_model.bin"):
        HFCheckpoint(tmp_path, _config(tiny, checkpoints["llama"][1]).model)


def _copy_with(directory, out, edit_tensors=None, edit_config=None):
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_error_missing_tensor(checkpoints, tiny, tmp_path):
    """Refused when the checkpoint is opened, before any stage is read."""
    directory = checkpoints["llama"][1]
    broken = _copy_with(directory, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match="missing: 'model.layers.1.mlp.up_proj.weight'"):
        HFCheckpoint(broken, _config(tiny, directory).model)


def test_error_unexpected_tensors_a_qwen2_saved_as_llama(checkpoints, tiny, tmp_path):
    """A Qwen2's q/k/v biases under a config.json that says llama: refused naming them
    (they used to be dropped silently), with the model_type that reads them."""
    directory = checkpoints["llama"][1]

    def add_biases(tensors):
        for i in range(2):
            for n, width in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
                tensors[f"model.layers.{i}.self_attn.{n}.bias"] = np.ones(width, np.float32)

    broken = _copy_with(directory, tmp_path, add_biases)
    with pytest.raises(ConfigError) as e:
        HFCheckpoint(broken, _config(tiny, directory).model)
    message = str(e.value)
    assert (
        "unexpected (the model would not read them): 'model.layers.0.self_attn.k_proj.bias'"
        in message
    )
    assert "and 2 more" in message and "model_type qwen2" in message
    assert "missing" not in message


def test_buffers_and_equal_tied_copies_are_accepted(checkpoints, tiny, tmp_path):
    """Rotary inv_freq buffers (older transformers saved them; recomputed from
    config.json) are ignored, and a tied model's lm_head.weight equal to the embedding
    is accepted; one that differs is refused."""
    directory = checkpoints["llama_tied"][1]
    config = _config(tiny, directory).model
    reference = HFCheckpoint(directory, config).params()

    def extras(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    (tmp_path / "a").mkdir()
    extra = _copy_with(directory, tmp_path / "a", extras)
    jax.tree.map(np.testing.assert_array_equal, HFCheckpoint(extra, config).params(), reference)

    def differing(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1

    (tmp_path / "b").mkdir()
    broken = _copy_with(directory, tmp_path / "b", differing)
    with pytest.raises(ConfigError, match="'lm_head.weight' differs from 'model.embed_tokens"):
        HFCheckpoint(broken, config)


def test_error_truncated_safetensors_names_the_file(checkpoints, tiny, tmp_path):
    directory = checkpoints["llama"][1]
    broken = _copy_with(directory, tmp_path)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors cannot be read.*truncated"):
        HFCheckpoint(broken, _config(tiny, directory).model)


def test_error_tensor_shape_mismatch(checkpoints, tiny, tmp_path):
    directory = checkpoints["llama"][1]

    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][
            :80
        ]

    broken = _copy_with(directory, tmp_path, shrink)
    checkpoint = HFCheckpoint(broken, _config(tiny, directory).model)
    with pytest.raises(ConfigError, match=r"up_proj.weight.*\(80, 64\).*needs \(64, 96\)"):
        checkpoint.stage("block0")


def test_error_unsupported_rope_scaling(checkpoints, tiny, tmp_path):
    directory = checkpoints["llama"][1]

    def yarn(config):
        config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0}

    broken = _copy_with(directory, tmp_path, edit_config=yarn)
    with pytest.raises(ConfigError, match="rope scaling 'yarn' is not supported"):
        HFCheckpoint(broken, _config(tiny, directory).model)


def test_gpt2_without_transformer_prefix(checkpoints, tiny, tmp_path):
    """The hub's gpt2 is saved from a bare GPT2Model: tensor names without
    'transformer.', plus the old attention-mask buffers (ignored)."""
    directory = checkpoints["gpt2"][1]

    def bare(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))

    copy_dir = _copy_with(directory, tmp_path, bare)
    config = _config(tiny, directory).model
    jax.tree.map(
        np.testing.assert_array_equal,
        HFCheckpoint(copy_dir, config).params(),
        HFCheckpoint(directory, config).params(),
    )


def test_bfloat16_checkpoint_imports_as_its_fp32_values(checkpoints, tiny, tmp_path):
    import torch

    hf_model, directory = checkpoints["llama"]
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    config = _config(tiny, directory).model
    expected = jax.tree.map(
        lambda a: a.astype(jax.numpy.bfloat16).astype(np.float32),
        HFCheckpoint(directory, config).params(),
    )
    jax.tree.map(np.testing.assert_array_equal, HFCheckpoint(tmp_path, config).params(), expected)


@pytest.mark.parametrize("command", ["train", "eval", "generate"])
def test_truncated_safetensors_is_one_line_in_every_command(checkpoints, tmp_path, capsys, command):
    """train, eval and generate all load through hetjax/hf.py: one line naming the
    file, exit status 1, no traceback."""
    from hetjax import cli

    broken = _copy_with(checkpoints["llama"][1], tmp_path)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) - 100])
    args = {
        "train": ["--config", "llama_tiny", "--workdir", str(tmp_path / "run")],
        "eval": ["--config", "llama_tiny"],
        "generate": ["--prompt", "hi"],
    }[command]
    rc = cli.main([command, "--hf", str(broken), *args])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "model.safetensors" in line]
    assert len(lines) == 1 and "cannot be read as safetensors" in lines[0]
    assert "truncated or damaged" in lines[0]
