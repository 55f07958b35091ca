"""T5-MoE-1.2T from Angel-PTM (Nie et al. 2023) table 4: 16 layers, 16 heads, d_model
1024, d_FFN 16384, 2304 experts, read as its T5-1.4B row is (configs/angel_t5_1p4b.py:
an encoder and a decoder of 16 layers each, ReLU feed-forward layers, an untied head)
made a Switch Transformer (Fedus et al. 2022, the paper's T5-MoE reference): every other
layer's feed-forward layer 2304 experts of that width, top-1 routing, Switch's
load-balancing loss at 0.01: 1.24T params, 3% above the label (1.2T), 1.38B active per
token (with every layer's experts it would be 2.5T). T5's vocabulary, bf16 compute over
fp32 model states (its sec 6), 512 tokens in and 512 out, batch 1."""

from hetjax.config import Config

NOMINAL_PARAMS = 1.24e12  # the label: 1.2T


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="t5",
            num_layers=16,
            num_decoder_layers=16,
            d_model=1024,
            num_heads=16,
            d_ff=16384,
            feed_forward_proj="relu",
            num_experts=2304,
            experts_per_token=1,
            router_aux_loss_coef=0.01,
            vocab_size=32128,
            max_seq_len=512,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=512, batch_size=1),
        data=dict(objective="prefix_lm"),
    )
