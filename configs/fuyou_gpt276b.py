"""GPT-3 276B shape from Fuyou (Liao et al. 2024) table 4; as its max-size runs ran (sec 5.2): sequence length 1024, batch 1, half-precision compute (bf16 here; Fuyou computes in fp16) over fp32 master and Adam state."""

from hetjax.config import Config

NOMINAL_PARAMS = 276e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=112,
            d_model=14336,
            num_heads=112,
            vocab_size=50257,
            max_seq_len=1024,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=1024, batch_size=1),
    )
