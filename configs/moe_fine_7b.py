"""A fine-grained mixture of experts in the DeepSeek-MoE / Qwen-MoE style, OLMoE-1B-7B's
shape (Muennighoff et al. 2024): 16 llama blocks, d 2048, 16 heads, 64 SwiGLU experts of
width 1024 per block, top-8 routing, vocab 50304, untied head; 6.9B params, 1.3B active
per token. No shared experts and no query/key norms (hetjax's llama has neither)."""

from hetjax.config import Config

NOMINAL_PARAMS = 6.92e9


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=16,
            d_model=2048,
            num_heads=16,
            d_ff=1024,
            num_experts=64,
            experts_per_token=8,
            router_aux_loss_coef=0.01,
            vocab_size=50304,
            max_seq_len=4096,
            tie_embeddings=False,
        ),
        train=dict(seq_len=4096, batch_size=4),
        optimizer=dict(lr=4e-4, warmup_steps=100),
    )
