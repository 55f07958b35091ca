"""GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads of 128, seq 2048."""

from hetjax.config import Config

NOMINAL_PARAMS = 175e9


def get_config() -> Config:
    return Config().replace(
        model=dict(num_layers=96, d_model=12288, num_heads=96, vocab_size=50257, max_seq_len=2048),
        train=dict(seq_len=2048, batch_size=1),
    )
