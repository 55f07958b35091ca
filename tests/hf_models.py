"""Random-weight Hugging Face models built locally with ``transformers`` (no download),
shared by the HF import/export tests."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

VOCAB, SEQ = 256, 64


def build_hf_model(
    family: str, tied: bool = False, rope_scaling: bool = False, seed: int = 0, norm_eps=1e-5
):
    """A 2-layer, d 64 GPT-2, Llama, Qwen2, Qwen3, Mistral or Mixtral (4 experts, top 2,
    aux loss weighted 0.02 and on in transformers' loss: output_router_logits) with
    random weights, every norm weight and bias perturbed too (so a mapping mistake
    anywhere shows in the logits), fp32, eval mode. Qwen2 has q/k/v biases, Qwen3 q/k
    norms, Mistral a sliding window of 4096 (longer than any test sequence).
    ``rope_scaling``: Llama 3.1's, with an original context of 16 so that the 16-wide
    heads have stretched, interpolated and kept frequencies. ``norm_eps``: every norm's
    epsilon (``layer_norm_epsilon``, ``rms_norm_eps``)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
            initializer_range=0.1, bos_token_id=None, eos_token_id=None,
            layer_norm_epsilon=norm_eps,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif family == "mixtral":
        config = transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
            router_aux_loss_coef=0.02, output_router_logits=True, vocab_size=VOCAB,
            max_position_embeddings=SEQ, rms_norm_eps=norm_eps, rope_theta=5000.0,
            tie_word_embeddings=tied, sliding_window=None, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    elif family in LLAMA_SHAPED:
        model = _llama_shaped(family, tied, norm_eps)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ,
            rms_norm_eps=norm_eps, rope_theta=5000.0, tie_word_embeddings=tied,
            initializer_range=0.1, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        if rope_scaling:
            config.rope_parameters = {
                "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm weights (ones) and biases (zeros)
                p.add_(0.1 * torch.randn_like(p))
            elif p.ndim == 3:  # Mixtral's fused experts: not every version initialises them
                p.copy_(0.1 * torch.randn_like(p))
    return model.float().eval()


# Llama-shaped families: (config class, model class, their options)
LLAMA_SHAPED = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, use_sliding_window=False)),
    # a window longer than any test sequence: it changes nothing, hetjax accepts it
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=4096)),
}


def _llama_shaped(family: str, tied: bool, norm_eps: float):
    """A Qwen2 (q/k/v biases), Qwen3 (q/k norms) or Mistral of the Llama's shape."""
    config_class, model_class, options = LLAMA_SHAPED[family]
    config = getattr(transformers, config_class)(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ,
        rms_norm_eps=norm_eps, rope_theta=5000.0, tie_word_embeddings=tied,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, **options,
    )  # fmt: skip
    return getattr(transformers, model_class)(config)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits (B, T, V) of a transformers model for int tokens (B, T)."""
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()


def hf_sgd_losses(model, batch: np.ndarray, lr: float) -> tuple[float, float]:
    """Loss of a (B, T+1) batch, one plain SGD step on it, and the loss after. A
    Mixtral's loss (output_router_logits) adds its weighted load-balancing loss over the
    tokens it reads: it reads the first T, as hetjax's model does, and predicts the last
    T (shift_labels: transformers does not shift them)."""
    ids = torch.from_numpy(batch).long()
    inputs = dict(input_ids=ids, labels=ids)  # HF shifts the labels by one
    if getattr(model.config, "num_local_experts", 0):
        targets = ids[:, 1:].contiguous()
        inputs = dict(input_ids=ids[:, :-1], labels=targets, shift_labels=targets)
    loss = model(**inputs).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
        after = model(**inputs).loss
    return float(loss.detach()), float(after)
