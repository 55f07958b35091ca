"""Llama 3 70B (Grattafiori et al. 2024, table 3): 80 layers, d 8192, 64 heads with 8
key/value heads, SwiGLU width 28672, vocab 128256, rope theta 500000, untied head,
context 8192."""

from hetjax.config import Config

NOMINAL_PARAMS = 70.6e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=80,
            d_model=8192,
            num_heads=64,
            num_kv_heads=8,
            d_ff=28672,
            vocab_size=128256,
            max_seq_len=8192,
            rope_theta=500000.0,
            tie_embeddings=False,
        ),
        train=dict(seq_len=8192, batch_size=1),
        optimizer=dict(lr=1.5e-4, warmup_steps=100),
    )
