"""T5-1.4B from Angel-PTM (Nie et al. 2023) table 4: 16 layers, 16 heads, d_model 1024,
d_FFN 16384, read as an encoder and a decoder of 16 blocks each with T5 v1.0's ReLU
feed-forward layer (``model.feed_forward_proj=relu``: the Switch Transformer's, which the
table's T5-MoE-1.2T builds on, and the reading under which that row gives its label) and
an untied head: 1.34B params, 4% below the label (no reading of the printed shape gives
1.4B: with T5 v1.1's gated GELU it is 1.88B, with 8 + 8 blocks 0.67B). T5's vocabulary
(32128), bf16 compute over fp32 model states (its sec 6), 512 tokens in and 512 out
(T5's pre-training length), batch 1 (its batches fill many GPUs)."""

from hetjax.config import Config

NOMINAL_PARAMS = 1.34e9  # the label: 1.4B


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
            vocab_size=32128,
            max_seq_len=512,
            layer_norm_eps=1e-6,
            tie_embeddings=False,
            compute_dtype="bfloat16",
        ),
        train=dict(seq_len=512, batch_size=1),
        data=dict(objective="prefix_lm"),
    )
