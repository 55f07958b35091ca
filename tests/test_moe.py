"""Mixture-of-experts llama blocks (Mixtral routing): logits and the load-balancing loss
equal transformers' MixtralForCausalLM; configs parse and plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import assert_training_equal, check_tokens
from hf_models import VOCAB

from hetjax.config import Config, ConfigError
from hetjax.train import train
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


# -- training under every runtime, the auxiliary loss on ------------------------------------

TRAIN_MOE = dict(MOE, max_seq_len=32)
SHORT = dict(steps=4, eval_batches=1)  # the validation loss is compared too
# SGD: ZeRO-3 sums gradients over devices in another order than one device does, which
# AdamW's first steps amplify beyond 1e-5 (tests/test_zero.py's docstring); SGD compares
# the gradients themselves, so one offload.mode=none reference serves every runtime.
SGD = dict(name="sgd", lr=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(model=TRAIN_MOE, train=SHORT, optimizer=SGD)
    return train(config, tmp_path_factory.mktemp("ref"), verbose=False)


# Default-run representatives: test_logits_and_aux_loss_equal_transformers (in memory),
# test_stream_nvme_equals_none and test_zero3_on_4_devices_equals_single_device (sharing
# the reference); the others are slow.


def test_stream_nvme_equals_none(reference, tiny, tmp_path):
    """offload.mode=stream with the optimizer on NVMe, the last block kept (its vjp from
    forward) and the other swapped (its activations to host memory and back) trains as
    offload.mode=none: the aux loss and its gradients are in both (the statistics'
    cotangent through a kept block's backward and a swapped one's; a recomputed one's in
    the ZeRO-3 test and, slow, with AdamW)."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=1, swap_blocks=1)
    config = tiny(model=TRAIN_MOE, train=SHORT, optimizer=SGD, offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert reference.losses[-1] < reference.losses[0]
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


@pytest.mark.slow  # ~17 s; Zero3.jit's batch means: tests/test_zero.py in the default run
def test_zero3_on_4_devices_equals_single_device(reference, tiny, tmp_path):
    """ZeRO-3 over 4 devices: each device's router statistics are averaged over the
    devices before the aux loss (stages.batch_means), so it equals one device's on the
    whole micro-batch, while the gradients' per-page squared norms stay split over the
    devices as the gradients: the step's gradient norm (their sum) equals the reference's."""
    config = tiny(
        model=TRAIN_MOE,
        train=SHORT,
        optimizer=SGD,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=4),
    )
    result = train(config, tmp_path / "zero", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())
    norms = [[r["grad_norm"] for r in run.records] for run in (result, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)


@pytest.mark.slow  # ~30 s on 2 cores with a cold compilation cache (its own reference)
def test_stream_nvme_equals_none_with_adamw(tiny, tmp_path):
    """As test_stream_nvme_equals_none, with AdamW (the config's optimizer): one device
    sums as offload.mode=none does, so AdamW's amplification is no concern."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=1)
    none, stream = (
        train(tiny(model=TRAIN_MOE, train=SHORT, offload=o), tmp_path / o["mode"], verbose=False)
        for o in (dict(mode="none"), offload)
    )
    assert none.losses[-1] < none.losses[0]
    assert_training_equal(stream, none, build_model(tiny(model=TRAIN_MOE).model), check_tokens())


@pytest.mark.slow  # ~25 s on 2 cores with a cold compilation cache (un-jitted gradients)
def test_aux_loss_is_in_the_loss_and_gradients(tiny):
    """The training loss is the cross-entropy plus coef x the balance loss, and the
    router's gradient changes with the coefficient."""
    config = tiny(model=TRAIN_MOE)
    model = build_model(config.model)
    off = build_model(tiny(model={**TRAIN_MOE, "router_aux_loss_coef": 0.0}).model)
    params = model.init(jax.random.key(0))
    ids = tokens()
    loss = model.loss(params, ids[:, :-1], ids[:, 1:])
    x, stats = model._run_blocks(params["blocks"], model.embed(params["embed"], ids[:, :-1]))
    ce = model.head_loss(params["head"], params["embed"], x, ids[:, 1:])
    aux = router_balance_loss(stats, model.config)
    np.testing.assert_allclose(loss, ce + 0.02 * aux, rtol=1e-6)
    np.testing.assert_allclose(off.loss(params, ids[:, :-1], ids[:, 1:]), ce, rtol=1e-6)
    g_on = jax.grad(model.loss)(params, ids[:, :-1], ids[:, 1:])["blocks"]["moe"]["router"]
    g_off = jax.grad(off.loss)(params, ids[:, :-1], ids[:, 1:])["blocks"]["moe"]["router"]
    assert not np.allclose(g_on, g_off)
