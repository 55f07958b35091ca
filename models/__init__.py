"""The hetjax model zoo: Flax models exposed as stages (embed, groups of stacked blocks,
head).

``model.family`` picks the model: ``gpt`` (models/gpt.py), ``llama`` (models/llama.py),
``t5`` (models/t5.py, an encoder and a decoder group), or ``custom``: the factory named
by ``model.custom`` (``"package.module:function"``, called with the ModelConfig), for
user-defined Flax blocks (models/staged.py).
"""

from __future__ import annotations

import importlib

from hetjax.config import ConfigError, ModelConfig
from models.gpt import GPT
from models.llama import Llama
from models.staged import FlaxStages, StagedModel, StageGroup
from models.t5 import T5

__all__ = ["GPT", "T5", "FlaxStages", "Llama", "StageGroup", "StagedModel", "build_model"]


def build_model(config: ModelConfig, expert_axis: str | None = None) -> StagedModel:
    """The model for ``config.family``. ``expert_axis``: the mesh axis a mixture of
    experts' experts are split over (expert parallelism: only ``llama`` has experts,
    ``models/llama.py``; ``distributed.expert_parallel`` is refused for any other
    model), for the stage functions run inside a ``shard_map``."""
    if config.family == "gpt":
        return GPT(config)
    if config.family == "llama":
        return Llama(config, expert_axis)
    if config.family == "t5":
        return T5(config)
    if config.family == "custom":
        return _custom_model(config)
    raise AssertionError(config.family)  # validated by ModelConfig


def _custom_model(config: ModelConfig) -> StagedModel:
    module_name, _, factory_name = config.custom.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"config key 'model.custom' ({config.custom!r}): cannot import module "
            f"{module_name!r} ({e}); it must be importable from the run (on PYTHONPATH)"
        ) from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(
            f"config key 'model.custom' ({config.custom!r}): module {module_name!r} has no "
            f"function {factory_name!r}"
        )
    model = factory(config)
    missing = [
        name
        for name in (
            *("stage_keys", "init_stage", "group_input", "group_block", "head_loss"),
            *("loss", "init"),
        )
        if not callable(getattr(model, name, None))
    ]
    if not missing and not getattr(model, "groups", None):
        missing = ["groups"]
    if missing:
        raise ConfigError(
            f"config key 'model.custom' ({config.custom!r}): the factory returned "
            f"{type(model).__name__}, which lacks {', '.join(missing)}; build it with "
            "models.staged.FlaxStages or implement models.staged.StagedModel"
        )
    return model
