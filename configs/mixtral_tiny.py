"""A tiny Mixtral-style mixture of experts (llama blocks whose MLP is 4 SwiGLU experts,
top-2 routing, load-balancing loss) on the bundled corpus; trains on 2 CPU cores."""

from hetjax.config import Config

NOMINAL_PARAMS = 2.55e5  # 140k active per token (and the 33k embedding)


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="llama",
            num_layers=2,
            d_model=64,
            num_heads=4,
            num_kv_heads=2,
            d_ff=128,
            num_experts=4,
            experts_per_token=2,
            router_aux_loss_coef=0.02,
            tie_embeddings=False,
        ),
        train=dict(steps=50, batch_size=8, seq_len=128),
    )
