"""GPT-3 6.7B (Brown et al. 2020, table 2.1): 32 layers, d 4096, 32 heads of 128. Mixed precision as the paper trained it (bf16 compute here, fp32 master and Adam state), at its context 2048, batch 1."""

from hetjax.config import Config

NOMINAL_PARAMS = 6.7e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=32,
            d_model=4096,
            num_heads=32,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=2048, batch_size=1),
    )
