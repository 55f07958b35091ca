"""Hugging Face checkpoints: import a stage at a time, and export, for GPT-2, the
Llama-shaped architectures (:data:`LLAMA_SHAPED`: Llama, Mistral, Mixtral, Qwen2/Qwen2.5,
Qwen3) and T5.

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
          ``lm_head.weight`` (V, D) <-> head ``lm_head/kernel`` (D, V). Mistral's and
          the Qwens' names are Llama's; Qwen2 adds ``self_attn.{q,k,v}_proj.bias`` <->
          ``{q,k,v}_proj/bias``, Qwen3 ``self_attn.{q,k}_norm.weight`` (K,) <->
          ``{q,k}_norm/scale``.
  Mixtral Llama's names, the MLP replaced by ``block_sparse_moe.gate.weight`` (E, D) <->
          ``moe/router`` (D, E), and per expert e ``block_sparse_moe.experts.{e}.w1``,
          ``w3``, ``w2`` (out, in) <-> row e of ``moe/gate_proj``, ``up_proj`` (E, D, F),
          ``down_proj`` (E, F, D), transposed: the layout of the Hub's checkpoints, which
          transformers' ``save_pretrained`` writes and export writes. Import also reads
          transformers 5's fused layout (``save_pretrained(save_original_format=False)``):
          ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` (E, 2F, D) holding gate then
          up, ``mlp.experts.down_proj`` (E, D, F).
  T5      ``shared.weight`` <-> embed ``shared``; each stack's
          ``{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight`` (NB, H)
          <-> embed ``{stack}_relative_attention_bias`` (HF keeps the table in the first
          block, hetjax in the embed stage that hands it to every block);
          ``encoder.final_layer_norm`` <-> embed ``encoder_final_layer_norm``;
          ``{stack}.block.{i}.layer.{j}`` <-> block i of group ``{stack}``, layer j being
          the self-attention (``SelfAttention``, ``layer_norm`` -> ``self_attention_layer_norm``),
          the decoder's cross-attention (``EncDecAttention``, ``cross_attention_layer_norm``)
          and the feed-forward layer (``DenseReluDense``, ``ff_layer_norm``); Linear
          weights transposed; ``decoder.final_layer_norm`` and ``lm_head`` <-> head.
          transformers 5 writes ``tie_word_embeddings: true`` for every T5 and says
          whether the head is T5 v1.0's (tied to ``shared``, the decoder's output scaled
          by D^-0.5) in ``scale_decoder_outputs``: that is what import reads.

Tied output heads have no tensor of their own (HF drops ``lm_head.weight`` too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from hetjax.config import ConfigError, ModelConfig
from hetjax.types import is_block, stage_layout, stage_names, stages_tree
from models import build_model

Params = dict[str, Any]


@dataclass(frozen=True)
class LlamaShaped:
    """A Hugging Face architecture hetjax imports and exports as ``model.family=llama``:
    the class export writes, the options of models/llama.py it always has, and
    transformers' defaults for the fields its config.json may leave out."""

    architecture: str  # the *ForCausalLM class
    kv_heads: int | None  # num_key_value_heads' default (None: num_attention_heads)
    norm_eps: float  # rms_norm_eps'
    rope_theta: float
    qkv_bias: bool = False  # model.qkv_bias: q/k/v biases (Qwen2)
    qk_norm: bool = False  # model.qk_norm: q/k RMSNorms per head (Qwen3)
    head_dim: int | None = None  # head_dim's default (None: hidden_size / heads)
    sliding_window: int | None = None  # sliding_window's default
    window_switch: bool = False  # the window applies only with use_sliding_window (Qwen)


# The supported architectures: the one place that says which model types import.
LLAMA_SHAPED = {
    "llama": LlamaShaped("LlamaForCausalLM", None, 1e-6, 10000.0),
    "mistral": LlamaShaped("MistralForCausalLM", 8, 1e-6, 10000.0, sliding_window=4096),
    "mixtral": LlamaShaped("MixtralForCausalLM", 8, 1e-5, 1e6),
    "qwen2": LlamaShaped("Qwen2ForCausalLM", 32, 1e-6, 10000.0, qkv_bias=True, window_switch=True),
    "qwen3": LlamaShaped(
        "Qwen3ForCausalLM", 32, 1e-6, 10000.0, qk_norm=True, head_dim=128, window_switch=True
    ),
}
SUPPORTED_MODEL_TYPES = {"gpt2": "gpt", **dict.fromkeys(LLAMA_SHAPED, "llama"), "t5": "t5"}


def llama_model_type(config: ModelConfig) -> str:
    """The architecture (:data:`LLAMA_SHAPED`) a ``model.family=llama`` config is
    exported as: mixtral with experts, qwen2 with q/k/v biases, qwen3 with q/k norms,
    mistral with a sliding window, else llama. Raises ConfigError for a combination no
    transformers architecture has."""
    options = [k for k in ("num_experts", "qkv_bias", "qk_norm") if getattr(config, k)]
    if len(options) > 1:
        raise ConfigError(
            f"model.{' and model.'.join(options)}: no Hugging Face architecture has both "
            "(Mixtral: experts; Qwen2: q/k/v biases; Qwen3: q/k norms), so this model "
            "cannot be exported; hetjax trains it, its checkpoints hold it"
        )
    if config.num_experts:
        return "mixtral"
    if config.qkv_bias:
        return "qwen2"
    if config.qk_norm:
        return "qwen3"
    return "mistral" if config.sliding_window else "llama"


# Options of models/llama.py that a GPT-2 or T5 checkpoint has off
LLAMA_OPTIONS_OFF = dict(qkv_bias=False, qk_norm=False, sliding_window=0)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorName:
    """One HF tensor and where it goes in a stage's params."""

    hf: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
    path: tuple[str, ...]  # e.g. ("q_proj", "kernel")
    transpose: bool  # HF (..., out, in) vs Flax (..., in, out): the last two axes swapped
    # Mixtral's per-expert tensors: this tensor is row ``expert`` of the leaf (E, ...)
    expert: int | None = None
    # transformers 5's fused experts: the leaf is slice k of n equal slices of the
    # tensor's axis -2, (k, n) (gate_up_proj (E, 2F, D) holds gate_proj, then up_proj)
    split: tuple[int, int] | None = None

    def hf_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this tensor when its leaf has ``leaf_shape``."""
        shape = list(leaf_shape[1:] if self.expert is not None else leaf_shape)
        if self.transpose:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        if self.split:
            shape[-2] *= self.split[1]
        return tuple(shape)

    def to_leaf(self, array: np.ndarray) -> np.ndarray:
        """This tensor as (the row ``expert`` of) its leaf: import's direction."""
        if self.split:
            k, n = self.split
            rows = array.shape[-2] // n
            array = array[..., k * rows : (k + 1) * rows, :]
        return np.swapaxes(array, -1, -2) if self.transpose else array

    def from_leaf(self, leaf: np.ndarray) -> np.ndarray:
        """This tensor taken from its leaf: export's direction (export writes no split
        tensors: it writes Mixtral's per-expert layout)."""
        if self.split:
            raise ValueError(f"{self.hf}: a split tensor is read, never written")
        array = leaf[self.expert] if self.expert is not None else leaf
        return np.swapaxes(array, -1, -2) if self.transpose else array


def stage_tensor_names(
    config: ModelConfig,
    stage: str,
    layer: int = 0,
    prefix: str | None = None,
    fused_experts: bool = False,
) -> list[TensorName]:
    """The HF tensors of one stage (``embed``, a block of a stage group by the group's
    name with ``layer``: ``block``, T5's ``encoder`` and ``decoder``; or ``head``).
    ``prefix``: GPT-2's module prefix, ``"transformer."`` (GPT2LMHeadModel, the
    default) or ``""`` (a bare GPT2Model). ``fused_experts``: a Mixtral's experts in
    transformers 5's fused layout instead of the per-expert one."""
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
            qkv = ("q_proj", "k_proj", "v_proj")
            return [
                rms(f"{h}.input_layernorm", "input_layernorm"),
                *(linear(f"{h}.self_attn.{n}", n) for n in qkv),
                *(
                    TensorName(f"{h}.self_attn.{n}.bias", (n, "bias"), False)
                    for n in (qkv if config.qkv_bias else ())
                ),
                *(
                    rms(f"{h}.self_attn.{n}", n)
                    for n in (("q_norm", "k_norm") if config.qk_norm else ())
                ),
                linear(f"{h}.self_attn.o_proj", "o_proj"),
                rms(f"{h}.post_attention_layernorm", "post_attention_layernorm"),
                *(
                    _expert_tensor_names(config, h, fused_experts)
                    if config.num_experts
                    else (linear(f"{h}.mlp.{n}", n) for n in ("gate_proj", "up_proj", "down_proj"))
                ),
            ]
        if stage == "head":
            names = [rms("model.norm", "norm")]
            if not config.tie_embeddings:
                names.append(linear("lm_head", "lm_head"))
            return names
    elif config.family == "t5":
        return _t5_tensor_names(config, stage, layer)
    else:
        raise ConfigError(
            f"model.family {config.family!r} has no Hugging Face mapping; HF import and "
            f"export support {', '.join(sorted(set(SUPPORTED_MODEL_TYPES.values())))}"
        )
    raise ValueError(f"unknown stage {stage!r}")


def _t5_tensor_names(config: ModelConfig, stage: str, layer: int) -> list[TensorName]:
    """A T5 stage's tensors (the table in the module docstring)."""
    if config.num_experts:
        raise ConfigError(
            f"model.num_experts ({config.num_experts}): a T5 with experts (the Switch "
            "Transformer's) has no Hugging Face mapping in hetjax (transformers' "
            "SwitchTransformers is not imported or exported); set model.num_experts=0"
        )
    norm = lambda hf, ours: TensorName(f"{hf}.weight", (ours, "scale"), False)
    linear = lambda hf, ours: TensorName(f"{hf}.weight", (*ours, "kernel"), True)
    table = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    if stage == "embed":
        return [
            TensorName("shared.weight", ("shared",), False),
            TensorName(f"encoder.{table}", ("encoder_relative_attention_bias",), False),
            TensorName(f"decoder.{table}", ("decoder_relative_attention_bias",), False),
            norm("encoder.final_layer_norm", "encoder_final_layer_norm"),
        ]
    if stage == "head":
        names = [norm("decoder.final_layer_norm", "final_layer_norm")]
        if not config.tie_embeddings:
            names.append(linear("lm_head", ("lm_head",)))
        return names
    if stage not in ("encoder", "decoder"):
        raise ValueError(f"unknown stage {stage!r}")
    h = f"{stage}.block.{layer}.layer"
    attention = lambda j, module: [
        linear(f"{h}.{j}.{module}.{p}", (module, p)) for p in ("q", "k", "v", "o")
    ]
    names = [norm(f"{h}.0.layer_norm", "self_attention_layer_norm"), *attention(0, "SelfAttention")]
    ff = 1
    if stage == "decoder":
        names += [norm(f"{h}.1.layer_norm", "cross_attention_layer_norm")]
        names += attention(1, "EncDecAttention")
        ff = 2
    ffn = ("wi_0", "wi_1", "wo") if config.feed_forward_proj == "gated-gelu" else ("wi", "wo")
    names.append(norm(f"{h}.{ff}.layer_norm", "ff_layer_norm"))
    names += [linear(f"{h}.{ff}.DenseReluDense.{w}", ("DenseReluDense", w)) for w in ffn]
    return names


def _expert_tensor_names(config: ModelConfig, h: str, fused: bool) -> list[TensorName]:
    """A Mixtral block's router and experts (``h``: the layer's prefix)."""
    if fused:
        experts = f"{h}.mlp.experts"
        return [
            TensorName(f"{h}.mlp.gate.weight", ("moe", "router"), True),
            TensorName(f"{experts}.gate_up_proj", ("moe", "gate_proj"), True, split=(0, 2)),
            TensorName(f"{experts}.gate_up_proj", ("moe", "up_proj"), True, split=(1, 2)),
            TensorName(f"{experts}.down_proj", ("moe", "down_proj"), True),
        ]
    moe = f"{h}.block_sparse_moe"
    names = [TensorName(f"{moe}.gate.weight", ("moe", "router"), True)]
    for e in range(config.num_experts):
        names += [
            TensorName(f"{moe}.experts.{e}.{w}.weight", ("moe", ours), True, expert=e)
            for w, ours in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        ]
    return names


# -- config.json <-> ModelConfig ---------------------------------------------------------


def hf_model_fields(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The ModelConfig fields a HF ``config.json`` (as a dict) fixes. Raises ConfigError
    for a model type or a feature hetjax does not implement."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; hetjax imports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints (models/gpt.py, models/llama.py, "
            "models/t5.py)"
        )

    def unsupported(key: str, value: Any, expected: Any) -> None:
        if value != expected:
            raise ConfigError(
                f"{where}: {key} = {value!r} is not supported (hetjax's {model_type} needs "
                f"{expected!r})"
            )

    if model_type == "t5":
        return _t5_fields(hf, where, unsupported)
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
            num_experts=0,
            **LLAMA_OPTIONS_OFF,
        )
    return _llama_fields(hf, where, model_type, unsupported)


def _llama_fields(
    hf: dict[str, Any], where: str, model_type: str, unsupported: Callable[[str, Any, Any], None]
) -> dict[str, Any]:
    """hf_model_fields of a Llama-shaped config.json (:data:`LLAMA_SHAPED`). A field
    config.json leaves out has transformers' default for the model type, as
    from_pretrained gives it; the shape fields must be there."""
    arch = LLAMA_SHAPED[model_type]

    def need(key: str) -> Any:
        if key not in hf:
            raise ConfigError(
                f"{where}: {key} is missing; a {model_type} config.json (as save_pretrained "
                "writes it) states the model's shape"
            )
        return hf[key]

    # transformers >= 5 writes rope_parameters, older versions rope_theta/rope_scaling
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
    if not arch.qkv_bias:  # qwen2's q/k/v biases are always there, its o_proj never has one
        unsupported("attention_bias", hf.get("attention_bias", False), False)
    unsupported("mlp_bias", hf.get("mlp_bias", False), False)
    unsupported("attention_dropout", float(hf.get("attention_dropout", 0.0)), 0.0)
    d, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = hf.get("head_dim", arch.head_dim)
    if head_dim not in (None, d // heads):
        raise ConfigError(
            f"{where}: head_dim = {head_dim} is not supported: hetjax's llama has heads of "
            f"hidden_size / num_attention_heads = {d // heads} features"
        )
    fields = dict(
        family="llama",
        num_layers=need("num_hidden_layers"),
        d_model=d,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", arch.kv_heads) or heads,
        d_ff=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        layer_norm_eps=hf.get("rms_norm_eps", arch.norm_eps),
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or arch.rope_theta),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias,
        qk_norm=arch.qk_norm,
        sliding_window=_sliding_window(hf, arch),
        num_experts=0,
        **scaling,
    )
    if model_type == "mixtral":
        fields.update(_mixtral_fields(hf, where, need))
    return fields


def _sliding_window(hf: dict[str, Any], arch: LlamaShaped) -> int:
    """model.sliding_window of a Llama-shaped config.json (0: none). Qwen's window
    applies only with ``use_sliding_window`` (and to the layers from
    ``max_window_layers`` on: a sequence within the window is unaffected either way)."""
    if arch.window_switch and not hf.get("use_sliding_window", False):
        return 0
    return int(hf.get("sliding_window", arch.sliding_window) or 0)


def _mixtral_fields(hf: dict[str, Any], where: str, need: Callable[[str], Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``mixtral`` config.json."""
    jitter = hf.get("router_jitter_noise", 0.0)
    if jitter:
        raise ConfigError(
            f"{where}: router_jitter_noise = {jitter!r} is not supported: hetjax's router "
            "has no jitter (transformers scales its inputs by random factors in training); "
            'set "router_jitter_noise": 0.0 in config.json to train without it'
        )
    # output_router_logits is not read: it decides whether transformers' forward adds
    # the load-balancing loss at all; hetjax adds it whenever router_aux_loss_coef > 0.
    return dict(
        num_experts=need("num_local_experts"),
        experts_per_token=need("num_experts_per_tok"),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _t5_fields(
    hf: dict[str, Any], where: str, unsupported: Callable[[str, Any, Any], None]
) -> dict[str, Any]:
    """hf_model_fields of a ``t5`` config.json, with T5Config's defaults for the fields
    it leaves out (the shape ones must be there)."""

    def need(key: str) -> Any:
        if key not in hf:
            raise ConfigError(f"{where}: {key} is missing; a t5 config.json states the shape")
        return hf[key]

    d, heads = need("d_model"), need("num_heads")
    if need("d_kv") != d // heads:
        raise ConfigError(
            f"{where}: d_kv = {hf['d_kv']} is not supported: hetjax's T5 has heads of "
            f"d_model / num_heads = {d // heads} (T5 v1.1 and Angel-PTM's shapes); a "
            "checkpoint with wider heads (t5-3b, t5-11b) cannot be imported"
        )
    projection = hf.get("feed_forward_proj", "relu")
    if projection not in ("gated-gelu", "relu"):
        unsupported("feed_forward_proj", projection, "gated-gelu or relu")
    if projection == "gated-gelu" and hf.get("dense_act_fn", "gelu_new") != "gelu_new":
        unsupported("dense_act_fn", hf["dense_act_fn"], "gelu_new")
    layers = need("num_layers")
    # transformers >= 5 always writes tie_word_embeddings true and keeps T5 v1.0's tied,
    # scaled head apart from v1.1's in scale_decoder_outputs; older ones wrote false for v1.1
    tied = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return dict(
        family="t5",
        num_layers=layers,
        num_decoder_layers=hf.get("num_decoder_layers") or layers,
        d_model=d,
        num_heads=heads,
        num_kv_heads=0,
        d_ff=need("d_ff"),
        vocab_size=need("vocab_size"),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        feed_forward_proj=projection,
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        decoder_start_token=hf.get("decoder_start_token_id", hf.get("pad_token_id", 0)),
        tie_embeddings=bool(tied),
        num_experts=0,
        **LLAMA_OPTIONS_OFF,
    )


def _effective(config: ModelConfig, field: str) -> Any:
    """A ModelConfig field with its 0-means-default resolved, for comparison."""
    if field == "num_decoder_layers":
        return config.decoder_layers
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
        self.model_type = hf["model_type"]
        self.files = self._tensor_files(spec)  # HF tensor name -> safetensors file
        self.aliases: dict[str, str] = {}  # a tensor read under another name
        self.prefix = None
        if config.family == "gpt":  # GPT2LMHeadModel vs a bare GPT2Model
            self.prefix = "" if "wte.weight" in self.files else "transformer."
        # Mixtral: the Hub's per-expert tensors, or transformers 5's fused ones
        self.fused_experts = "model.layers.0.mlp.experts.gate_up_proj" in self.files
        untied_t5 = config.family == "t5" and not config.tie_embeddings
        if untied_t5 and "lm_head.weight" not in self.files and "shared.weight" in self.files:
            # transformers 5 ties a T5's lm_head to shared unless both are saved: an
            # unscaled head reading the embedding is an untied one equal to it here
            self.files["lm_head.weight"] = self.files["shared.weight"]
            self.aliases["lm_head.weight"] = "shared.weight"
        model = build_model(config)
        self.stage_names = stage_names([(g.name, g.num_layers) for g in model.groups])
        self._check_tensor_names()
        # Expected param shapes of each stage kind: structure and shape checks.
        self.expected = {
            kind: jax.eval_shape(lambda k, kind=kind: model.init_stage(kind, k), jax.random.key(0))
            for kind in ("embed", *(g.name for g in model.groups), "head")
        }

    def _tensor_files(self, spec: str) -> dict[str, Path]:
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"model.init_from {spec!r}: {index} is not a safetensors index (JSON with "
                    f"a weight_map) ({type(e).__name__}: {e}); copy it again from the source"
                ) from e
            return {name: self.directory / file for name, file in weight_map.items()}
        if single.is_file():
            with _open_safetensors(single, self.directory) as f:
                return dict.fromkeys(f.keys(), single)
        present = sorted(p.name for p in self.directory.iterdir())
        raise ConfigError(
            f"model.init_from {spec!r}: neither {SINGLE_FILE} nor {INDEX_FILE} in "
            f"{self.directory} (found: {', '.join(present) or 'nothing'}); hetjax reads "
            "safetensors: save the model with save_pretrained(..., safe_serialization=True)"
        )

    def stage(self, name: str) -> Params:
        """fp32 numpy params of stage ``name``: ``embed``, a block (``block{i}``,
        ``encoder{i}``, ...) or ``head``, structured like ``model.init_stage``; reads only
        that stage's tensors."""
        kind = stage_layout(name)
        layer = int(name[len(kind) :]) if is_block(name) else 0
        names = stage_tensor_names(self.config, kind, layer, self.prefix, self.fused_experts)
        arrays = self._read(list(dict.fromkeys(n.hf for n in names)), name)
        expected = self.expected[kind]
        for n in names:
            want = param_at(expected, n.path).shape
            got = tuple(arrays[n.hf].shape)
            if got != n.hf_shape(want):
                how = []  # how the leaf comes from the tensor
                if n.expert is not None:
                    how.append(f"its row {n.expert}")
                if n.split:
                    how.append(f"{n.split[0] + 1} of {n.split[1]} slices of axis -2")
                if n.transpose:
                    how.append("transposed")
                tensor_shape = f" ({', '.join(how)}: {n.hf_shape(want)})" if how else ""
                raise ConfigError(
                    f"model.init_from hf:{self.directory}: tensor {n.hf!r} in "
                    f"{self.files[n.hf].name} has shape {got}, but {name} "
                    f"{'/'.join(n.path)} needs {want}{tensor_shape}; the checkpoint does "
                    "not match its config.json or the model config"
                )
        params: Params = {}
        for n in names:
            node = params
            for key in n.path[:-1]:
                node = node.setdefault(key, {})
            if n.expert is None:
                node[n.path[-1]] = np.ascontiguousarray(n.to_leaf(arrays[n.hf]), np.float32)
            else:  # filled row by row, where np.stack would make a third copy
                if n.path[-1] not in node:
                    node[n.path[-1]] = np.empty(param_at(expected, n.path).shape, np.float32)
                node[n.path[-1]][n.expert] = n.to_leaf(arrays[n.hf])
        if jax.tree.structure(params) != jax.tree.structure(expected):
            raise AssertionError(f"{name}: mapping gives {jax.tree.structure(params)}")
        return params

    def _read(self, hf_names: list[str], stage: str) -> dict[str, np.ndarray]:
        missing = [n for n in hf_names if n not in self.files]
        if missing:
            raise ConfigError(
                f"model.init_from hf:{self.directory}: the checkpoint has no tensor "
                f"{missing[0]!r} (needed for {stage}"
                f"{f', and {len(missing) - 1} more' if len(missing) > 1 else ''}); it is "
                f"incomplete or not a {self.model_type} checkpoint of this shape"
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
            with _open_safetensors(path, self.directory) as f:
                for n in names:
                    arrays[n] = _read_tensor(f, path, self.aliases.get(n, n))
        return arrays

    def _check_tensor_names(self) -> None:
        """Strict import: every tensor of the checkpoint is read into a param, or is a
        buffer transformers recomputes (:data:`IGNORED_BUFFERS`), or a copy of a tied
        tensor equal to it (:func:`tied_copies`); every tensor the model needs is
        there. Otherwise raises ConfigError naming the unexpected and the missing ones
        (a Qwen2 checkpoint whose config.json says llama would lose its q/k/v biases)."""
        wanted: set[str] = set()
        for name in self.stage_names:
            kind = stage_layout(name)
            layer = int(name[len(kind) :]) if is_block(name) else 0
            names = stage_tensor_names(self.config, kind, layer, self.prefix, self.fused_experts)
            wanted.update(n.hf for n in names)
        ignored = IGNORED_BUFFERS[self.config.family]
        copies = tied_copies(self.config, self.prefix)
        unexpected = sorted(
            n
            for n in self.files
            if n not in wanted and n not in copies and not (ignored and ignored.search(n))
        )
        missing = sorted(wanted - set(self.files), key=_natural)
        if unexpected or missing:
            unexpected.sort(key=_natural)
            parts = [
                f"{what} {_some(found)}"
                for found, what in (
                    (unexpected, "unexpected (the model would not read them):"),
                    (missing, "missing:"),
                )
                if found
            ]
            raise ConfigError(
                f"model.init_from hf:{self.directory}: the checkpoint's tensors are not "
                f"those of the {self.model_type} model its config.json describes; "
                f"{'; '.join(parts)}. Its config.json names the wrong model_type (a Qwen2's "
                "q/k/v biases need model_type qwen2) or the checkpoint is incomplete; "
                "hetjax imports every tensor or none"
            )
        present = [(copy, source) for copy, source in copies.items() if copy in self.files]
        for copy, source in present:
            arrays = self._read([copy, source], "the tied weights' check")
            if not np.array_equal(arrays[copy], arrays[source]):
                raise ConfigError(
                    f"model.init_from hf:{self.directory}: tensor {copy!r} differs from "
                    f"{source!r}, but config.json ties them (tie_word_embeddings); set "
                    '"tie_word_embeddings": false in config.json to import both'
                )

    def params(self) -> Params:
        """The whole model as fp32 numpy params, each group's blocks stacked on axis 0
        (L, ...)."""
        return stages_tree({name: self.stage(name) for name in self.stage_names})


def param_at(tree: Params, path: tuple[str, ...]) -> Any:
    """The leaf of a params tree at ``path``, e.g. ``('q_proj', 'kernel')``."""
    for key in path:
        tree = tree[key]
    return tree


# Buffers some checkpoints hold that transformers recomputes from config.json and
# ignores on load (its _keys_to_ignore_on_load_unexpected); hetjax ignores them too:
# Llama's rotary inv_freq (older transformers saved it), GPT-2's causal-mask buffers.
IGNORED_BUFFERS = {
    "gpt": re.compile(r"(^|\.)attn\.(masked_)?bias$"),
    "llama": re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
    "t5": None,
    "custom": None,
}


def tied_copies(config: ModelConfig, prefix: str | None = None) -> dict[str, str]:
    """Tensors a checkpoint may hold as copies of a tensor they are tied to (older
    transformers saved them): copy -> source. Import accepts a copy equal to its
    source and refuses one that differs."""
    if config.family == "t5":
        copies = {f"{s}.embed_tokens.weight": "shared.weight" for s in ("encoder", "decoder")}
        return {**copies, "lm_head.weight": "shared.weight"} if config.tie_embeddings else copies
    if config.family == "gpt":
        return {"lm_head.weight": f"{'transformer.' if prefix is None else prefix}wte.weight"}
    if config.family == "llama" and config.tie_embeddings:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def _natural(name: str) -> list:
    """Sort key: layer 10 after layer 9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _some(names: list[str], shown: int = 4) -> str:
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


@contextlib.contextmanager
def _open_safetensors(path: Path, directory: Path):
    """``safe_open`` of a checkpoint file, a damaged one (truncated, not safetensors)
    a ConfigError naming it."""
    try:
        with safe_open(path, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise ConfigError(
            f"model.init_from hf:{directory}: {path.name} cannot be read as safetensors "
            f"({e}); the file is truncated or damaged: copy or download it again"
        ) from e


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
