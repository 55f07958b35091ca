"""Typed run configuration: the one place where defaults live (the ``model`` section's
in ``config_model.py``, the ``offload`` and ``memory`` sections' in
``config_offload.py``, the ``distributed`` section's in ``config_distributed.py``,
re-exported here).

A run is described by a frozen :class:`Config` made of one frozen dataclass per section
(``model``, ``train``, ``optimizer``, ``offload``, ``memory``, ``data``,
``checkpoint``, ``distributed``). Each section
validates itself when built, so an impossible value fails at start-up with a message
that names the key.

Config files in ``configs/`` are short Python files with a ``get_config()`` that starts
from ``Config()`` and changes only what differs::

    def get_config():
        return Config().replace(model=dict(num_layers=12, d_model=768, num_heads=12))

On the command line every key can be overridden with a dotted name,
``--config.train.steps=50``; values are parsed into the field's type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import traceback
import types
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIGS_DIR",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "KEEP_LEVELS",
    "MemoryConfig",
    "ModelConfig",
    "OFFLOAD_MODES",
    "OffloadConfig",
    "OptimizerConfig",
    "SWAP_LEVELS",
    "TrainConfig",
    "format_bytes",
    "load_config",
    "parse_bytes",
]

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


from hetjax import support  # noqa: E402 (imports nothing from the project)
from hetjax.config_distributed import REDUCE_DTYPES, DistributedConfig  # noqa: E402, F401
from hetjax.config_model import OBJECTIVES, ModelConfig  # noqa: E402 (re-exported)
from hetjax.config_offload import (  # noqa: E402 (re-exported)
    KEEP_LEVELS,
    OFFLOAD_MODES,
    SWAP_LEVELS,
    MemoryConfig,
    OffloadConfig,
)
from hetjax.config_values import (  # noqa: E402 (after CONFIGS_DIR: the values' module)
    ConfigError,
    _check,
    _choice,
    _field_types,
    _parse_value,
    format_bytes,
    parse_bytes,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop. ``batch_size`` is the global batch of one optimizer step, in
    sequences; with ``grad_accum = A`` it is split into A micro-batches of
    ``batch_size / A`` rows, so the data order does not depend on A."""

    steps: int = 250
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 25
    eval_batches: int = 8  # validation batches at the end of the run
    eval_every: int = 0  # validation every N steps too (loss.png's curve); 0: at the end only
    loss_scale_init: float = 2.0**15  # fp16 compute only: initial dynamic loss scale
    loss_scale_period: int = 1000  # fp16: steps without overflow before the scale doubles
    # a step whose loss or gradient is not finite never updates the state; then:
    # ``skip`` goes on with the next batch, ``rollback`` restores the newest checkpoint
    # and skips the batches from there to the bad one, ``stop`` ends the run (an error)
    on_nonfinite: str = "skip"
    max_nonfinite: int = 10  # skip / rollback: stop after this many bad steps in a row
    # a step whose loss exceeds spike_factor x the median loss of the last spike_window
    # updating steps is handled as a non-finite one (on_nonfinite); 0: off
    spike_factor: float = 0.0
    spike_window: int = 50
    # record every N-th step's timeline into <workdir>/trace (hetjax/timeline.py); 0: off
    trace_every: int = 0
    # a run that streamed on one device: time this many in-memory steps after it (the
    # whole state on the device, no budgets), the run summary's reference step
    # (hetjax/summary.py; data-parallel runs skip it); 0: off
    in_memory_steps: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1", getattr(self, name))
        _check(self.eval_batches >= 0, "train.eval_batches", "must be >= 0", self.eval_batches)
        _check(self.trace_every >= 0, "train.trace_every", "must be >= 0", self.trace_every)
        _check(self.eval_every >= 0, "train.eval_every", "must be >= 0", self.eval_every)
        _check(
            self.in_memory_steps >= 0, "train.in_memory_steps", "must be >= 0", self.in_memory_steps
        )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"config key 'train.batch_size' ({self.batch_size}) must be divisible by "
                f"'train.grad_accum' ({self.grad_accum}): the global batch is split evenly "
                "into micro-batches"
            )
        _check(
            self.loss_scale_init >= 1, "train.loss_scale_init", "must be >= 1", self.loss_scale_init
        )
        _choice("train", "on_nonfinite", self.on_nonfinite, ("skip", "rollback", "stop"))
        _check(self.max_nonfinite >= 1, "train.max_nonfinite", "must be >= 1", self.max_nonfinite)
        _check(
            self.spike_factor == 0 or self.spike_factor > 1,
            "train.spike_factor",
            "must be 0 (off) or > 1",
            self.spike_factor,
        )
        _check(self.spike_window >= 1, "train.spike_window", "must be >= 1", self.spike_window)
        _check(
            self.loss_scale_period >= 1,
            "train.loss_scale_period",
            "must be >= 1",
            self.loss_scale_period,
        )

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum


OPTIMIZERS = ("adamw", "adam", "lion", "sgd")
NATIVE_OPTIMIZERS = ("adamw", "adam")  # the host optimizer's native kernel (native.py)
STATE_DTYPES = ("float32", "bfloat16", "int8")  # optimizer.state_dtype (state_format.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optax optimizer, schedule and clipping. Weight decay applies to weight matrices
    only (kernels and embeddings), not to biases or norm scales, as in GPT-2 training."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    # stream mode: ``sync`` updates equal ordinary training; ``lockfree`` lets forward and
    # backward run on params up to ``max_staleness`` steps old (hetjax/optimizer/update_loop.py)
    mode: str = "sync"
    max_staleness: int = 1
    # sync mode with clipping: ``adaptive`` updates during backward as if clipping did not
    # bind unless it bound in the step before (then after backward, once); ``always``
    # every step; ``never`` updates after backward, clipped or not, so no update is ever
    # dropped (hetjax/optimizer/update_loop.py; NVMe state in place: nvme_copies.py)
    speculation: str = "adaptive"
    # the host optimizer's kernel for adam/adamw: ``auto`` native when it builds, else
    # optax; ``native`` (required) or ``optax`` (hetjax/optimizer/native.py)
    host_kernel: str = "auto"
    # the dtype the optimizer's moments (Adam's mu and nu, Lion's mu, SGD's trace) are
    # kept in: ``float32``, ``bfloat16`` or ``int8`` (blockwise, a scale per block), in
    # every tier and on any number of devices; the master stays fp32
    # (hetjax/state_format.py, moments.py)
    state_dtype: str = "float32"

    def __post_init__(self):
        _choice("optimizer", "name", self.name, OPTIMIZERS)
        _choice("optimizer", "state_dtype", self.state_dtype, STATE_DTYPES)
        _choice("optimizer", "host_kernel", self.host_kernel, ("auto", "native", "optax"))
        _check(
            self.host_kernel != "native" or self.name in NATIVE_OPTIMIZERS,
            "optimizer.host_kernel",
            f"must be auto or optax with optimizer.name={self.name} (native runs adam and "
            "adamw only)",
            self.host_kernel,
        )
        _choice("optimizer", "mode", self.mode, ("sync", "lockfree"))
        _choice("optimizer", "speculation", self.speculation, ("adaptive", "always", "never"))
        _check(
            self.max_staleness >= 0, "optimizer.max_staleness", "must be >= 0", self.max_staleness
        )
        _choice("optimizer", "schedule", self.schedule, ("constant", "cosine"))
        _check(self.lr > 0, "optimizer.lr", "must be > 0", self.lr)
        _check(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", self.weight_decay)
        for name in ("b1", "b2", "momentum"):
            v = getattr(self, name)
            _check(0 <= v < 1, f"optimizer.{name}", "must be in [0, 1)", v)
        _check(self.eps > 0, "optimizer.eps", "must be > 0", self.eps)
        _check(
            self.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables)", self.grad_clip
        )
        _check(self.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0", self.warmup_steps)
        _check(
            0 <= self.min_lr_ratio <= 1,
            "optimizer.min_lr_ratio",
            "must be in [0, 1]",
            self.min_lr_ratio,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Token data. ``path`` empty: the embedded corpus (the running Python's standard
    library sources as bytes, no download). Otherwise a flat uint16 ``.bin`` (nanoGPT's
    format) or a 1-D integer ``.npy`` file of token ids."""

    path: str = ""
    shuffle: bool = True
    val_fraction: float = 0.05  # held-out tail of the token stream
    corpus_bytes: int = 8_000_000  # size cap of the embedded corpus
    # lm: windows of seq_len + 1 tokens, the next token of each predicted (decoder-only
    # models); prefix_lm: windows of 2 seq_len, the encoder reads the first half and the
    # decoder predicts the second; span_corruption: T5's (encoder-decoder models). See
    # running.md#data-order
    objective: str = "lm"
    # span_corruption: the share of a window's tokens the decoder predicts, and the mean
    # length of the spans they come in (T5's 0.15 and 3)
    noise_density: float = 0.15
    mean_noise_span: float = 3.0
    # tokens: path is a token file (or empty); jsonl: path holds prompt/completion,
    # messages or text records, packed into rows with a loss on completions only
    # (hetjax/instruct.py)
    format: str = "tokens"
    # jsonl: a tokenizer.json or the directory holding it (an HF checkpoint's); empty: the
    # model.init_from directory's when it has one, else bytes (hetjax/chat.py)
    tokenizer: str = ""

    def __post_init__(self):
        _choice("data", "objective", self.objective, OBJECTIVES)
        _choice("data", "format", self.format, ("tokens", "jsonl"))
        _check(
            self.format == "tokens" or (self.path and self.objective in ("lm", "prefix_lm")),
            "data.format", "'jsonl' needs data.path (a .jsonl file) and data.objective 'lm' "
            "(decoder-only) or 'prefix_lm' (T5)",
            self.format,
        )  # fmt: skip
        _check(
            0 < self.noise_density < 1, "data.noise_density", "must be in (0, 1)",
            self.noise_density,
        )  # fmt: skip
        _check(
            self.mean_noise_span >= 1, "data.mean_noise_span", "must be >= 1",
            self.mean_noise_span,
        )  # fmt: skip
        _check(
            0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)", self.val_fraction
        )
        _check(
            self.corpus_bytes >= 10_000, "data.corpus_bytes", "must be >= 10000", self.corpus_bytes
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints of the complete training state (hetjax/checkpoint.py).

    A checkpoint is written every ``every_steps`` steps, at least every ``every_minutes``
    minutes, when training ends and when the run is preempted (SIGTERM, SIGUSR1), in two
    phases, never copying the state into RAM: the step waits while the NVMe tier's
    committed files are hard-linked into it (``link_nvme``); the rest is written stage by
    stage from the buffers it lives in, in the background while training goes on; it
    counts only once complete (hetjax/checkpoint_state.py).
    A run started on a workdir that has checkpoints continues from the newest complete
    one (``resume=auto``); ``resume=never`` refuses to touch them unless ``overwrite``
    is set, which deletes them."""

    every_steps: int = 100  # 0: no periodic checkpoints
    every_minutes: float = 0.0  # also one when this long has passed since the last; 0: off
    at_end: bool = True  # a checkpoint when training ends
    keep: int = 3  # complete checkpoints kept (oldest deleted first)
    dir: str = ""  # "": <workdir>/checkpoints
    resume: str = "auto"  # auto | never
    overwrite: bool = False  # resume=never: delete existing checkpoints and start fresh
    async_save: bool = True  # persist in the background (False: the step waits)
    # hard-link NVMe-resident state where the filesystem allows (false: copy it, e.g. for
    # backup tools that rewrite files in place); another filesystem always copies
    link_nvme: bool = True
    # with link_nvme: every copy_every-th checkpoint of a run (the 1st, K+1-th, ...) copies
    # the NVMe state, a window at a time, instead of linking it: a second copy of its
    # bytes, which a hard link (the live files' own blocks) is not; 0: never
    copy_every: int = 0

    def __post_init__(self):
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", self.every_steps)
        _check(self.copy_every >= 0, "checkpoint.copy_every", "must be >= 0", self.copy_every)
        _check(
            self.every_minutes >= 0, "checkpoint.every_minutes", "must be >= 0", self.every_minutes
        )
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1", self.keep)
        _choice("checkpoint", "resume", self.resume, ("auto", "never"))

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_minutes > 0 or self.at_end


_SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "offload": OffloadConfig,
    "memory": MemoryConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run configuration; see the module docstring."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        self._check_sequence()
        self._check_objective()
        self._check_blocks()
        self._check_expert_parallel()
        # what the parallelism does not support (hetjax/support.py): these two first
        asked = support.asked(self)
        self._refuse_unsupported([f for f in asked if f in ("device_cache", "in_memory")])
        self._check_rows()
        self._refuse_unsupported(asked)

    def _check_sequence(self) -> None:
        """The training sequence against the model's positions and window."""
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"config key 'train.seq_len' ({self.train.seq_len}) exceeds "
                f"'model.max_seq_len' ({self.model.max_seq_len}); raise model.max_seq_len "
                "or shorten train.seq_len"
            )
        window = self.model.sliding_window
        if window and self.train.seq_len > window:
            raise ConfigError(
                f"config key 'train.seq_len' ({self.train.seq_len}) exceeds "
                f"'model.sliding_window' ({window}): hetjax's attention has no window and "
                "reads every earlier position, which equals the window's only up to its "
                f"length; set train.seq_len <= {window}"
            )

    def _check_blocks(self) -> None:
        """Kept, swapped and device-cached counts against the model's blocks and stages."""
        blocks = self.model.num_blocks
        counted = (
            f"'model.num_layers' + 'model.num_decoder_layers' ({blocks} blocks)"
            if self.model.encoder_decoder
            else f"'model.num_layers' ({blocks})"
        )
        if self.offload.keep_blocks > blocks:
            raise ConfigError(
                f"config key 'offload.keep_blocks' ({self.offload.keep_blocks}) exceeds "
                f"{counted}: at most every block keeps its activations"
            )
        kept_swapped = self.offload.keep_blocks + self.offload.swap_blocks
        if kept_swapped > blocks:
            raise ConfigError(
                f"config keys 'offload.keep_blocks' + 'offload.swap_blocks' ({kept_swapped}) "
                f"exceed {counted}: a block keeps or swaps its activations, not both; lower "
                "one of them"
            )
        stages = blocks + 2  # embed, the blocks, head
        if self.offload.optimizer_device_stages > stages:
            raise ConfigError(
                f"config key 'offload.optimizer_device_stages' "
                f"({self.offload.optimizer_device_stages}) exceeds the number of stages, "
                f"{stages} (embed, {counted}, head); at most every stage keeps its "
                "optimizer state on the device"
            )

    def _check_expert_parallel(self) -> None:
        """Expert parallelism against the model's experts."""
        dist = self.distributed
        experts = dist.expert_parallel
        if experts > 1 and not self.model.num_experts:
            raise ConfigError(
                f"config key 'distributed.expert_parallel' ({experts}): expert parallelism "
                "splits a mixture of experts' experts, and this model has none "
                "(model.num_experts is 0); leave it 1"
            )
        why = support.parallel_refusal(support.parallelism(dist), support.model_kinds(self.model))
        if why:
            raise ConfigError(
                f"config key 'distributed.expert_parallel' ({experts}): {why}; leave it 1"
            )
        if experts > 1 and self.model.num_experts % experts:
            raise ConfigError(
                f"config key 'distributed.expert_parallel' ({experts}) must divide "
                f"model.num_experts ({self.model.num_experts}): each device holds an equal "
                "share of every block's experts"
            )

    def _check_rows(self) -> None:
        """A micro-batch's rows split over the devices and into chunks."""
        dist = self.distributed
        data, experts = dist.data_parallel, dist.expert_parallel
        # the devices the rows split over (a model axis's devices share theirs)
        row_devices = dist.data_parallel * experts
        if row_devices > 1 and self.train.micro_batch_size % row_devices:
            over = f"distributed.data_parallel={data}"
            if experts > 1:
                over += f" x distributed.expert_parallel={experts}"
            raise ConfigError(
                f"config key 'train.batch_size' ({self.train.batch_size}) split into "
                f"{self.train.grad_accum} micro-batches of {self.train.micro_batch_size} rows "
                f"must divide evenly over {over} devices; make batch_size / grad_accum a "
                f"multiple of it ({row_devices})"
            )
        chunks = self.offload.batch_chunks
        # a device's rows (every device, 0: known once the devices are; checked then
        # by the runtime's stage functions)
        rows = self.train.micro_batch_size // max(row_devices, 1)
        if chunks > 1 and rows % chunks:
            raise ConfigError(
                f"config key 'offload.batch_chunks' ({chunks}) must divide a device's rows "
                f"of a micro-batch ({rows}: train.batch_size {self.train.batch_size} / "
                f"train.grad_accum {self.train.grad_accum}"
                + (f" / {dist.devices} devices" if dist.devices > 1 else "")
                + "); choose a divisor of it"
            )

    def _refuse_unsupported(self, features: list[str]) -> None:
        """Raises the support matrix's error (hetjax/support.py: the key, why, the fix)
        for the first of ``features`` this config's parallelism does not support."""
        for feature in features:
            message = support.refusal(self, feature)
            if message:
                raise ConfigError(message)

    def _check_objective(self) -> None:
        family, objective = self.model.family, self.data.objective
        if objective != "lm" and not self.model.encoder_decoder:
            raise ConfigError(
                f"config key 'data.objective' is {objective!r}, whose rows begin with an "
                f"encoder's input, but model.family {family!r} is decoder-only; set "
                "data.objective=lm, or model.family=t5"
            )
        if objective == "lm" and self.model.encoder_decoder:
            raise ConfigError(
                f"config key 'data.objective' is 'lm', but model.family {family!r} is an "
                "encoder-decoder model, whose encoder reads a prefix; set "
                "data.objective=prefix_lm or span_corruption"
            )
        if objective == "span_corruption" and self.offload.activations == "nvme":
            raise ConfigError(
                "config key 'offload.activations': nvme swaps rows of one size, and span "
                "corruption's decoder is shorter than its encoder; use device or host "
                "with data.objective=span_corruption"
            )

    # -- building ---------------------------------------------------------------------

    def replace(self, **sections: dict[str, Any]) -> Config:
        """Returns a copy with some fields changed: ``replace(model=dict(num_layers=8))``.
        Values are typed Python values (already parsed); keys are checked."""
        flat = {}
        for section, changes in sections.items():
            if section not in _SECTIONS:
                raise ConfigError(_unknown_key_message(section, list(_SECTIONS)))
            if not isinstance(changes, dict):
                raise ConfigError(
                    f"replace({section}=...) takes a dict of field changes, got {changes!r}"
                )
            for name, value in changes.items():
                flat[f"{section}.{name}"] = value
        return self._with(flat, parse=False)

    def override(self, dotted: dict[str, str]) -> Config:
        """Returns a copy with command-line overrides applied: ``{"train.steps": "50"}``.
        String values are parsed into each field's type."""
        return self._with(dotted, parse=True)

    def _with(self, flat: dict[str, Any], parse: bool) -> Config:
        by_section: dict[str, dict[str, Any]] = {}
        valid = all_keys()
        for key, value in flat.items():
            if key not in valid:
                raise ConfigError(_unknown_key_message(key, valid))
            section, name = key.split(".", 1)
            if parse:
                value = _parse_value(key, value, _field_types(_SECTIONS[section])[name])
            by_section.setdefault(section, {})[name] = value
        new = {}
        for section, changes in by_section.items():
            try:
                new[section] = dataclasses.replace(getattr(self, section), **changes)
            except TypeError as e:  # a wrong Python type passed through replace()
                raise ConfigError(f"section '{section}': {e}") from e
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. ``train.steps``."""
    return [f"{s}.{f.name}" for s, c in _SECTIONS.items() for f in dataclasses.fields(c)]


# Keys that were renamed: the old name is refused naming the new one; a run's own
# config.json written before the rename reads with the new name (``with_renamed_keys``).
RENAMED = {"memory.nvme_generations": "memory.nvme_copies"}


def with_renamed_keys(saved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A saved config's sections (``Config.to_dict``'s shape) with each old key of
    :data:`RENAMED` under its new name."""
    out = {section: dict(values) for section, values in saved.items()}
    for old, new in RENAMED.items():
        (section, name), (new_section, new_name) = old.split(".", 1), new.split(".", 1)
        if name in out.get(section, {}):
            out.setdefault(new_section, {})[new_name] = out[section].pop(name)
    return out


def _unknown_key_message(key: str, valid: list[str]) -> str:
    if key in RENAMED:
        return (
            f"config key '{key}' was renamed '{RENAMED[key]}' (the same meaning and "
            f"values); write {RENAMED[key]} instead"
        )
    # Same field name in another section first ('train.lr' -> 'optimizer.lr'), then spelling.
    leaf = key.rsplit(".", 1)[-1]
    close = [k for k in valid if "." in key and k.rsplit(".", 1)[-1] == leaf and k != key]
    close += [c for c in difflib.get_close_matches(key, valid, n=3, cutoff=0.6) if c not in close]
    close = close[:3]
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown config key '{key}'{hint} (valid sections: {', '.join(_SECTIONS)})"


def resolve_config_path(name: str | Path) -> Path:
    """``configs/gpt_tiny.py``, ``gpt_tiny.py`` and ``gpt_tiny`` all resolve to the file."""
    candidates = [Path(name)]
    stem = Path(name).name
    if not stem.endswith(".py"):
        candidates.append(Path(f"{name}.py"))
        stem += ".py"
    candidates += [Path("configs") / stem, CONFIGS_DIR / stem]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    available = sorted(p.stem for p in CONFIGS_DIR.glob("*.py")) if CONFIGS_DIR.is_dir() else []
    close = difflib.get_close_matches(Path(stem).stem, available, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"config file {str(name)!r} not found (looked in ., configs/ and {CONFIGS_DIR}){hint} "
        f"Available: {', '.join(available)}"
    )


def load_config_module(name: str | Path) -> types.ModuleType:
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"hetjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    with _config_file_errors(path):
        spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config() function")
    return module


def load_config(name: str | Path, overrides: dict[str, str] | None = None) -> Config:
    """Loads a config file and applies dotted command-line overrides."""
    module = load_config_module(name)
    with _config_file_errors(Path(module.__file__)):
        config = module.get_config()
    if not isinstance(config, Config):
        raise ConfigError(f"get_config() in {name} must return hetjax.config.Config")
    return config.override(overrides or {})


@contextlib.contextmanager
def _config_file_errors(path: Path):
    """A config file that does not parse, or raises as it runs: ConfigError
    ``config file X line N: ...``, the line the file's own code reached."""
    try:
        yield
    except SyntaxError as e:  # IndentationError too
        where = f" line {e.lineno}" if e.lineno else ""
        raise ConfigError(f"config file {path}{where}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - any error of the user's code
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f" line {lines[-1]}" if lines else ""
        what = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config file {path}{where}: {what}") from None


# -- documentation: python -m hetjax.config --markdown > docs/guide/config.md ---------------


def _markdown_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    return repr(value)


def markdown_table() -> str:
    """Every config key as a markdown table row: ``section.name``, its default and what it
    means (the meanings are in ``config_help.py``, one line per key)."""
    from hetjax.config_help import HELP  # only the docs need the help texts

    keys = all_keys()
    missing = [k for k in keys if k not in HELP]
    stale = [k for k in HELP if k not in keys]
    if missing or stale:
        raise ConfigError(
            f"hetjax/config_help.py: no help for {missing}, help for no key {stale}; "
            "one line per key of hetjax/config.py"
        )
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            rows.append(f"| `{key}` | {_markdown_default(f.default)} | {HELP[key]} |")
    return "\n".join(rows) + "\n"


def markdown_page() -> str:
    """The whole of docs/guide/config.md: a heading, one intro line and the table."""
    return (
        "# Config keys\n\n"
        "Defaults of `hetjax/config.py`, `hetjax/config_model.py` and "
        "`hetjax/config_offload.py` (one frozen "
        "dataclass per section); override any "
        "with `--config.<section>.<name>=<value>` ([running](running.md)). Generated by "
        "`python -m hetjax.config --markdown > docs/guide/config.md`.\n\n" + markdown_table()
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m hetjax.config --markdown > docs/guide/config.md")
    sys.stdout.write(markdown_page())
