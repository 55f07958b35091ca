"""Llama 3.2 1B (Meta 2024): 16 layers, d 2048, 32 heads with 8 key/value heads, SwiGLU
width 8192, vocab 128256, rope theta 500000 with Llama 3.1's frequency rescaling (factor
32 over an original 8192 context), output head tied to the embedding. The model config
equals the checkpoint's config.json, so model.init_from=hf:<Llama-3.2-1B dir> loads it;
the training context here is 2048."""

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
            rope_scaling_factor=32.0,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_original_max_len=8192,
            tie_embeddings=True,
        ),
        train=dict(seq_len=2048, batch_size=4),
        optimizer=dict(lr=3e-4, warmup_steps=100),
    )
