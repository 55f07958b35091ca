"""Mixtral 8x7B (Jiang et al. 2024): 32 llama blocks, d 4096, 32 heads with 8 key/value
heads, 8 SwiGLU experts of width 14336 per block, top-2 routing, vocab 32000, rope theta
1e6, untied head; 46.7B params, 12.9B active per token."""

from hetjax.config import Config

NOMINAL_PARAMS = 46.7e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=32,
            d_model=4096,
            num_heads=32,
            num_kv_heads=8,
            d_ff=14336,
            num_experts=8,
            experts_per_token=2,
            router_aux_loss_coef=0.02,
            vocab_size=32000,
            max_seq_len=32768,
            rope_theta=1e6,
            tie_embeddings=False,
        ),
        train=dict(seq_len=4096, batch_size=1),
        optimizer=dict(lr=1e-4, warmup_steps=100),
    )
