"""Llama 3.2 1B shapes (Meta 2024): 16 layers, d 2048, 32 heads with 8 key/value heads,
SwiGLU width 8192, vocab 128256, rope theta 500000, output head tied to the embedding.
Llama 3.2 also rescales its rotary frequencies for 128K contexts (rope_scaling
"llama3"), which hetjax does not implement: this config has the shapes, for planning
and training from scratch at up to 8K context."""

from hetjax.config import Config

NOMINAL_PARAMS = 1.24e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=16,
            d_model=2048,
            num_heads=32,
            num_kv_heads=8,
            d_ff=8192,
            vocab_size=128256,
            max_seq_len=8192,
            rope_theta=500000.0,
            tie_embeddings=True,
        ),
        train=dict(seq_len=2048, batch_size=4),
        optimizer=dict(lr=3e-4, warmup_steps=100),
    )
