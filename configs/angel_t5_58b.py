"""T5-58B from Angel-PTM (Nie et al. 2023) table 4: 60 layers, 64 heads, d_model 4096,
d_FFN 16384, read as its T5-1.4B row is (configs/angel_t5_1p4b.py): an encoder and a
decoder of 60 blocks each, T5 v1.0's ReLU feed-forward layer, an untied head. The
printed shape gives 28.4B params, half the label (T5 v1.1's gated GELU:
36.5B); the label needs twice the printed layers, 120 + 120 blocks. T5's
vocabulary (32128), bf16 compute over fp32 model states (its sec 6), 512 tokens in and
512 out, batch 1."""

from hetjax.config import Config

NOMINAL_PARAMS = 28.4e9  # the printed shape's; the label: 58B


def get_config() -> Config:
    return Config().replace(
        model=dict(
            family="t5",
            num_layers=60,
            num_decoder_layers=60,
            d_model=4096,
            num_heads=64,
            d_ff=16384,
            feed_forward_proj="relu",
            vocab_size=32128,
            max_seq_len=512,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=512, batch_size=1),
        data=dict(objective="prefix_lm"),
    )
