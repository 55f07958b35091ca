"""Mistral-7B-v0.3 (Jiang et al. 2023; the Hub's mistralai/Mistral-7B-v0.3
config.json): 32 layers, d 4096, 32 heads with 8 key/value heads, SwiGLU width 14336,
vocab 32768, rope theta 1e6, RMSNorm eps 1e-5, untied head, no sliding window. v0.1's
window of 4096 tokens: add model.sliding_window=4096, vocab_size=32000,
rope_theta=10000 (sequences up to 4096 tokens)."""

from hetjax.config import Config

NOMINAL_PARAMS = 7.25e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=32,
            d_model=4096,
            num_heads=32,
            num_kv_heads=8,
            d_ff=14336,
            vocab_size=32768,
            max_seq_len=32768,
            rope_theta=1e6,
            layer_norm_eps=1e-5,
            tie_embeddings=False,
        ),
        train=dict(seq_len=4096, batch_size=1),
        optimizer=dict(lr=1e-5, warmup_steps=100),
    )
