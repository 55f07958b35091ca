"""GPT-2 small, 124M (Radford et al. 2019): 12 layers, d 768, 12 heads, vocab 50257,
context 1024. Point data.path at a GPT-2-tokenised .bin file to train it on real text."""

from hetjax.config import Config

NOMINAL_PARAMS = 124e6


def get_config() -> Config:
    return Config().replace(
        model=dict(num_layers=12, d_model=768, num_heads=12, vocab_size=50257, max_seq_len=1024),
        train=dict(seq_len=1024, batch_size=8, steps=1000),
        optimizer=dict(lr=6e-4, warmup_steps=100),
    )
