"""A 1.7M-parameter byte-level Llama (grouped-query attention, rotary, SwiGLU, untied
head) on the bundled corpus: the Llama counterpart of gpt_tiny, about 30 s on
2 CPU cores."""

from hetjax.config import Config

NOMINAL_PARAMS = 1.67e6


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=4,
            d_model=192,
            num_heads=6,
            num_kv_heads=2,
            d_ff=512,
            tie_embeddings=False,
        ),
        train=dict(steps=100, batch_size=8, seq_len=128),
    )
