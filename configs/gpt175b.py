"""GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads of 128 (context 2048), set up as
Fuyou (Liao et al. 2024, fig. 5a) fine-tunes it, the run the planner's docs compare with: bf16
compute (Fuyou: fp16) over fp32 master and Adam state, sequence length 1024, batch 16."""

from hetjax.config import Config

NOMINAL_PARAMS = 175e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=96,
            d_model=12288,
            num_heads=96,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=1024, batch_size=16),
    )
