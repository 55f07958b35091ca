"""GPT3-55B from Angel-PTM (Nie et al. 2023) table 4, with its explicit FFN width; as its runs ran: bf16 compute over fp32 model states (sec 6), sequence length 2048 as in its sec 2.2, batch 1 (its batches fill many GPUs): 68 layers, d 8192, 128 heads, FFN 32768."""

from hetjax.config import Config

NOMINAL_PARAMS = 55e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=68,
            d_model=8192,
            num_heads=128,
            d_ff=32768,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=2048, batch_size=1),
    )
