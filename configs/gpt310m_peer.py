"""The shape hetjax is measured against DeepSpeed with (``python -m hetjax.bench peer``,
docs/results/): GPT-2, 310.8M params, 24 layers, d 1024, 16 heads, vocab 8192, seq 128,
batch 4, fp32, no gradient clipping. Add ``--config.offload.*`` for the offloaded rows."""

from hetjax.config import Config

NOMINAL_PARAMS = 310.8e6


def get_config() -> Config:
    return Config().replace(
        model=dict(num_layers=24, d_model=1024, num_heads=16, vocab_size=8192, max_seq_len=128),
        train=dict(seq_len=128, batch_size=4, steps=6, eval_batches=0, log_every=1),
        optimizer=dict(grad_clip=0.0),
        checkpoint=dict(every_steps=0, at_end=False),
    )
