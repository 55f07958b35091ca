"""T5 (models/t5.py): an encoder and a decoder stage group, the prefix-LM objective, against
HF's T5ForConditionalGeneration, and trained by the runtimes."""

import dataclasses

import jax
import numpy as np
import pytest
from equivalence import (
    assert_losses_close,
    assert_training_equal,
    assert_trees_close,
    check_tokens,
    training_batches,
)

from hetjax.config import ConfigError
from hetjax.data import TokenWindows, split_window
from hetjax.runtime.in_memory import InMemoryRuntime
from hetjax.train import train
from models import build_model

SHAPE = dict(
    family="t5", num_layers=2, num_decoder_layers=3, d_model=32, num_heads=4, d_ff=64,
    layer_norm_eps=1e-6, tie_embeddings=False, relative_attention_num_buckets=8,
    relative_attention_max_distance=12,
)  # fmt: skip
SHORT = dict(steps=4, eval_batches=1)  # the validation loss is compared too
# SGD compares the gradients themselves: AdamW's first steps amplify a gradient's
# last-bit differences (the context's gradient is summed over the decoder blocks in
# another order than the in-memory scan sums it) beyond 1e-5 on near-zero elements.
SGD = dict(name="sgd", lr=0.1)


def t5_config(tiny, **model):
    """A tiny T5: 2 encoder and 3 decoder blocks (unequal, so a mix-up shows), d 32,
    8 position buckets (T 16 reaches the logarithmic ones)."""
    return tiny(model={**SHAPE, **model}, data=dict(objective="prefix_lm"))


def t5_tokens():
    """The encoder's tokens and the decoder's targets the logits are compared on."""
    tokens = check_tokens()
    return tokens, tokens[::-1, ::-1].copy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import tiny_config

    config = t5_config(tiny_config).replace(train=SHORT, optimizer=SGD, offload=dict(mode="none"))
    return train(config, tmp_path_factory.mktemp("ref"), verbose=False)


def test_stream_nvme_equals_none(reference, tiny, tmp_path):
    """offload.mode=stream with the optimizer and params on NVMe trains as
    offload.mode=none: the decoder's context (the encoder's output after its final norm,
    and the decoder's bias table) is read by every decoder block, and its gradient, summed
    over them on the device, goes back through the encoder; the last two blocks keep
    their activations (kept vjps with a context), the others recompute."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=2)
    config = t5_config(tiny).replace(train=SHORT, optimizer=SGD, offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert reference.losses[-1] < reference.losses[0]
    assert_training_equal(result, reference, build_model(config.model), t5_tokens())


@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        # the device cache: embed, both encoder blocks and the first decoder block
        dict(optimizer="host", optimizer_device_stages=4, prefetch_depth=1),
        dict(optimizer="host", activations="host", keep_blocks=4),  # kept across groups
        dict(optimizer="nvme", activations="nvme", prefetch_depth=0),
    ],
    ids=["device_cache", "host_kept_across", "nvme_boundaries"],
)
def test_stream_placements_equal_none(reference, tiny, tmp_path, offload):
    config = t5_config(tiny).replace(
        train=SHORT, optimizer=SGD, offload=dict(mode="stream", **offload)
    )
    result = train(config, tmp_path, verbose=False)
    assert_training_equal(result, reference, build_model(config.model), t5_tokens())


def test_swapped_activations_refused(tiny):
    config = t5_config(tiny).replace(offload=dict(mode="stream", swap_blocks=1))
    with pytest.raises(ConfigError, match="offload.swap_blocks"):
        from hetjax.runtime.streaming import StreamingRuntime

        StreamingRuntime(config)


@pytest.mark.parametrize(
    "sections, key",
    [
        (dict(data=dict(objective="prefix_lm")), "data.objective"),
        (dict(model=dict(family="t5")), "data.objective"),  # lm with an encoder-decoder
        (dict(model=dict(family="llama", num_decoder_layers=2)), "model.num_decoder_layers"),
        (
            dict(model=dict(family="t5", attention="blockwise"), data=dict(objective="prefix_lm")),
            "model.attention",
        ),
        (
            dict(model=dict(family="t5", num_kv_heads=2), data=dict(objective="prefix_lm")),
            "model.num_kv_heads",
        ),
        (
            dict(
                model=dict(family="t5", num_layers=2, num_decoder_layers=1),
                data=dict(objective="prefix_lm"),
                offload=dict(mode="stream", keep_blocks=4),
            ),
            "offload.keep_blocks",
        ),
    ],
)
def test_bad_combinations_name_the_key(tiny, sections, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny(**sections)


def test_prefix_lm_windows():
    """Windows of 2T starting every T: the encoder reads the first T tokens, the decoder
    predicts the next T; every T tokens are one window's targets and the next's input."""
    tokens = np.arange(100, dtype=np.uint16)
    data = TokenWindows(tokens, seq_len=8, batch_size=2, window=16)
    assert data.num_windows == (100 - 16) // 8 + 1
    batch = data.batch(0)
    assert batch.shape == (2, 16)
    inputs, targets = split_window("prefix_lm", batch)
    np.testing.assert_array_equal(inputs, [np.arange(0, 8), np.arange(8, 16)])
    np.testing.assert_array_equal(targets, [np.arange(8, 16), np.arange(16, 24)])
    np.testing.assert_array_equal(targets[0], inputs[1])


def test_in_memory_trains_and_restores(tiny):
    """offload.mode=none trains T5 (the loss falls) and its state goes through the
    placement-free form (checkpoints) and back unchanged."""
    config = t5_config(tiny, remat=True).replace(
        offload=dict(mode="none"), train=dict(steps=6), optimizer=dict(lr=1e-2)
    )
    runtime = InMemoryRuntime(config)
    losses = [runtime.train_step(b).loss for b in training_batches(config, 6)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    state = runtime.save_state()
    assert [s for s in state.stages if s[0] in "ed" and s != "embed"] == [
        "encoder0", "encoder1", "decoder0", "decoder1", "decoder2",
    ]  # fmt: skip
    other = InMemoryRuntime(dataclasses.replace(config, train=config.train))
    other.load_state(state)
    assert_trees_close(other.params(), runtime.params(), rtol=0)


@pytest.mark.slow
def test_remat_changes_nothing(tiny):
    """model.remat (each block recomputed in backward) gives the same gradients."""
    config = t5_config(tiny)
    model, checked = (
        build_model(config.model),
        build_model(config.replace(model=dict(remat=True)).model),
    )
    params = model.init(jax.random.key(0))
    tokens, targets = split_window("prefix_lm", training_batches(config, 1)[0][0])
    g = jax.grad(model.loss)(params, tokens, targets)
    g_remat = jax.grad(checked.loss)(params, tokens, targets)
    assert_trees_close(g_remat, g, rtol=1e-6)
    assert_losses_close(checked.loss(params, tokens, targets), model.loss(params, tokens, targets))


def _hf_t5(config, seed=0):
    """A random-weight transformers T5ForConditionalGeneration of ``config``'s shape
    (fp32, eval mode; norm weights perturbed so that a mapping mistake shows) and its
    params mapped to ours by hand (the HF names in models/t5.py's docstring)."""
    from hf_models import torch, transformers  # noqa: F401 (offline settings first)

    m = config.model
    torch.manual_seed(seed)
    hf_config = transformers.T5Config(
        vocab_size=m.vocab_size, d_model=m.d_model, d_kv=m.head_dim, d_ff=m.ff_dim,
        num_layers=m.num_layers, num_decoder_layers=m.decoder_layers, num_heads=m.num_heads,
        relative_attention_num_buckets=m.relative_attention_num_buckets,
        relative_attention_max_distance=m.relative_attention_max_distance,
        dropout_rate=0.0, layer_norm_epsilon=m.layer_norm_eps,
        feed_forward_proj=m.feed_forward_proj, tie_word_embeddings=m.tie_embeddings,
        decoder_start_token_id=m.decoder_start_token, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    hf = transformers.T5ForConditionalGeneration(hf_config)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.float().eval()
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    kernel = lambda name: {"kernel": sd[f"{name}.weight"].T}
    attention = lambda name: {p: kernel(f"{name}.{p}") for p in "qkvo"}
    norm = lambda name: {"scale": sd[f"{name}.weight"]}
    ff_names = ("wi_0", "wi_1", "wo") if m.feed_forward_proj == "gated-gelu" else ("wi", "wo")
    ff = lambda layer: {n: kernel(f"{layer}.DenseReluDense.{n}") for n in ff_names}

    def block(stack, i):
        layer = f"{stack}.block.{i}.layer"
        out = {
            "self_attention_layer_norm": norm(f"{layer}.0.layer_norm"),
            "SelfAttention": attention(f"{layer}.0.SelfAttention"),
        }
        last = 1
        if stack == "decoder":
            out["cross_attention_layer_norm"] = norm(f"{layer}.1.layer_norm")
            out["EncDecAttention"] = attention(f"{layer}.1.EncDecAttention")
            last = 2
        out["ff_layer_norm"] = norm(f"{layer}.{last}.layer_norm")
        out["DenseReluDense"] = ff(f"{layer}.{last}")
        return out

    stack = lambda blocks: jax.tree.map(lambda *a: np.stack(a), *blocks)
    bias = lambda s: sd[f"{s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    params = {
        "embed": {
            "shared": sd["shared.weight"],
            "encoder_relative_attention_bias": bias("encoder"),
            "decoder_relative_attention_bias": bias("decoder"),
            "encoder_final_layer_norm": norm("encoder.final_layer_norm"),
        },
        "encoder": stack([block("encoder", i) for i in range(m.num_layers)]),
        "decoder": stack([block("decoder", i) for i in range(m.decoder_layers)]),
        "head": {"final_layer_norm": norm("decoder.final_layer_norm")},
    }
    if not m.tie_embeddings:
        params["head"]["lm_head"] = kernel("lm_head")
    return hf, params


@pytest.mark.slow
@pytest.mark.parametrize("ff, tied", [("gated-gelu", False), ("relu", True)])
def test_logits_and_buckets_equal_transformers(tiny, ff, tied):
    """Random-weight HF T5 (v1.1 untied, v1.0 tied): our logits and loss within 1e-4 in
    fp32 (T 24 reaches the logarithmic buckets), and the position buckets exact."""
    from hf_models import torch

    from models.t5 import relative_position_buckets

    config = t5_config(tiny, feed_forward_proj=ff, tie_embeddings=tied)
    model = build_model(config.model)
    hf, params = _hf_t5(config)
    assert jax.tree.structure(params) == jax.tree.structure(
        jax.eval_shape(model.init, jax.random.key(0))
    )
    rng = np.random.default_rng(3)
    tokens, targets = (rng.integers(0, 256, (2, 24)).astype(np.int32) for _ in range(2))
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(targets).long())
    ours = np.asarray(jax.jit(model.logits)(params, tokens, targets))
    np.testing.assert_allclose(ours, out.logits.numpy(), rtol=1e-4, atol=1e-4 * np.abs(ours).max())
    assert_losses_close(jax.jit(model.loss)(params, tokens, targets), float(out.loss), rtol=1e-4)

    transformers_bucket = hf.encoder.block[0].layer[0].SelfAttention._relative_position_bucket
    for T in (7, 64, 300):
        relative = torch.arange(T)[None, :] - torch.arange(T)[:, None]
        for bidirectional in (True, False):
            for buckets, distance in ((32, 128), (8, 12)):
                expected = transformers_bucket(relative, bidirectional, buckets, distance).numpy()
                ours = relative_position_buckets(T, T, bidirectional, buckets, distance)
                np.testing.assert_array_equal(ours, expected)


@pytest.mark.slow
def test_zero3_on_4_devices_equals_single_device(reference, tiny, tmp_path):
    """ZeRO-3 over 4 devices: each device runs its rows of every stage function; the
    decoder's context is its rows of the encoder's output (split as activations are) and
    a copy of the bias table per device, whose gradient (a device's partial sum) reaches
    the embed stage's gradient slab, reduce-scattered with the rest of it."""
    config = t5_config(tiny).replace(
        train=SHORT,
        optimizer=SGD,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=4),
    )
    result = train(config, tmp_path / "zero", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), t5_tokens())
    norms = [[r["grad_norm"] for r in run.records] for run in (result, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)
