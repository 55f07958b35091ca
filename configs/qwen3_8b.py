"""Qwen3-8B (Qwen team 2025, the Hub's Qwen/Qwen3-8B config.json): 36 layers, d 4096,
32 heads of width 128 with 8 key/value heads, RMSNorms on each query and key head, no
biases, SwiGLU width 12288, vocab 151936, rope theta 1e6, RMSNorm eps 1e-6, untied
head, context 40960."""

from hetjax.config import Config

NOMINAL_PARAMS = 8.19e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=36,
            d_model=4096,
            num_heads=32,
            num_kv_heads=8,
            d_ff=12288,
            vocab_size=151936,
            max_seq_len=40960,
            rope_theta=1e6,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
            qk_norm=True,
        ),
        train=dict(seq_len=4096, batch_size=1),
        optimizer=dict(lr=1e-5, warmup_steps=100),
    )
