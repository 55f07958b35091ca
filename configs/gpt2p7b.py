"""GPT-3 2.7B (Brown et al. 2020, table 2.1): 32 layers, d 2560, 32 heads of 80."""

from hetjax.config import Config

NOMINAL_PARAMS = 2.7e9


def get_config() -> Config:
    return Config().replace(
        model=dict(num_layers=32, d_model=2560, num_heads=32, vocab_size=50257, max_seq_len=2048),
        train=dict(seq_len=2048, batch_size=1),
    )
