"""T5 (models/t5.py): an encoder and a decoder stage group, the prefix-LM objective, against
HF's T5ForConditionalGeneration, and trained by the runtimes."""

import dataclasses
import json

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
from hetjax.data import SPAN_STREAM, Spans, TokenWindows, make_datasets, split_window
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
    """The support matrix's model axis (hetjax/support.py) refuses swapped blocks for an
    encoder-decoder: the config does, and so does the runtime from the built model's
    stage groups (what a custom model, unknown to the config, reaches)."""
    refused = r"'offload.swap_blocks' \(1\): swapped activations are not supported for an encoder"
    with pytest.raises(ConfigError, match=refused):
        t5_config(tiny).replace(offload=dict(mode="stream", swap_blocks=1))
    config = t5_config(tiny).replace(offload=dict(mode="stream"))
    swapping = dataclasses.replace(config.offload, swap_blocks=1)
    object.__setattr__(config, "offload", swapping)  # past the config's own check
    with pytest.raises(ConfigError, match=refused):
        from hetjax.runtime.streaming import StreamingRuntime

        StreamingRuntime(config)


@pytest.mark.parametrize(
    "sections, key",
    [
        (dict(data=dict(objective="prefix_lm")), "data.objective"),
        (dict(data=dict(objective="span_corruption")), "data.objective"),
        (
            dict(
                model=dict(family="t5"),
                data=dict(objective="span_corruption"),
                offload=dict(mode="stream", activations="nvme"),
            ),
            "offload.activations",
        ),
        (dict(data=dict(noise_density=1.0)), "data.noise_density"),
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
    data = TokenWindows(tokens=tokens, seq_len=8, batch_size=2, window=16)
    assert data.num_windows == (100 - 16) // 8 + 1
    batch = data.batch(0)
    assert batch.shape == (2, 16)
    inputs, targets = split_window("prefix_lm", batch, 8)
    np.testing.assert_array_equal(inputs, [np.arange(0, 8), np.arange(8, 16)])
    np.testing.assert_array_equal(targets, [np.arange(8, 16), np.arange(16, 24)])
    np.testing.assert_array_equal(targets[0], inputs[1])


@pytest.mark.parametrize("seq_len", [8, 16, 64, 100, 511, 1024])
def test_span_corruption_rows(seq_len):
    """A corrupted window: the encoder reads exactly T tokens, sentinel i (from the top
    of the vocabulary down) in place of span i; the targets are each span behind its
    sentinel, none empty; putting the spans back in place of their sentinels gives the
    raw window."""
    spans = Spans.for_inputs(seq_len, 0.15, 3.0)
    assert spans.noise == round(spans.window * 0.15)
    raw = np.arange(spans.window, dtype=np.int32)
    V = 100_000
    row = spans.corrupt(raw, V, np.random.default_rng(seq_len))
    assert row.shape == (seq_len + spans.targets,)
    inputs, targets = split_window("span_corruption", row, seq_len)
    sentinels = V - 1 - np.arange(spans.spans)
    assert inputs[0] == raw[0]  # a kept run comes first, not a sentinel
    np.testing.assert_array_equal(inputs[inputs > V - 1 - spans.spans], sentinels)
    np.testing.assert_array_equal(targets[targets > V - 1 - spans.spans], sentinels)
    pieces = np.split(targets, np.flatnonzero(targets > V - 1 - spans.spans)[1:])
    assert all(len(p) > 1 for p in pieces), pieces
    span_of = {int(p[0]): p[1:] for p in pieces}
    rebuilt = np.concatenate([span_of.get(int(t), [t]) for t in inputs])
    np.testing.assert_array_equal(rebuilt, raw)


def test_span_corruption_lengths_are_t5s():
    """T5's C4 span corruption: inputs of 512 tokens (511 and an end-of-sequence token)
    come from 568 raw tokens, with 114 targets (113 and the end token)."""
    assert Spans.for_inputs(511, 0.15, 3.0) == Spans(window=568, noise=85, spans=28)
    assert Spans.for_inputs(511, 0.15, 3.0).targets == 113


def test_span_corruption_is_the_windows(tiny):
    """A window is corrupted by its index and the seed alone: the same in every pass
    over the data and whichever process reads it; another seed drops other spans."""
    config = t5_config(tiny, vocab_size=264, max_seq_len=64).replace(
        data=dict(objective="span_corruption"), train=dict(seq_len=64)
    )
    train_data, _, _ = make_datasets(config)
    spans = train_data.spans
    assert spans.spans > 1  # one span would always be the window's tail
    assert train_data.batch(0).shape == (4, 64 + spans.targets)
    # the next pass's read of batch 0 row 0's window (unshuffled: window i B + r)
    again = train_data.num_windows
    np.testing.assert_array_equal(train_data.batch(again // 4)[again % 4], train_data.batch(0)[0])
    k = train_data.window_index(3, 1)
    raw = np.asarray(train_data.tokens[k * 64 : k * 64 + spans.window]).astype(np.int32)
    expect = spans.corrupt(raw, 264, np.random.default_rng([config.train.seed, SPAN_STREAM, k]))
    np.testing.assert_array_equal(train_data.batch(3)[1], expect)
    halves = [
        dataclasses.replace(train_data, process_index=p, process_count=2).batch(3) for p in (0, 1)
    ]
    np.testing.assert_array_equal(np.concatenate(halves), train_data.batch(3))
    reseeded = dataclasses.replace(train_data, seed=1).batch(3)
    assert not np.array_equal(reseeded, train_data.batch(3))


def test_span_corruption_needs_room_for_sentinels(tiny):
    """The tests' slice of the byte corpus uses ids up to 125: a vocabulary of 126
    leaves no id for the sentinel."""
    config = t5_config(tiny, vocab_size=126).replace(data=dict(objective="span_corruption"))
    with pytest.raises(ConfigError, match=r"sentinels take ids .* raise model\.vocab_size"):
        make_datasets(config)


@pytest.mark.slow  # 17 s cold; T5 streamed on NVMe == none: test_stream_nvme_equals_none
def test_span_corruption_stream_nvme_equals_none(tiny, tmp_path):
    """Span corruption's decoder is shorter than its encoder (T 16: 4 targets): streamed
    with params and optimizer state on NVMe, two blocks kept, it trains as
    offload.mode=none."""
    config = t5_config(tiny, vocab_size=264).replace(
        data=dict(objective="span_corruption"), train=SHORT, optimizer=SGD
    )
    reference = train(config.replace(offload=dict(mode="none")), tmp_path / "ref", verbose=False)
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=2)
    result = train(config.replace(offload=offload), tmp_path / "stream", verbose=False)
    assert np.all(np.isfinite(reference.losses))
    assert_training_equal(result, reference, build_model(config.model), t5_tokens())


def test_span_corruption_flops_count_the_shorter_decoder(tiny):
    """The FLOPs per row (the MFU's, the planner's): the encoder's blocks over T tokens,
    the decoder's blocks and the head over the targets, the decoder's self-attention over
    the targets and its cross-attention over T; at equal lengths, flops_per_token x T;
    the planner's step and block FLOPs follow the objective."""
    from hetjax.planning.workload import Workload

    config = t5_config(tiny, vocab_size=264, max_seq_len=64)
    model = build_model(config.model)
    T, S, D = 64, 15, 32  # span corruption at T 64: 15 targets
    enc = model.groups[0].num_layers * model.block_param_count(0)
    dec = model.groups[1].num_layers * model.block_param_count(1)
    head = model.param_count() - model.stage_param_count("embed") - enc - dec
    attention = 12 * D * (2 * T * T + 3 * (S * S + S * T))
    assert model.flops_per_row(T, S) == pytest.approx(6 * (enc * T + (dec + head) * S) + attention)
    assert model.flops_per_row(T, T) == pytest.approx(model.flops_per_token(T) * T)
    prefix = config.replace(train=dict(seq_len=T), offload=dict(mode="stream"))
    span = prefix.replace(data=dict(objective="span_corruption"))
    assert Spans.for_inputs(T, 0.15, 3.0).targets == S
    w_prefix, w_span = (Workload.from_config(c, backend="cpu") for c in (prefix, span))
    rows = config.train.batch_size
    assert w_prefix.flops_per_step == pytest.approx(model.flops_per_row(T, T) * rows)
    assert w_span.flops_per_step == pytest.approx(model.flops_per_row(T, S) * rows)
    assert w_span.block_fwd_flops < w_prefix.block_fwd_flops
    assert w_span.head_fwd_flops == pytest.approx(w_prefix.head_fwd_flops * S / T)


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
    tokens, targets = split_window(
        "prefix_lm", training_batches(config, 1)[0][0], config.train.seq_len
    )
    g = jax.grad(model.loss)(params, tokens, targets)
    g_remat = jax.grad(checked.loss)(params, tokens, targets)
    assert_trees_close(g_remat, g, rtol=1e-6)
    assert_losses_close(checked.loss(params, tokens, targets), model.loss(params, tokens, targets))


def _hf_t5(config, directory, seed=0):
    """A random-weight transformers T5ForConditionalGeneration of ``config``'s shape (fp32,
    eval mode; norm weights perturbed so that a mapping mistake shows), untied (its own
    ``lm_head``) unless ``model.tie_embeddings``, saved with save_pretrained to
    ``directory``."""
    from hf_models import torch, transformers

    m = config.model
    torch.manual_seed(seed)
    hf_config = transformers.T5Config(
        vocab_size=m.vocab_size, d_model=m.d_model, d_kv=m.head_dim, d_ff=m.ff_dim,
        num_layers=m.num_layers, num_decoder_layers=m.decoder_layers, num_heads=m.num_heads,
        relative_attention_num_buckets=m.relative_attention_num_buckets,
        relative_attention_max_distance=m.relative_attention_max_distance,
        dropout_rate=0.0, layer_norm_epsilon=m.layer_norm_eps,
        feed_forward_proj=m.feed_forward_proj, tie_word_embeddings=m.tie_embeddings,
        decoder_start_token_id=m.decoder_start_token,
    )  # fmt: skip
    hf = transformers.T5ForConditionalGeneration(hf_config)
    with torch.no_grad():
        if not m.tie_embeddings:  # transformers 5 ties every T5 it builds
            hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.shared.weight))
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.float().eval()
    hf.save_pretrained(directory)
    return hf


def _hf_outputs(hf, tokens, targets):
    from hf_models import torch

    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(targets).long())
    return out.logits.numpy(), float(out.loss)


def _imported(tiny, directory, **sections):
    """t5_config's run with the model read off the checkpoint's config.json."""
    from hetjax.hf import model_config_from_hf

    model = model_config_from_hf(directory, t5_config(tiny).model)
    return t5_config(tiny).replace(model=dataclasses.asdict(model), **sections)


# A T5 config.json with every field the import reads at a value other than hetjax's
# default (so a mapping that is dropped, and leaves the default, fails) -> the fields.
# d_kv is checked (d_model / num_heads), not mapped; pad_token_id differs from
# decoder_start_token_id, the one read.
T5_JSON = dict(
    model_type="t5", num_layers=3, num_decoder_layers=5, d_model=48, num_heads=6, d_kv=8,
    d_ff=80, vocab_size=300, layer_norm_epsilon=1e-3, relative_attention_num_buckets=16,
    relative_attention_max_distance=40, decoder_start_token_id=7, pad_token_id=3,
)  # fmt: skip
T5_FIELDS = dict(
    family="t5", num_layers=3, num_decoder_layers=5, d_model=48, num_heads=6, d_ff=80,
    vocab_size=300, layer_norm_eps=1e-3, relative_attention_num_buckets=16,
    relative_attention_max_distance=40, decoder_start_token=7,
)  # fmt: skip


@pytest.mark.parametrize(
    "head_json, fields, at_default",
    [
        # T5 v1.1 as transformers 5 writes it: tie_word_embeddings always true, the
        # untied head in scale_decoder_outputs; gated-gelu is hetjax's default
        (
            dict(feed_forward_proj="gated-gelu", dense_act_fn="gelu_new",
                 tie_word_embeddings=True, scale_decoder_outputs=False),
            dict(feed_forward_proj="gated-gelu", tie_embeddings=False),
            {"feed_forward_proj"},
        ),
        # ReLU as transformers < 5 writes an untied head: tie_word_embeddings false
        (
            dict(feed_forward_proj="relu", tie_word_embeddings=False),
            dict(feed_forward_proj="relu", tie_embeddings=False),
            set(),
        ),
    ],
    ids=["gated_gelu_transformers5", "relu_transformers4"],
)  # fmt: skip
def test_config_json_fields_map_to_non_default_values(tmp_path, head_json, fields, at_default):
    from hetjax.config import ModelConfig
    from hetjax.hf import model_config_from_hf

    expected = {**T5_FIELDS, **fields}
    defaults = ModelConfig()
    assert {k for k, v in expected.items() if getattr(defaults, k) == v} == at_default
    (tmp_path / "config.json").write_text(json.dumps({**T5_JSON, **head_json}))
    config = model_config_from_hf(tmp_path, ModelConfig())
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.init_from == f"hf:{tmp_path}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """ff -> (transformers model, its save_pretrained directory): T5 v1.1 (gated GELU,
    untied head) and v1.0 (ReLU, head tied to the embedding and the output scaled), each
    built when a test first asks for it (the default run's test needs only one)."""
    from conftest import tiny_config

    built = {}

    def get(ff: str):
        if ff not in built:
            directory = tmp_path_factory.mktemp(ff)
            tied = {"gated-gelu": False, "relu": True}[ff]
            config = t5_config(tiny_config, feed_forward_proj=ff, tie_embeddings=tied)
            built[ff] = (_hf_t5(config, directory), directory)
        return built[ff]

    return get


# gated-gelu (v1.1) runs in the default run: ~5 s on 2 cores, building the transformers
# model included; relu (v1.0, the tied and scaled head) is slow
@pytest.mark.parametrize("ff", ["gated-gelu", pytest.param("relu", marks=pytest.mark.slow)])
def test_import_logits_equal_transformers(checkpoint, tiny, ff):
    """Random-weight HF T5 (v1.1 untied, v1.0 tied) imported: logits and loss within
    1e-4 in fp32 (T 24 reaches the logarithmic position buckets)."""
    from hetjax.hf import open_checkpoint

    hf, directory = checkpoint(ff)
    config = _imported(tiny, directory)
    assert config.model.feed_forward_proj == ff and config.model.decoder_layers == 3
    model = build_model(config.model)
    params = open_checkpoint(config.model).params()
    rng = np.random.default_rng(3)
    tokens, targets = (rng.integers(0, 256, (2, 24)).astype(np.int32) for _ in range(2))
    logits, loss = _hf_outputs(hf, tokens, targets)
    ours = np.asarray(jax.jit(model.logits)(params, tokens, targets))
    np.testing.assert_allclose(ours, logits, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
    assert_losses_close(jax.jit(model.loss)(params, tokens, targets), loss, rtol=1e-4)


@pytest.mark.slow
def test_position_buckets_equal_transformers():
    from hf_models import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    from models.t5 import relative_position_buckets

    for T in (7, 64, 300):
        relative = torch.arange(T)[None, :] - torch.arange(T)[:, None]
        for bidirectional in (True, False):
            for buckets, distance in ((32, 128), (8, 12)):
                expected = T5Attention._relative_position_bucket(
                    relative, bidirectional, buckets, distance
                ).numpy()
                ours = relative_position_buckets(T, T, bidirectional, buckets, distance)
                np.testing.assert_array_equal(ours, expected)


@pytest.mark.slow
def test_one_sgd_step_equals_transformers(checkpoint, tiny):
    """Loss before and after one SGD step on the same window, hetjax vs PyTorch."""
    import copy

    from hf_models import torch

    hf, directory = checkpoint("gated-gelu")
    lr = 0.5
    optimizer = dict(
        name="sgd", momentum=0.0, lr=lr, grad_clip=0.0, warmup_steps=0, schedule="constant"
    )
    runtime = InMemoryRuntime(_imported(tiny, directory, optimizer=optimizer))
    window = np.random.default_rng(5).integers(0, 256, (2, 32)).astype(np.int32)
    loss = runtime.train_step(window[None]).loss
    after = runtime.eval_loss(window)
    torch_model = copy.deepcopy(hf)
    inputs = dict(
        input_ids=torch.from_numpy(window[:, :16]).long(),
        labels=torch.from_numpy(window[:, 16:]).long(),
    )
    torch_loss = torch_model(**inputs).loss
    torch_loss.backward()
    with torch.no_grad():
        for p in torch_model.parameters():
            p -= lr * p.grad
        torch_after = float(torch_model(**inputs).loss)
    assert after < loss - 0.01  # the step did something
    torch_loss = float(torch_loss.detach())
    np.testing.assert_allclose([loss, after], [torch_loss, torch_after], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ff", ["gated-gelu", "relu"])
def test_export_round_trip_and_transformers_load(checkpoint, tiny, tmp_path, ff):
    """Export writes the tensor names save_pretrained writes, re-imports exactly, and
    transformers loads it as the model it came from (its head untied or tied alike)."""
    from safetensors import safe_open
    from transformers import AutoModelForSeq2SeqLM, T5ForConditionalGeneration

    from hetjax.export import export_hf
    from hetjax.hf import model_config_from_hf, open_checkpoint

    hf, directory = checkpoint(ff)
    config = _imported(tiny, directory)
    params = open_checkpoint(config.model).params()
    export_hf(config.model, params, tmp_path)
    names = lambda d: set(safe_open(d / "model.safetensors", framework="numpy").keys())
    assert names(tmp_path) == names(directory)
    again = model_config_from_hf(tmp_path, config.model)
    assert dataclasses.replace(again, init_from="") == dataclasses.replace(
        config.model, init_from=""
    )
    jax.tree.map(np.testing.assert_array_equal, open_checkpoint(again).params(), params)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).float().eval()
    assert isinstance(loaded, T5ForConditionalGeneration)
    tokens, targets = t5_tokens()
    np.testing.assert_allclose(
        _hf_outputs(loaded, tokens, targets)[0], _hf_outputs(hf, tokens, targets)[0], atol=1e-5
    )


@pytest.mark.slow
def test_stream_nvme_import_equals_in_memory(checkpoint, tiny, tmp_path):
    """A T5 imported stage by stage into params and optimizer state on NVMe holds the
    params the in-memory import does."""
    from hetjax.hf import open_checkpoint
    from hetjax.runtime.streaming import StreamingRuntime

    directory = checkpoint("gated-gelu")[1]
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    stream = StreamingRuntime(_imported(tiny, directory, offload=offload), workdir=tmp_path)
    try:
        expected = open_checkpoint(_imported(tiny, directory).model).params()
        jax.tree.map(np.testing.assert_array_equal, stream.params(), expected)
    finally:
        stream.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(d_kv=16), "d_kv = 16 is not supported"),
        (dict(feed_forward_proj="gated-silu"), "feed_forward_proj"),
        (dict(num_decoder_layers=2), "model.num_decoder_layers is 3 but the checkpoint has 2"),
    ],
)
def test_import_errors_name_the_field(checkpoint, tiny, tmp_path, edit, message):
    import json
    import shutil

    from hetjax.hf import open_checkpoint

    directory = checkpoint("gated-gelu")[1]
    for f in directory.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config_json = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, **edit}))
    config = t5_config(tiny).replace(model=dict(init_from=f"hf:{tmp_path}"))
    with pytest.raises(ConfigError, match=message):
        open_checkpoint(config.model)


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


# -- T5-MoE (Switch): every other layer's feed-forward layer experts, top-1 routing --------

# 2 encoder layers (one block: a dense and a sparse layer), 4 decoder layers (two blocks)
MOE = dict(
    num_layers=2, num_decoder_layers=4, num_experts=4, experts_per_token=1,
    router_aux_loss_coef=0.02, feed_forward_proj="relu",
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    from conftest import tiny_config

    config = t5_config(tiny_config, **MOE).replace(
        train=SHORT, optimizer=SGD, offload=dict(mode="none")
    )
    return train(config, tmp_path_factory.mktemp("moe_ref"), verbose=False)


@pytest.mark.slow
def test_moe_blocks_and_aux_loss(tiny):
    """A block is a dense and a sparse layer (Switch's every other layer); the loss is
    the cross-entropy plus coef x each stack's load-balancing loss (E sum_e f_e P_e over
    the stack's sparse layers), and the router's gradient has it."""
    from models.staged import token_loss

    config = t5_config(tiny, **MOE)
    model = build_model(config.model)
    assert [(g.name, g.num_layers) for g in model.groups] == [("encoder", 1), ("decoder", 2)]
    assert config.model.num_blocks == 3
    params = model.init(jax.random.key(0))
    assert params["decoder"]["sparse"]["moe"]["wi"].shape == (2, 4, 32, 64)  # (L, E, D, F)
    assert "DenseReluDense" in params["decoder"]["dense"]
    tokens, targets = t5_tokens()
    c = model._compute
    e = c(params["embed"])
    x, context = model.group_input(0, e, None, tokens, targets)
    x, enc = model._run_group(0, c(params["encoder"]), x, context)
    y, context = model.group_input(1, e, x, tokens, targets)
    y, dec = model._run_group(1, c(params["decoder"]), y, context)
    ce = token_loss(model.head_logits(c(params["head"]), e, y), targets)
    E = 4
    for stats, layers, slot in ((enc, 1, 0), (dec, 2, 1)):
        part = stats[2 * E * slot : 2 * E * (slot + 1)] / layers
        np.testing.assert_allclose(part[:E].sum(), 1.0, rtol=1e-6)  # every token routed once
        assert not np.any(stats[2 * E * (1 - slot) : 2 * E * (2 - slot)])  # the other slot
    balance = sum(
        E * np.sum(s[2 * E * k : 2 * E * k + E] / n * s[2 * E * k + E : 2 * E * (k + 1)] / n)
        for s, n, k in ((enc, 1, 0), (dec, 2, 1))
    )
    np.testing.assert_allclose(model.loss(params, tokens, targets), ce + 0.02 * balance, rtol=1e-6)
    off = build_model(t5_config(tiny, **{**MOE, "router_aux_loss_coef": 0.0}).model)
    router = lambda m: jax.grad(m.loss)(params, tokens, targets)["encoder"]["sparse"]["moe"]
    assert not np.allclose(router(model)["router"], router(off)["router"])
    # a token's forward uses one expert of the four
    expert = 2 * 32 * 64
    assert model.group_active_params(1) == model.block_param_count(1) - 3 * expert


@pytest.mark.slow
def test_moe_stream_nvme_equals_none(moe_reference, tiny, tmp_path):
    """T5-MoE streamed with the optimizer and params on NVMe (the last block kept)
    equals offload.mode=none: the router statistics of every block, in their stack's
    slot, make the auxiliary loss, whose cotangent every block's backward takes."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=1)
    config = t5_config(tiny, **MOE).replace(train=SHORT, optimizer=SGD, offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert moe_reference.losses[-1] < moe_reference.losses[0]
    assert_training_equal(result, moe_reference, build_model(config.model), t5_tokens())


@pytest.mark.slow
def test_moe_zero3_on_4_devices_equals_single_device(moe_reference, tiny, tmp_path):
    """ZeRO-3 over 4 devices: the router statistics are averaged over the devices
    (batch means), so the auxiliary loss pools the whole micro-batch as one device's."""
    config = t5_config(tiny, **MOE).replace(
        train=SHORT,
        optimizer=SGD,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=4),
    )
    result = train(config, tmp_path, verbose=False)
    assert_training_equal(result, moe_reference, build_model(config.model), t5_tokens())


@pytest.mark.slow
def test_streamed_checkpoint_resumes_from_in_memory_one(reference, tiny, tmp_path):
    """A T5 checkpoint written by offload.mode=none after 2 steps (stages encoder{i},
    decoder{i}) resumes under offload.mode=stream with NVMe state; the 4 steps equal the
    uninterrupted in-memory run."""
    sections = dict(optimizer=SGD, checkpoint=dict(every_steps=0, at_end=True))
    first = t5_config(tiny).replace(
        train=dict(SHORT, steps=2), offload=dict(mode="none"), **sections
    )
    train(first, tmp_path, verbose=False)
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    resumed = train(
        t5_config(tiny).replace(train=SHORT, offload=offload, **sections), tmp_path, verbose=False
    )
    assert_losses_close(resumed.losses, reference.losses[2:])
    assert_trees_close(resumed.params, reference.params)
