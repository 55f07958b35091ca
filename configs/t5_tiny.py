"""A tiny T5 (v1.1: relative position bias, RMSNorm, gated GELU, untied head; 2 encoder
and 2 decoder blocks) on the bundled corpus with the prefix-LM objective: the encoder
reads 64 bytes, the decoder predicts the next 64. Trains on 2 CPU cores."""

from hetjax.config import Config

NOMINAL_PARAMS = 2.3e5


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="t5",
            num_layers=2,
            num_decoder_layers=2,
            d_model=64,
            num_heads=4,
            d_ff=128,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
        ),
        train=dict(steps=50, batch_size=8, seq_len=64),
        data=dict(objective="prefix_lm"),
    )
