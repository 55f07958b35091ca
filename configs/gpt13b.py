"""GPT-3 13B (Brown et al. 2020, table 2.1; the table's d_model 5140 is a typo for 40 heads x 128 = 5120), set up as
Fuyou (Liao et al. 2024, fig. 5b) fine-tunes it: bf16 compute (Fuyou: fp16) over fp32 master and
Adam state, sequence length 1024, batch 16."""

from hetjax.config import Config

NOMINAL_PARAMS = 13e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=40,
            d_model=5120,
            num_heads=40,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=1024, batch_size=16),
    )
