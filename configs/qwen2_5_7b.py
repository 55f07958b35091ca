"""Qwen2.5-7B (Qwen team 2024, the Hub's Qwen/Qwen2.5-7B config.json): 28 layers, d 3584,
28 heads with 4 key/value heads, biases on q/k/v, SwiGLU width 18944, vocab 152064,
rope theta 1e6, RMSNorm eps 1e-6, untied head (the 0.5B-3B sizes tie theirs)."""

from hetjax.config import Config

NOMINAL_PARAMS = 7.62e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=28,
            d_model=3584,
            num_heads=28,
            num_kv_heads=4,
            d_ff=18944,
            vocab_size=152064,
            max_seq_len=32768,
            rope_theta=1e6,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
            qkv_bias=True,
        ),
        train=dict(seq_len=4096, batch_size=1),
        optimizer=dict(lr=1e-5, warmup_steps=100),
    )
