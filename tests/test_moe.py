"""Mixture-of-experts llama blocks (Mixtral routing): logits and the load-balancing loss
equal transformers' MixtralForCausalLM; configs parse and plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import VOCAB

from hetjax.config import Config, ConfigError
from models import build_model
from models.llama import router_balance_loss
from models.staged import token_loss

MOE = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
    num_experts=4, experts_per_token=2, router_aux_loss_coef=0.02, tie_embeddings=False,
    vocab_size=VOCAB, max_seq_len=256, rope_theta=5000.0,
)  # fmt: skip


def build_hf_mixtral(seed: int = 0):
    """A random-weight MixtralForCausalLM of MOE's shape, norm weights perturbed, fp32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, sliding_window=None,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:  # experts' 3-D weights are left uninitialised (empty) by some versions
                p.copy_(0.1 * torch.randn_like(p))
    return model.float().eval()


def params_from_hf(model) -> dict:
    """Our params (fp32 numpy) from a MixtralForCausalLM's state dict."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    F = model.config.intermediate_size
    layers = []
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2F, D)
        layers.append(
            {
                "input_layernorm": {"scale": sd[p + "input_layernorm.weight"]},
                "post_attention_layernorm": {"scale": sd[p + "post_attention_layernorm.weight"]},
                **{
                    n: {"kernel": sd[p + f"self_attn.{n}.weight"].T}
                    for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                },
                "moe": {
                    "router": sd[p + "mlp.gate.weight"].T,  # (D, E)
                    "gate_proj": gate_up[:, :F].transpose(0, 2, 1),  # (E, D, F)
                    "up_proj": gate_up[:, F:].transpose(0, 2, 1),
                    "down_proj": sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1),  # (E, F, D)
                },
            }
        )
    return {
        "embed": {"embed_tokens": sd["model.embed_tokens.weight"]},
        "blocks": jax.tree.map(lambda *a: np.stack(a), *layers),
        "head": {
            "norm": {"scale": sd["model.norm.weight"]},
            "lm_head": {"kernel": sd["lm_head.weight"].T},
        },
    }


def tokens(batch=2, seq=16, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq), dtype=np.int32)


def test_shapes_and_active_flops():
    model = build_model(Config().replace(model=MOE).model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    moe = shapes["blocks"]["moe"]
    assert moe["router"].shape == (2, 32, 4)
    assert moe["gate_proj"].shape == moe["up_proj"].shape == (2, 4, 32, 48)
    assert moe["down_proj"].shape == (2, 4, 48, 32)
    assert "gate_proj" not in shapes["blocks"]
    dense = build_model(Config().replace(model={**MOE, "num_experts": 0}).model)
    expert = 3 * 32 * 48
    # the MoE's params: the dense model's MLP replaced by 4 experts and a router
    assert model.param_count() == dense.param_count() + 2 * (3 * expert + 32 * 4)
    # FLOPs: a token uses 2 of the 4 experts, so 2 experts' params and the router more
    T = 16
    assert model.flops_per_token(T) == dense.flops_per_token(T) + 6 * 2 * (expert + 32 * 4)


def test_config_checks():
    with pytest.raises(ConfigError, match="model.experts_per_token"):
        Config().replace(model={**MOE, "experts_per_token": 5})
    with pytest.raises(ConfigError, match="model.num_experts"):
        Config().replace(model=dict(family="gpt", num_experts=4))
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef"):
        Config().replace(model={**MOE, "router_aux_loss_coef": -1.0})


def test_logits_and_aux_loss_equal_transformers():
    import torch

    hf = build_hf_mixtral()
    model = build_model(Config().replace(model=MOE).model)
    params = jax.tree.map(jnp.asarray, params_from_hf(hf))
    ids = tokens()
    with torch.no_grad():
        out = hf(
            input_ids=torch.from_numpy(ids).long(),
            labels=torch.from_numpy(ids).long(),
            output_router_logits=True,
        )
    np.testing.assert_allclose(np.asarray(model.logits(params, ids)), out.logits.numpy(), atol=1e-4)
    x = model.embed(params["embed"], ids)
    _, stats = model._run_blocks(params["blocks"], x)
    aux = router_balance_loss(stats, model.config)
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    # HF's loss: the cross-entropy of the shifted labels plus coef x aux (over all T)
    logits = model.logits(params, ids)
    ce = token_loss(logits[:, :-1], jnp.asarray(ids[:, 1:]))
    np.testing.assert_allclose(float(ce + model.aux_loss(stats)), float(out.loss), rtol=1e-5)
