"""GPT3-175B from Angel-PTM (Nie et al. 2023) table 4, with its explicit FFN width; as its runs ran: bf16 compute over fp32 model states (sec 6), sequence length 2048 as in its sec 2.2, batch 1 (its batches fill many GPUs): 70 layers, d 14336, 112 heads, FFN 57344 (not the GPT-3 paper's 96 x 12288 shape)."""

from hetjax.config import Config

NOMINAL_PARAMS = 175e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            num_layers=70,
            d_model=14336,
            num_heads=112,
            d_ff=57344,
            vocab_size=50257,
            max_seq_len=2048,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=2048, batch_size=1),
    )
