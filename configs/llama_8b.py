"""Llama 3 8B (Grattafiori et al. 2024, table 3): 32 layers, d 4096, 32 heads with 8
key/value heads, SwiGLU width 14336, vocab 128256, rope theta 500000, untied head,
context 8192."""

from hetjax.config import Config

NOMINAL_PARAMS = 8.03e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=32,
            d_model=4096,
            num_heads=32,
            num_kv_heads=8,
            d_ff=14336,
            vocab_size=128256,
            max_seq_len=8192,
            rope_theta=500000.0,
            tie_embeddings=False,
        ),
        train=dict(seq_len=8192, batch_size=1),
        optimizer=dict(lr=3e-4, warmup_steps=100),
    )
