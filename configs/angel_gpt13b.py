"""GPT3-13B from Angel-PTM (Nie et al. 2023) table 4, with its explicit FFN width; as its runs ran: bf16 compute over fp32 model states (sec 6), sequence length 2048 as in its sec 2.2, batch 1 (its batches fill many GPUs). The table prints d_model 5140 / d_FFN 20506, typos for 5120 / 20480 (5140 is not divisible by 40 heads)."""

from hetjax.config import Config

NOMINAL_PARAMS = 13e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=40,
            d_model=5120,
            num_heads=40,
            d_ff=20480,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=2048, batch_size=1),
    )
