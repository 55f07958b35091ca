"""Hugging Face checkpoints: import a stage at a time, and export, for GPT-2 and Llama.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json`` plus either
``model.safetensors`` or shards ``model-0000k-of-0000n.safetensors`` listed in
``model.safetensors.index.json``. ``model.init_from = "hf:<dir>"`` starts a run from
one: :func:`open_checkpoint` checks the directory and that its ``config.json`` describes
the configured model, then :meth:`HFCheckpoint.stage` reads one stage's tensors
(``safe_open`` reads only those bytes), so the streaming runtime places a model that
does not fit in RAM stage by stage; the in-memory runtime takes :meth:`HFCheckpoint.params`.
Export, the other direction, is ``hetjax/export.py``.

The name mapping, one table per family used both ways (import and export):

  GPT-2   ``transformer.h.{i}.attn.c_attn.weight`` <-> block ``c_attn/kernel``; HF's
          Conv1D stores (in, out) like a Flax Dense kernel, so nothing is transposed;
          ``mlp.c_proj`` is ``c_proj_mlp``; LayerNorm ``weight`` is ``scale``.
  Llama   ``model.layers.{i}.self_attn.q_proj.weight`` (out, in) <-> block
          ``q_proj/kernel`` (in, out), transposed; RMSNorm ``weight`` is ``scale``;
          ``lm_head.weight`` (V, D) <-> head ``lm_head/kernel`` (D, V).

Tied output heads have no tensor of their own (HF drops ``lm_head.weight`` too).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from hetjax.config import ConfigError, ModelConfig
from models import build_model

Params = dict[str, Any]

SUPPORTED_MODEL_TYPES = {"gpt2": "gpt", "llama": "llama"}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorName:
    """One HF tensor and where it goes in a stage's params."""

    hf: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
    path: tuple[str, ...]  # e.g. ("q_proj", "kernel")
    transpose: bool  # HF (out, in) vs Flax (in, out)


def stage_tensor_names(
    config: ModelConfig, stage: str, layer: int = 0, prefix: str | None = None
) -> list[TensorName]:
    """The HF tensors of one stage (``embed``, ``block`` with ``layer``, or ``head``).
    ``prefix``: GPT-2's module prefix, ``"transformer."`` (GPT2LMHeadModel, the
    default) or ``""`` (a bare GPT2Model)."""
    if config.num_experts:  # Mixtral's mapping (issue #22 item 6) is not written yet
        raise ConfigError(
            f"model.num_experts is {config.num_experts}: HF import and export of "
            "mixture-of-experts models (MixtralForCausalLM) is not supported yet"
        )
    if config.family == "gpt":
        p = "transformer." if prefix is None else prefix
        norm = lambda hf, ours: [
            TensorName(f"{hf}.weight", (ours, "scale"), False),
            TensorName(f"{hf}.bias", (ours, "bias"), False),
        ]
        dense = lambda hf, ours: [
            TensorName(f"{hf}.weight", (ours, "kernel"), False),  # Conv1D: (in, out)
            TensorName(f"{hf}.bias", (ours, "bias"), False),
        ]
        if stage == "embed":
            return [TensorName(f"{p}wte.weight", ("wte",), False),
                    TensorName(f"{p}wpe.weight", ("wpe",), False)]  # fmt: skip
        if stage == "block":
            h = f"{p}h.{layer}"
            return [
                *norm(f"{h}.ln_1", "ln_1"),
                *dense(f"{h}.attn.c_attn", "c_attn"),
                *dense(f"{h}.attn.c_proj", "c_proj"),
                *norm(f"{h}.ln_2", "ln_2"),
                *dense(f"{h}.mlp.c_fc", "c_fc"),
                *dense(f"{h}.mlp.c_proj", "c_proj_mlp"),
            ]
        if stage == "head":
            return norm(f"{p}ln_f", "ln_f")
    elif config.family == "llama":
        rms = lambda hf, ours: TensorName(f"{hf}.weight", (ours, "scale"), False)
        linear = lambda hf, ours: TensorName(f"{hf}.weight", (ours, "kernel"), True)
        if stage == "embed":
            return [TensorName("model.embed_tokens.weight", ("embed_tokens",), False)]
        if stage == "block":
            h = f"model.layers.{layer}"
            return [
                rms(f"{h}.input_layernorm", "input_layernorm"),
                *(linear(f"{h}.self_attn.{n}", n) for n in ("q_proj", "k_proj", "v_proj")),
                linear(f"{h}.self_attn.o_proj", "o_proj"),
                rms(f"{h}.post_attention_layernorm", "post_attention_layernorm"),
                *(linear(f"{h}.mlp.{n}", n) for n in ("gate_proj", "up_proj", "down_proj")),
            ]
        if stage == "head":
            names = [rms("model.norm", "norm")]
            if not config.tie_embeddings:
                names.append(linear("lm_head", "lm_head"))
            return names
    else:
        raise ConfigError(
            f"model.family {config.family!r} has no Hugging Face mapping; HF import and "
            f"export support {', '.join(sorted(set(SUPPORTED_MODEL_TYPES.values())))}"
        )
    raise ValueError(f"unknown stage {stage!r}")


# -- config.json <-> ModelConfig ---------------------------------------------------------


def hf_model_fields(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The ModelConfig fields a HF ``config.json`` (as a dict) fixes. Raises ConfigError
    for a model type or a feature hetjax does not implement."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; hetjax imports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints (models/gpt.py, models/llama.py)"
        )

    def unsupported(key: str, value: Any, expected: Any) -> None:
        if value != expected:
            raise ConfigError(
                f"{where}: {key} = {value!r} is not supported (hetjax's {model_type} needs "
                f"{expected!r})"
            )

    if model_type == "gpt2":
        activation = hf.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            unsupported("activation_function", activation, "gelu_new")
        unsupported("scale_attn_weights", hf.get("scale_attn_weights", True), True)
        unsupported(
            "scale_attn_by_inverse_layer_idx",
            hf.get("scale_attn_by_inverse_layer_idx", False),
            False,
        )
        unsupported("add_cross_attention", hf.get("add_cross_attention", False), False)
        unsupported("tie_word_embeddings", hf.get("tie_word_embeddings", True), True)
        return dict(
            family="gpt",
            num_layers=hf["n_layer"],
            d_model=hf["n_embd"],
            num_heads=hf["n_head"],
            d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
            vocab_size=hf["vocab_size"],
            max_seq_len=hf["n_positions"],
            layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            num_kv_heads=0,
            tie_embeddings=True,
        )
    # llama; transformers >= 5 writes rope_parameters, older versions rope_theta/rope_scaling
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"{where}: rope scaling {rope_type!r} is not supported (hetjax's llama has plain "
            "rotary embeddings or Llama 3.1's 'llama3' rescaling)"
        )
    scaling: dict[str, Any] = dict(rope_scaling_factor=0.0)  # the other three unused then
    if rope_type == "llama3":
        scaling = dict(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    unsupported("hidden_act", hf.get("hidden_act", "silu"), "silu")
    unsupported("attention_bias", hf.get("attention_bias", False), False)
    unsupported("mlp_bias", hf.get("mlp_bias", False), False)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        unsupported("head_dim", hf["head_dim"], d // heads)
    return dict(
        family="llama",
        num_layers=hf["num_hidden_layers"],
        d_model=d,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        layer_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **scaling,
    )


def _effective(config: ModelConfig, field: str) -> Any:
    """A ModelConfig field with its 0-means-default resolved, for comparison."""
    if field == "d_ff":
        return config.ff_dim
    if field == "num_kv_heads":
        return config.kv_heads
    return getattr(config, field)


def check_model_config(config: ModelConfig, hf: dict[str, Any], where: str) -> None:
    """Raises ConfigError naming every field where ``config`` and the checkpoint's
    ``config.json`` disagree, and the overrides that make them agree."""
    fields = hf_model_fields(hf, where)
    fields["num_kv_heads"] = fields["num_kv_heads"] or fields["num_heads"]
    same = lambda a, b: math.isclose(a, b) if isinstance(b, float) else a == b
    bad = [n for n, value in fields.items() if not same(_effective(config, n), value)]
    if bad:
        diffs = "; ".join(
            f"model.{n} is {_effective(config, n)!r} but the checkpoint has {fields[n]!r}"
            for n in bad
        )
        overrides = " ".join(f"--config.model.{n}={fields[n]}" for n in bad)
        raise ConfigError(
            f"model.init_from: {where} does not match the model config: {diffs}. Use a "
            f"config with the checkpoint's shape, e.g. add {overrides}"
        )


def model_config_from_hf(directory: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint directory: ``base`` (default: the defaults) with
    the shape fields read from its ``config.json`` and ``init_from`` pointing at it."""
    directory = Path(directory)
    hf = _read_config_json(directory, f"hf:{directory}")
    fields = hf_model_fields(hf, str(directory / "config.json"))
    return dataclasses.replace(base or ModelConfig(), **fields, init_from=f"hf:{directory}")


def _read_config_json(directory: Path, spec: str) -> dict[str, Any]:
    if not directory.is_dir():
        raise ConfigError(
            f"model.init_from {spec!r}: no such directory {str(directory)!r}; give "
            "'hf:<dir>' with a directory written by save_pretrained (config.json and "
            "*.safetensors)"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.init_from {spec!r}: {path} is missing; a Hugging Face checkpoint "
            "directory holds config.json next to its *.safetensors (save_pretrained writes both)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.init_from {spec!r}: {path} is not valid JSON ({e})") from e


# -- import ------------------------------------------------------------------------------


class HFCheckpoint:
    """A checked HF checkpoint directory, read a stage at a time."""

    def __init__(self, directory: str | Path, config: ModelConfig):
        self.directory = Path(directory)
        self.config = config
        spec = f"hf:{directory}"
        hf = _read_config_json(self.directory, spec)
        check_model_config(config, hf, str(self.directory / "config.json"))
        self.files = self._tensor_files(spec)  # HF tensor name -> safetensors file
        self.prefix = None
        if config.family == "gpt":  # GPT2LMHeadModel vs a bare GPT2Model
            self.prefix = "" if "wte.weight" in self.files else "transformer."
        model = build_model(config)
        # Expected param shapes of each stage kind: structure and shape checks.
        self.expected = {
            kind: jax.eval_shape(lambda k, kind=kind: model.init_stage(kind, k), jax.random.key(0))
            for kind in ("embed", "block", "head")
        }

    def _tensor_files(self, spec: str) -> dict[str, Path]:
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / file for name, file in weight_map.items()}
        if single.is_file():
            with safe_open(single, framework="numpy") as f:
                return dict.fromkeys(f.keys(), single)
        present = sorted(p.name for p in self.directory.iterdir())
        raise ConfigError(
            f"model.init_from {spec!r}: neither {SINGLE_FILE} nor {INDEX_FILE} in "
            f"{self.directory} (found: {', '.join(present) or 'nothing'}); hetjax reads "
            "safetensors: save the model with save_pretrained(..., safe_serialization=True)"
        )

    def stage(self, name: str) -> Params:
        """fp32 numpy params of stage ``name``: ``embed``, ``block{i}`` or ``head``,
        structured like ``model.init_stage``; reads only that stage's tensors."""
        kind, layer = ("block", int(name[5:])) if name.startswith("block") else (name, 0)
        names = stage_tensor_names(self.config, kind, layer, self.prefix)
        arrays = self._read([n.hf for n in names], name)
        params: Params = {}
        for n in names:
            array = arrays[n.hf].T if n.transpose else arrays[n.hf]
            node = params
            for key in n.path[:-1]:
                node = node.setdefault(key, {})
            node[n.path[-1]] = np.ascontiguousarray(array, dtype=np.float32)
        expected = self.expected[kind]
        if jax.tree.structure(params) != jax.tree.structure(expected):
            raise AssertionError(f"{name}: mapping gives {jax.tree.structure(params)}")
        for n in names:
            got = param_at(params, n.path).shape
            want = param_at(expected, n.path).shape
            if got != want:
                raise ConfigError(
                    f"model.init_from hf:{self.directory}: tensor {n.hf!r} in "
                    f"{self.files[n.hf].name} has shape {tuple(arrays[n.hf].shape)}, but "
                    f"{name} {'/'.join(n.path)} needs {want}"
                    f"{' transposed' if n.transpose else ''}; the checkpoint does not "
                    "match its config.json or the model config"
                )
        return params

    def _read(self, hf_names: list[str], stage: str) -> dict[str, np.ndarray]:
        missing = [n for n in hf_names if n not in self.files]
        if missing:
            raise ConfigError(
                f"model.init_from hf:{self.directory}: the checkpoint has no tensor "
                f"{missing[0]!r} (needed for {stage}"
                f"{f', and {len(missing) - 1} more' if len(missing) > 1 else ''}); it is "
                f"incomplete or not a {self.config.family} checkpoint of this shape"
            )
        by_file: dict[Path, list[str]] = {}
        for n in hf_names:
            by_file.setdefault(self.files[n], []).append(n)
        arrays = {}
        for path, names in by_file.items():
            if not path.is_file():
                raise ConfigError(
                    f"model.init_from hf:{self.directory}: {INDEX_FILE} lists {path.name} "
                    f"(for {names[0]!r}) but the file is missing; copy every shard"
                )
            with safe_open(path, framework="numpy") as f:
                for n in names:
                    arrays[n] = _read_tensor(f, path, n)
        return arrays

    def params(self) -> Params:
        """The whole model as fp32 numpy params, blocks stacked on axis 0 (L, ...)."""
        L = self.config.num_layers
        blocks = [self.stage(f"block{i}") for i in range(L)]
        return {
            "embed": self.stage("embed"),
            "blocks": jax.tree.map(lambda *a: np.stack(a), *blocks),
            "head": self.stage("head"),
        }


def param_at(tree: Params, path: tuple[str, ...]) -> Any:
    """The leaf of a params tree at ``path``, e.g. ``('q_proj', 'kernel')``."""
    for key in path:
        tree = tree[key]
    return tree


def _read_tensor(f: Any, path: Path, name: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except TypeError:  # numpy has no bfloat16: read it through JAX on the CPU
        with jax.default_device(jax.devices("cpu")[0]), safe_open(path, framework="flax") as g:
            return np.asarray(g.get_tensor(name), np.float32)


def open_checkpoint(config: ModelConfig) -> HFCheckpoint | None:
    """The checkpoint ``config.init_from`` names, checked against ``config``; None
    when ``init_from`` is empty."""
    if not config.init_from:
        return None
    return HFCheckpoint(config.init_from.removeprefix("hf:"), config)
