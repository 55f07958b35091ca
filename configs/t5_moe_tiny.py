"""A tiny Switch-style T5-MoE (configs/t5_tiny's shape with 4 + 4 layers, every other
layer's feed-forward layer 4 ReLU experts with top-1 routing and Switch's load-balancing
loss) on the bundled corpus with the prefix-LM objective; trains on 2 CPU cores."""

from hetjax.config import Config

NOMINAL_PARAMS = 5.6e5  # 0.36M active per token


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="t5",
            num_layers=4,
            num_decoder_layers=4,
            d_model=64,
            num_heads=4,
            d_ff=128,
            feed_forward_proj="relu",
            num_experts=4,
            experts_per_token=1,
            router_aux_loss_coef=0.01,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
        ),
        train=dict(steps=50, batch_size=8, seq_len=64),
        data=dict(objective="prefix_lm"),
    )
