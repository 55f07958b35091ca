"""The hetjax model zoo: Flax models exposed as stages (embed, stacked blocks, head)."""

from __future__ import annotations

from hetjax.config import ModelConfig
from models.gpt import GPT

__all__ = ["GPT", "build_model"]


def build_model(config: ModelConfig) -> GPT:
    """The model for ``config.family``."""
    if config.family == "gpt":
        return GPT(config)
    raise AssertionError(config.family)  # validated by ModelConfig
