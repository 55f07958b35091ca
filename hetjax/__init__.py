"""hetjax: train transformers larger than accelerator memory by spreading the training
state over device memory, host RAM and NVMe, the JAX way."""

__version__ = "0.1.0"
