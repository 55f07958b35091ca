"""The embedded default: a ~3M-parameter byte-level GPT on the bundled corpus (the
running Python's standard library). Trains in about a minute on 2 CPU cores."""

from hetjax.config import Config

NOMINAL_PARAMS = 3.3e6


def get_config() -> Config:
    return Config()  # the defaults are this run: 4 layers, d 256, 4 heads, vocab 256
