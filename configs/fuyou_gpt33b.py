"""GPT-3 33B shape from Fuyou (Liao et al. 2024) table 4; as its max-size runs ran (sec 5.2): sequence length 1024, batch 1, half-precision compute (bf16 here; Fuyou computes in fp16) over fp32 master and Adam state."""

from hetjax.config import Config

# Fuyou takes this shape from LLaMA "33B", whose actual size is 32.5B parameters
# (Touvron et al. 2023, table 2); the 4*d GELU MLP here gives 32.2B.
NOMINAL_PARAMS = 32.5e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=60,
            d_model=6656,
            num_heads=52,
            vocab_size=50257,
            max_seq_len=1024,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=1024, batch_size=1),
    )
