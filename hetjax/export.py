"""``python -m hetjax.export``: write a model as a Hugging Face checkpoint directory.

    python -m hetjax.export --config llama_tiny --out runs/llama_tiny_hf            # init
    python -m hetjax.export --config llama_tiny --train --workdir runs/lt --out runs/lt_hf
    python -m hetjax.export --config gpt_small --config.model.init_from=hf:gpt2 --out gpt2_copy
    python -m hetjax.export --config llama_tiny --hf llama-hf --workdir runs/ft --checkpoint \
        --out ft-hf                                  # a run's newest checkpoint

The params come from the run config: without ``--train``, the initial params (the
``model.init_from`` checkpoint, else the random init of ``train.seed``); with
``--train``, the params at the end of ``hetjax.train.train`` on that config (metrics in
``--workdir``); with ``--checkpoint``, those of the newest checkpoint in ``--workdir``.
The output loads with ``transformers``' ``from_pretrained`` and with
``model.init_from=hf:<out>``; a ``model.family=llama`` config writes the architecture
``hetjax.hf.llama_model_type`` picks (Llama, or Mistral with ``model.sliding_window``,
Qwen2 with ``model.qkv_bias``, Qwen3 with ``model.qk_norm``, a MixtralForCausalLM in the
Hub's per-expert layout with ``model.num_experts``), a ``model.family=t5`` one a
T5ForConditionalGeneration.
:func:`export_hf` is the same from Python, for any params tree (e.g.
``hetjax.train.train(...).params``); the tensor names are
``hetjax.hf.stage_tensor_names``, the mapping import uses. A ``--out`` that exists and is
not empty is refused unless ``--overwrite`` (checked before anything is loaded or trained).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.config import Config, ConfigError, ModelConfig, parse_bytes
from hetjax.errors import UserError, check_output_dir, entry_point
from hetjax.hf import (
    INDEX_FILE,
    LLAMA_SHAPED,
    SINGLE_FILE,
    Params,
    llama_model_type,
    open_checkpoint,
    param_at,
    stage_tensor_names,
)
from models import build_model

# -- the checkpoint ---------------------------------------------------------------------


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` of a hetjax model config."""
    if config.family == "gpt":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": config.num_layers,
            "n_embd": config.d_model,
            "n_head": config.num_heads,
            "n_inner": config.ff_dim,
            "n_positions": config.max_seq_len,
            "vocab_size": config.vocab_size,
            "layer_norm_epsilon": config.layer_norm_eps,
            "activation_function": "gelu_new",
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "dtype": "float32",
        }
    if config.family == "t5":
        return _t5_config_json(config)
    if config.family == "llama":
        return _llama_config_json(config)
    stage_tensor_names(config, "embed")  # raises the unsupported-family ConfigError
    raise AssertionError(config.family)


def _llama_config_json(config: ModelConfig) -> dict[str, Any]:
    """A Llama-shaped model's ``config.json``, as the architecture
    :func:`hetjax.hf.llama_model_type` picks: LlamaForCausalLM, MistralForCausalLM
    (a sliding window), Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (q/k norms)
    or MixtralForCausalLM (experts). A Mixtral's ``output_router_logits`` is
    ``router_aux_loss_coef`` > 0, so that transformers' loss is hetjax's: the
    cross-entropy plus the weighted load-balancing loss."""
    model_type = llama_model_type(config)
    window = config.sliding_window or None
    body: dict[str, Any] = {
        "architectures": [LLAMA_SHAPED[model_type].architecture],
        "model_type": model_type,
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.d_model,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ff_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.layer_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    if model_type in ("llama", "qwen3"):
        body["attention_bias"] = False
    if model_type == "llama":
        body["mlp_bias"] = False
    if model_type in ("mistral", "mixtral"):
        body["sliding_window"] = window
    if LLAMA_SHAPED[model_type].window_switch:  # Qwen: the window on every layer, or off
        body.update(use_sliding_window=bool(window), sliding_window=window, max_window_layers=0)
    if model_type == "mixtral":
        body.update(
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.experts_per_token,
            router_aux_loss_coef=config.router_aux_loss_coef,
            output_router_logits=config.router_aux_loss_coef > 0,
            router_jitter_noise=0.0,
        )
    return body


def _t5_config_json(config: ModelConfig) -> dict[str, Any]:
    """A T5's ``config.json``: transformers' T5ForConditionalGeneration without dropout
    (hetjax trains without), its tied-and-scaled (T5 v1.0) or untied (v1.1) head said
    both ways (``tie_word_embeddings`` for transformers < 5, ``scale_decoder_outputs``
    for 5, which always ties unless both tensors are saved, as export does untied)."""
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": config.vocab_size,
        "d_model": config.d_model,
        "d_kv": config.head_dim,
        "d_ff": config.ff_dim,
        "num_layers": config.num_layers,
        "num_decoder_layers": config.decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "dropout_rate": 0.0,
        "layer_norm_epsilon": config.layer_norm_eps,
        "initializer_factor": 1.0,
        "feed_forward_proj": config.feed_forward_proj,
        "is_encoder_decoder": True,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_decoder_outputs": config.tie_embeddings,
        "decoder_start_token_id": config.decoder_start_token,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "dtype": "float32",
    }


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    if not config.rope_scaling_factor:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        "factor": config.rope_scaling_factor,
        "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_max_len,
    }


def export_hf(
    config: ModelConfig, params: Params, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Writes ``params`` (``{'embed', each group's blocks (L, ...), 'head'}``, fp32) as a HF
    checkpoint directory: ``config.json`` and ``model.safetensors``, or shards of at
    most ``max_shard_bytes`` with ``model.safetensors.index.json`` (as save_pretrained
    does). Returns ``out_dir``."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    config_json = hf_config_json(config)
    out.mkdir(parents=True, exist_ok=True)
    stages = [("embed", params["embed"], 0)]
    for group in build_model(config).groups:
        stages += [
            (group.name, jax.tree.map(lambda a, i=i: a[i], params[group.key]), i)
            for i in range(group.num_layers)
        ]
    stages.append(("head", params["head"], 0))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for kind, stage_params, layer in stages:
        for n in stage_tensor_names(config, kind, layer):
            array = np.asarray(n.from_leaf(param_at(stage_params, n.path)), np.float32)
            array = np.ascontiguousarray(array)
            if size and size + array.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][n.hf] = array
            size += array.nbytes
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a re-export must not leave old shards behind
    metadata = {"format": "pt"}  # transformers reads only files marked as PyTorch-layout
    if len(shards) == 1:
        save_file(shards[0], out / SINGLE_FILE, metadata=metadata)
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / file, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(a.nbytes for a in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out


# -- the command line -------------------------------------------------------------------


def initial_params(config: Config):
    """The params a run of ``config`` starts from, as a numpy tree."""
    checkpoint = open_checkpoint(config.model)
    if checkpoint is not None:
        return checkpoint.params()
    model = build_model(config.model)
    return jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(config.train.seed)))


@entry_point("hetjax.export")
def main(argv: list[str] | None = None) -> int:
    from hetjax import launch

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.export",
        description="Write a hetjax model as a Hugging Face checkpoint (config.json + "
        "safetensors). Also takes launch's --config, --workdir and --config.<key>=<value>.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write over an existing export in --out (else a non-empty --out is refused)",
    )
    parser.add_argument(
        "--train", action="store_true", help="train the config first and export the result"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="export the newest checkpoint in --workdir"
    )
    parser.add_argument(
        "--max-shard-size", default="5GiB", help="largest safetensors shard (default 5GiB)"
    )
    args, rest = parser.parse_known_args(argv)
    run_args, overrides = launch.parse_args(rest)
    config = launch.run_config(run_args, overrides)
    shard_bytes = parse_bytes(args.max_shard_size, "--max-shard-size")
    check_output_dir(args.out, "--out", exists_ok=args.overwrite)  # before any work
    workdir = Path(run_args.workdir or Path("runs") / Path(run_args.config).stem)
    if args.train:
        check_output_dir(workdir, "--workdir")

    from hetjax.checkpoint import restore_newest
    from hetjax.train import train

    try:
        if args.train:
            params = train(config, workdir).params
        elif args.checkpoint:
            params = restore_newest(config, workdir)[0].params()
        else:
            params = initial_params(config)
    except ConfigError as e:  # found once running (a busy workdir, another model's state)
        raise UserError(str(e)) from None
    out = export_hf(config.model, params, args.out, shard_bytes)
    print(f"hetjax.export: wrote {config.model.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
