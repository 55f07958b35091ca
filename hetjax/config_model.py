"""The ``model`` section of the run configuration (:class:`ModelConfig`): the
transformer's shape and numerics. ``hetjax.config`` re-exports it; the rest of the
configuration lives there."""

from __future__ import annotations

import dataclasses
import re

from hetjax.config_values import ConfigError, _check, _choice

DTYPES = ("float32", "bfloat16", "float16")
FAMILIES = ("gpt", "llama", "t5", "custom")
ENCODER_DECODER = ("t5",)  # families whose model is an encoder and a decoder stack
FEED_FORWARDS = ("gated-gelu", "relu")  # t5: HF's feed_forward_proj
# data.objective: what a window of tokens trains (hetjax/data.py)
OBJECTIVES = ("lm", "prefix_lm", "span_corruption")
# model.attention: how the zoo's blocks compute attention (models/attention.py)
ATTENTIONS = ("auto", "blockwise", "reference", "fused")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Transformer shape and numerics."""

    family: str = "gpt"  # model family in the zoo (models/): gpt, llama, t5, or custom
    num_layers: int = 4  # blocks; t5: the encoder's
    # t5: the decoder's blocks (0: num_layers, as HF's num_decoder_layers=None)
    num_decoder_layers: int = 0
    d_model: int = 256
    num_heads: int = 4
    d_ff: int = 0  # 0 means 4 * d_model
    vocab_size: int = 256  # 256 = byte-level tokens of the embedded corpus
    max_seq_len: int = 256
    param_dtype: str = "float32"  # master copy of the parameters
    compute_dtype: str = "float32"  # matmuls; fp32 is the fast path on CPU, bf16 on GPU
    init_std: float = 0.02  # gpt, llama, custom (t5 initialises as HF's T5 does)
    # epsilon of every norm: LayerNorm (gpt), RMSNorm (llama, t5; T5 uses 1e-6)
    layer_norm_eps: float = 1e-5
    remat: bool = False  # offload.mode=none: recompute each block in backward (jax.checkpoint)
    # gpt, llama: auto (cuDNN's fused kernel where it supports the shape and dtype, else
    # blockwise), blockwise (online softmax over tiles, no T x T tensor), reference
    # (the whole score matrix), fused (cuDNN); models/attention.py. t5: auto or
    # reference (its position bias is added to the whole score matrix)
    attention: str = "auto"
    attention_block: int = 0  # blockwise attention's tile side; 0: 256 (at most seq_len)
    # llama: grouped-query attention with num_kv_heads key/value heads (0: num_heads)
    num_kv_heads: int = 0
    rope_theta: float = 10000.0  # llama: rotary embedding base
    # llama: Llama 3.1 ("llama3") rotary frequency rescaling for long contexts; factor 0:
    # none. Wavelengths above original_max_len / low_freq_factor are stretched by factor,
    # below original_max_len / high_freq_factor kept, in between interpolated.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = True  # output head = token embedding; gpt always ties
    # llama: biases on the query, key and value projections (Qwen2, Qwen2.5)
    qkv_bias: bool = False
    # llama: an RMSNorm over each query and key head's features before the rotary
    # embedding (Qwen3)
    qk_norm: bool = False
    # llama: the attention window of a Mistral/Mixtral checkpoint (0: none). hetjax's
    # attention reads every earlier position, which equals the window's as long as no
    # sequence is longer: a longer train.seq_len (or generation) is refused
    sliding_window: int = 0
    # llama: mixture-of-experts MLP (Mixtral / Qwen-MoE style): num_experts SwiGLU experts
    # of width d_ff each, 0 for the dense MLP. t5: Switch Transformer's, every other
    # layer's feed-forward layer num_experts experts (T5-MoE)
    num_experts: int = 0
    experts_per_token: int = 2  # MoE: experts each token is routed to (top-k; t5: 1)
    # MoE: weight of the load-balancing auxiliary loss (transformers' Mixtral
    # load_balancing_loss_func; t5: Switch's, per stack) added to the training loss; 0
    # disables it
    router_aux_loss_coef: float = 0.0
    # t5: the feed-forward layer, HF's feed_forward_proj: gated-gelu (T5 v1.1: tanh-GELU
    # gate times a linear unit) or relu (T5 v1.0, Switch Transformer)
    feed_forward_proj: str = "gated-gelu"
    relative_attention_num_buckets: int = 32  # t5: relative position buckets per stack
    relative_attention_max_distance: int = 128  # t5: distance from which buckets are shared
    decoder_start_token: int = 0  # t5: the decoder's first input token (T5's pad id)
    # "hf:<dir>": start from a Hugging Face checkpoint directory (hetjax/hf.py)
    init_from: str = ""
    # family=custom: "package.module:factory", factory(ModelConfig) -> a staged model
    # (models/staged.py)
    custom: str = ""

    def __post_init__(self):
        self._check_shape()
        self._check_positions()
        self._check_llama_options()
        self._check_head()
        self._check_experts()
        self._check_encoder_decoder()
        self._check_source()

    def _check_shape(self) -> None:
        """The family, the attention and the sizes of the layers and heads."""
        _choice("model", "family", self.family, FAMILIES)
        _choice("model", "attention", self.attention, ATTENTIONS)
        _check(
            self.attention_block >= 0,
            "model.attention_block",
            "must be >= 0 (0 means 256)",
            self.attention_block,
        )
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len"):
            _check(getattr(self, name) >= 1, f"model.{name}", "must be >= 1", getattr(self, name))
        _check(self.d_ff >= 0, "model.d_ff", "must be >= 0 (0 means 4 * d_model)", self.d_ff)
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"config key 'model.d_model' ({self.d_model}) must be divisible by "
                f"'model.num_heads' ({self.num_heads})"
            )
        _choice("model", "param_dtype", self.param_dtype, ("float32",))
        _choice("model", "compute_dtype", self.compute_dtype, DTYPES)
        _check(self.init_std > 0, "model.init_std", "must be > 0", self.init_std)
        _check(self.layer_norm_eps > 0, "model.layer_norm_eps", "must be > 0", self.layer_norm_eps)
        _check(
            self.num_kv_heads >= 0,
            "model.num_kv_heads",
            "must be >= 0 (0 means num_heads)",
            self.num_kv_heads,
        )
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"config key 'model.num_heads' ({self.num_heads}) must be divisible by "
                f"'model.num_kv_heads' ({self.num_kv_heads}): each key/value head serves "
                "a whole group of query heads"
            )
        if self.kv_heads != self.num_heads and self.family == "gpt":
            raise ConfigError(
                f"config key 'model.num_kv_heads' ({self.num_kv_heads}): family 'gpt' has "
                "multi-head attention only; leave it 0 or use model.family='llama'"
            )

    def _check_positions(self) -> None:
        """Rotary positions and their scaling."""
        _check(self.rope_theta > 0, "model.rope_theta", "must be > 0", self.rope_theta)
        _check(
            self.rope_scaling_factor == 0 or self.rope_scaling_factor >= 1,
            "model.rope_scaling_factor",
            "must be 0 (no scaling) or >= 1",
            self.rope_scaling_factor,
        )
        if self.rope_scaling_factor and self.family == "gpt":
            raise ConfigError(
                "config key 'model.rope_scaling_factor': family 'gpt' has learned position "
                "embeddings, not rotary ones; leave it 0"
            )
        _check(
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
            "model.rope_low_freq_factor",
            "must be > 0 and below model.rope_high_freq_factor",
            self.rope_low_freq_factor,
        )
        _check(
            self.rope_original_max_len >= 1,
            "model.rope_original_max_len",
            "must be >= 1",
            self.rope_original_max_len,
        )

    def _check_head(self) -> None:
        """The output head: tied to the token embedding or not."""
        if self.family == "gpt" and not self.tie_embeddings:
            raise ConfigError(
                "config key 'model.tie_embeddings': family 'gpt' always ties its output "
                "head to the token embedding (as GPT-2 does); set it true or use "
                "model.family='llama'"
            )

    def _check_experts(self) -> None:
        """The mixture-of-experts MLP."""
        _check(self.num_experts >= 0, "model.num_experts", "must be >= 0", self.num_experts)
        if self.num_experts:
            if self.family not in ("llama", "t5"):
                raise ConfigError(
                    f"config key 'model.num_experts' ({self.num_experts}): only families "
                    f"'llama' and 't5' have a mixture-of-experts MLP, but model.family is "
                    f"{self.family!r}"
                )
            _check(
                1 <= self.experts_per_token <= self.num_experts,
                "model.experts_per_token",
                f"must be between 1 and model.num_experts ({self.num_experts})",
                self.experts_per_token,
            )
        _check(
            self.router_aux_loss_coef >= 0,
            "model.router_aux_loss_coef",
            "must be >= 0 (0 disables the auxiliary loss)",
            self.router_aux_loss_coef,
        )

    def _check_source(self) -> None:
        """Where the model comes from: a Hugging Face checkpoint, a custom factory."""
        if self.init_from and not self.init_from.startswith("hf:"):
            raise ConfigError(
                f"config key 'model.init_from' must be empty or 'hf:<checkpoint dir>', "
                f"got {self.init_from!r}"
            )
        if self.family == "custom":
            if not re.fullmatch(r"[\w.]+:\w+", self.custom):
                raise ConfigError(
                    "config key 'model.custom' must name the factory of a custom model as "
                    f"'package.module:function' when model.family='custom', got {self.custom!r}"
                )
        elif self.custom:
            raise ConfigError(
                f"config key 'model.custom' ({self.custom!r}) is used only with "
                f"model.family='custom', but model.family is {self.family!r}"
            )

    def _check_llama_options(self) -> None:
        _check(
            self.sliding_window >= 0,
            "model.sliding_window",
            "must be >= 0 (0: no window)",
            self.sliding_window,
        )
        for key in ("qkv_bias", "qk_norm", "sliding_window"):
            if getattr(self, key) and self.family != "llama":
                raise ConfigError(
                    f"config key 'model.{key}' ({getattr(self, key)!r}) is an option of "
                    f"family 'llama' (models/llama.py), but model.family is {self.family!r}"
                )

    def _check_encoder_decoder(self) -> None:
        _check(
            self.num_decoder_layers >= 0,
            "model.num_decoder_layers",
            "must be >= 0 (0 means num_layers)",
            self.num_decoder_layers,
        )
        _choice("model", "feed_forward_proj", self.feed_forward_proj, FEED_FORWARDS)
        for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
            _check(getattr(self, name) >= 2, f"model.{name}", "must be >= 2", getattr(self, name))
        _check(
            0 <= self.decoder_start_token < self.vocab_size,
            "model.decoder_start_token",
            f"must be a token id below model.vocab_size ({self.vocab_size})",
            self.decoder_start_token,
        )
        if self.family not in ENCODER_DECODER:
            if self.num_decoder_layers:
                raise ConfigError(
                    f"config key 'model.num_decoder_layers' ({self.num_decoder_layers}): "
                    f"family {self.family!r} is decoder-only (model.num_layers counts its "
                    "blocks); leave it 0 or use model.family='t5'"
                )
            return
        if self.attention not in ("auto", "reference"):
            raise ConfigError(
                f"config key 'model.attention' is {self.attention!r}, but family "
                f"{self.family!r} adds a relative position bias to the whole score matrix, "
                "which only the reference attention takes; set model.attention=auto"
            )
        if self.num_kv_heads and self.num_kv_heads != self.num_heads:
            raise ConfigError(
                f"config key 'model.num_kv_heads' ({self.num_kv_heads}): family "
                f"{self.family!r} has multi-head attention only; leave it 0"
            )
        if self.rope_scaling_factor:
            raise ConfigError(
                "config key 'model.rope_scaling_factor': family 't5' has relative position "
                "buckets, not rotary embeddings; leave it 0"
            )
        if self.num_experts and self.experts_per_token != 1:
            raise ConfigError(
                f"config key 'model.experts_per_token' ({self.experts_per_token}): family "
                "'t5''s mixture of experts routes each token to its top expert (the Switch "
                "Transformer's top-1 routing); set model.experts_per_token=1"
            )
        for key, layers in (
            ("num_layers", self.num_layers),
            ("num_decoder_layers", self.decoder_layers),
        ):
            if self.num_experts and layers % 2:
                raise ConfigError(
                    f"config key 'model.{key}' ({layers}): a T5 with experts (Switch) makes "
                    "every other layer's feed-forward layer experts, so each block is a "
                    "dense and a sparse layer and a stack's layers must be even"
                )

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model is an encoder and a decoder stack (``data.objective``
        prefix_lm) rather than a decoder alone."""
        return self.family in ENCODER_DECODER

    @property
    def decoder_layers(self) -> int:
        """An encoder-decoder model's decoder blocks (``num_decoder_layers``, or
        ``num_layers`` when 0); 0 for a decoder-only one."""
        return (self.num_decoder_layers or self.num_layers) if self.encoder_decoder else 0

    @property
    def layers_per_block(self) -> int:
        """Layers one block (a stage) holds: 2 for a T5 with experts (a dense and a
        sparse layer, Switch's every other layer), else 1."""
        return 2 if self.encoder_decoder and self.num_experts else 1

    @property
    def num_blocks(self) -> int:
        """Blocks (stages) in every stack: ``num_layers``, plus the decoder's of an
        encoder-decoder model, over ``layers_per_block``."""
        return (self.num_layers + self.decoder_layers) // self.layers_per_block

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` when it is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads
