"""GPT-3 XL, 1.3B (Brown et al. 2020, table 2.1). The paper lists 24 heads of 128; we use 16 heads of 128 so heads x head_dim = d_model (same parameter count). Mixed precision as the paper trained it (bf16 compute here, fp32 master and Adam state), at its context 2048, batch 1."""

from hetjax.config import Config

NOMINAL_PARAMS = 1.3e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=24,
            d_model=2048,
            num_heads=16,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=2048, batch_size=1),
    )
