"""GPT-3 33B shape from Fuyou (Liao et al. 2024) table 4; sequence length 1024, batch 1 for the max-size runs (sec 5.2)."""

from hetjax.config import Config

# Fuyou takes this shape from LLaMA "33B", whose actual size is 32.5B parameters
# (Touvron et al. 2023, table 2); the 4*d GELU MLP here gives 32.2B.
NOMINAL_PARAMS = 32.5e9


def get_config() -> Config:
    return Config().replace(
        model=dict(num_layers=60, d_model=6656, num_heads=52, vocab_size=50257, max_seq_len=1024),
        train=dict(seq_len=1024, batch_size=1),
    )
