"""hetjax generate: greedy decoding with a KV cache equals transformers' generate token
for token on tiny random GPT-2, Llama and Mixtral checkpoints, in memory and with the
blocks streamed from NVMe; batched prompts of different lengths equal each prompt
alone; sampling with a seed is reproducible."""

import dataclasses

import numpy as np
import pytest
import torch
from hf_models import build_hf_model

from hetjax.hf import model_config_from_hf
from hetjax.inference import Sampling, generate, open_blocks, run, sample

NEW = 12  # new tokens per prompt


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its save_pretrained directory), each built when
    first asked for."""
    built = {}

    def get(family):
        if family not in built:
            model = build_hf_model(family)
            directory = tmp_path_factory.mktemp(family)
            model.save_pretrained(directory)
            built[family] = (model, directory)
        return built[family]

    return get


def _prompts(lengths=(7, 7), seed=5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy generate of equal-length prompts: the new tokens."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def _config(tiny, directory, **offload):
    model = model_config_from_hf(directory, tiny().model)
    return tiny(model=dataclasses.asdict(model), offload=offload or dict(mode="none"))


GREEDY = Sampling()


def _ours(tiny, directory, tmp_path, prompts, sampling=GREEDY, **offload):
    blocks, _ = open_blocks(_config(tiny, directory, **offload), scratch=tmp_path)
    try:
        return generate(blocks, prompts, NEW, sampling)
    finally:
        if hasattr(blocks, "runtime"):
            blocks.runtime.close()


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        pytest.param("gpt2", marks=pytest.mark.slow),  # ~10 s each
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_transformers_in_memory(checkpoints, tiny, tmp_path, family):
    hf_model, directory = checkpoints(family)
    prompts = _prompts()
    expected = hf_greedy(hf_model, prompts, NEW)
    assert _ours(tiny, directory, tmp_path, prompts) == expected


@pytest.mark.parametrize(
    "family",
    [
        "llama",  # the default run's check of offloaded inference (~7 s)
        pytest.param("gpt2", marks=pytest.mark.slow),  # ~7 s each
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_transformers_streamed_from_nvme(checkpoints, tiny, tmp_path, family):
    """offload.mode=stream, params on NVMe: the inference runtime
    (hetjax/runtime/inference.py) brings every block's params through the prefetch
    window from their files for the prefill and for each new token, with no optimizer
    state anywhere."""
    hf_model, directory = checkpoints(family)
    prompts = _prompts()
    expected = hf_greedy(hf_model, prompts, NEW)
    config = _config(tiny, directory, mode="stream", params="nvme")
    blocks, _ = open_blocks(config, scratch=tmp_path)
    try:
        store = blocks.runtime.param_store
        assert type(store).__name__ == "NvmeParamStore"
        assert "no optimizer state" in blocks.describe()  # the plan printed
        assert generate(blocks, prompts, NEW) == expected
        # each block read from its file once per forward (the prefill and NEW - 1
        # tokens), embed and head once
        blocks_read = {f"block{i}": NEW for i in range(config.model.num_layers)}
        assert store.stage_reads == {"embed": 1, "head": 1, **blocks_read}
    finally:
        blocks.runtime.close()
    # the params' files and nothing else: no optimizer state
    assert [p.name for p in (tmp_path / "nvme").iterdir()] == ["inference"]


# ~30 s on 2 busy cores: four generations
@pytest.mark.slow
def test_batched_prompts_equal_each_alone(checkpoints, tiny, tmp_path):
    """Prompts of 3, 9 and 6 tokens left-padded into one batch: each row's greedy
    tokens equal that prompt run alone."""
    _, directory = checkpoints("llama")
    prompts = _prompts((3, 9, 6))
    batched = _ours(tiny, directory, tmp_path, prompts)
    for prompt, row in zip(prompts, batched, strict=True):
        assert _ours(tiny, directory, tmp_path, [prompt]) == [row]


# ~6 s: four generations
@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible(checkpoints, tiny, tmp_path):
    _, directory = checkpoints("llama")
    prompts = _prompts()
    hot = lambda seed: Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=seed)
    first = _ours(tiny, directory, tmp_path, prompts, hot(1))
    assert _ours(tiny, directory, tmp_path, prompts, hot(1)) == first
    assert _ours(tiny, directory, tmp_path, prompts, hot(2)) != first  # the seed matters
    assert first != _ours(tiny, directory, tmp_path, prompts)  # not greedy


def test_top_k_and_top_p_keep_only_their_tokens():
    """logits over 4 tokens with probabilities 0.5, 0.3, 0.15, 0.05 (by hand): top-k 2
    draws only tokens 0 and 1; top-p 0.7 only 0 and 1 (0.5 < 0.7, 0.8 >= 0.7); top-p
    0.4 only token 0."""
    import jax
    import jax.numpy as jnp

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 400))
    key = jax.random.key(0)
    hot = lambda **kw: Sampling(temperature=1.0, **kw)
    drawn = lambda **kw: set(np.asarray(sample(logits, key, hot(**kw))).tolist())
    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.7) == {0, 1}
    assert drawn(top_p=0.4) == {0}


def _t5(tiny, tmp_path):
    from test_t5 import _hf_t5, t5_config

    config = t5_config(tiny)
    hf = _hf_t5(config, tmp_path / "t5")
    hf.generation_config.eos_token_id = None  # every row runs the whole length
    model = model_config_from_hf(tmp_path / "t5", config.model)
    return hf, config.replace(model=dataclasses.asdict(model))


# ~7 s: the blocks streamed from host RAM
@pytest.mark.slow
def test_greedy_equals_transformers_streamed_from_host_ram(checkpoints, tiny, tmp_path):
    """offload.params=host: the inference runtime's blocks in host RAM, no files."""
    hf_model, directory = checkpoints("llama")
    prompts = _prompts()
    expected = hf_greedy(hf_model, prompts, NEW)
    assert _ours(tiny, directory, tmp_path, prompts, mode="stream", params="host") == expected
    assert not (tmp_path / "nvme").exists()


# ~15-30 s each on 2 busy cores (transformers' generate without its cache)
@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [dict(mode="none"), dict(mode="stream", params="nvme")],
    ids=["in_memory", "streamed_nvme"],
)
def test_t5_greedy_equals_transformers(tiny, tmp_path, offload):
    """T5 (2 encoder, 3 decoder blocks) with its KV cache (Seq2SeqBlocks: the encoder
    once, then one decoder pass per token against the self- and cross-attention caches):
    the decoder's greedy tokens after its start token equal transformers' generate, in
    memory and streamed from NVMe."""
    hf, config = _t5(tiny, tmp_path)
    prompts = _prompts((9, 9))
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
            do_sample=False, use_cache=False,
        )  # fmt: skip
        # (use_cache=False: transformers 5's T5 cache is sized by the encoder's layer
        # count and fails on this model's deeper decoder)
    assert out[0, 0] == config.model.decoder_start_token
    blocks, _ = open_blocks(config.replace(offload=offload), scratch=tmp_path)
    try:
        assert type(blocks).__name__ == "Seq2SeqBlocks"
        assert run(blocks, prompts, NEW) == out[:, 1:].tolist()
    finally:
        if getattr(blocks, "runtime", None) is not None:
            blocks.runtime.close()


def test_prompt_outside_the_vocabulary_is_refused(checkpoints, tiny, tmp_path):
    """A token id the model lacks (a tokenizer that is not the model's) stops generate
    with an error naming the vocabulary, instead of an embedding lookup clamped."""
    from hetjax.config import ConfigError

    _, directory = checkpoints("llama")
    with pytest.raises(ConfigError, match="token id 300, outside the model's vocabulary"):
        _ours(tiny, directory, tmp_path, [[1, 2, 300]])


def _printer(texts, tty=False, width=0):
    import io

    from hetjax.generate import TokenPrinter
    from hetjax.instruct import Tokens

    tokens = Tokens("")  # bytes
    tokens.eos = 0
    out = io.StringIO()
    return TokenPrinter(tokens, texts, out, tty, width), out


# each step's tokens of two rows: "x" "y", then "z" and row 1's end, then both ended
STEPS = [[ord("x"), ord("y")], [ord("z"), 0], [0, 0]]
ROWS = [[ord("x"), ord("z"), 0], [ord("y"), 0]]


def test_batched_prompts_print_as_they_come_tagged_by_prompt():
    """Several prompts, output not a terminal: each step's new text of each row on a
    line tagged by its prompt's index, as it comes; then each prompt and its text."""
    show, out = _printer(["ab", "c"])
    for i, step in enumerate(STEPS):
        show(i, np.array(step))
        if i == 0:
            assert out.getvalue() == "[0] 'x'\n[1] 'y'\n"  # printed before the next step
    show.finish(ROWS)
    assert out.getvalue() == "[0] 'x'\n[1] 'y'\n[0] 'z'\nabxz\ncy\n"


def test_batched_prompts_on_a_terminal_rewrite_one_line_each():
    """On a terminal: one line per prompt, each step moves the cursor back up two lines
    (ESC [2F) and writes both lines again (ESC [2K clears one); a line as wide as the
    terminal is cut to its end behind "..." (it would wrap and not be rewritten)."""
    show, out = _printer(["ab", "c"], tty=True)
    for i, step in enumerate(STEPS[:2]):
        show(i, np.array(step))
    show.finish(ROWS)
    line = lambda a, b: f"\x1b[2K{a}\n\x1b[2K{b}\n"
    drawn = [line("ab", "c"), line("abx", "cy"), line("abxz", "cy"), line("abxz", "cy")]
    assert out.getvalue() == "\x1b[2F".join(drawn)
    show, out = _printer(["abcde", "c"], tty=True, width=6)
    show(0, np.array([ord("f"), 0]))
    assert out.getvalue().endswith("\x1b[2F\x1b[2K...ef\n\x1b[2Kc\n")


def test_one_prompt_prints_its_text_appended():
    show, out = _printer(["ab"])
    show(0, np.array([ord("x")]))
    assert out.getvalue() == "abx"
    show(1, np.array([0]))
    show.finish([[ord("x"), 0]])
    assert out.getvalue() == "abx\n"


def _tiny_t5(tiny):
    import jax
    from test_t5 import t5_config

    from models import build_model

    model = build_model(t5_config(tiny).model)
    return model, jax.jit(model.init)(jax.random.key(3))


# ~10 s: a tiny random T5's encoder, decoder step and whole model compiled
def test_t5_kv_cache_equals_the_whole_model_per_token(tiny):
    """A tiny random T5 (no transformers): greedy with the KV cache equals running the
    whole model again for every new token, on prompts of 9, 4 and 6 tokens in one
    batch (right-padded, the padding masked)."""
    from hetjax.inference import Seq2SeqBlocks, WholeModel, generate_seq2seq

    model, params = _tiny_t5(tiny)
    prompts = _prompts((9, 4, 6))
    cached = generate_seq2seq(Seq2SeqBlocks(model, params), prompts, 8)
    assert generate_seq2seq(WholeModel(model, params), prompts, 8) == cached


# ~20 s: three more prompt lengths compiled
@pytest.mark.slow
def test_t5_batched_prompts_equal_each_alone(tiny):
    """Prompts of 9, 4 and 6 tokens right-padded into one batch, the padding masked in
    the encoder and the cross-attention: each row equals its prompt alone."""
    from hetjax.inference import Seq2SeqBlocks, generate_seq2seq

    model, params = _tiny_t5(tiny)
    blocks = Seq2SeqBlocks(model, params)
    prompts = _prompts((9, 4, 6))
    batched = generate_seq2seq(blocks, prompts, 8)
    for prompt, row in zip(prompts, batched, strict=True):
        assert generate_seq2seq(blocks, [prompt], 8) == [row]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "a", "--max-new-tokens", "-3"], "--max-new-tokens must be 1 or more, got -3"),
        (["--prompt", "a", "--top-p", "0"], "sampling needs temperature >= 0"),
        ([], "give --prompt TEXT"),
        (["--prompts", "PROMPTS"], "PROMPTS line 2: not UTF-8 text"),
        (["--prompts", "MISSING"], "--prompts 'MISSING': No such file"),
        (["--prompt", "a", "--tokenizer", "MISSING"], "no tokenizer file 'MISSING'"),
    ],
    ids=[
        "max_new_tokens",
        "top_p",
        "no_prompt",
        "prompts_not_utf8",
        "no_prompts_file",
        "no_tokenizer",
    ],
)
def test_bad_arguments_refused_before_loading(tmp_path, capsys, args, message):
    """Every argument and prompt is checked before anything loads (the workdir named
    has no checkpoint; the model would load first otherwise): one line on stderr, exit
    status 2."""
    from hetjax import cli

    (tmp_path / "prompts.txt").write_bytes(b"fine\n\xff\xfe\n")
    places = {"PROMPTS": str(tmp_path / "prompts.txt"), "MISSING": str(tmp_path / "missing")}
    args = [places.get(a, a) for a in args]
    for placeholder, path in places.items():
        message = message.replace(placeholder, path)
    assert cli.main(["generate", "--workdir", str(tmp_path / "none"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
