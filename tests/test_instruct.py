"""data.format=jsonl: records read and tokenised (bytes here), packed into rows with
positions and completion-only targets written out by hand; bad records refused naming
their line; a jsonl run trains in memory and streamed alike."""

import json

import numpy as np
import pytest
from equivalence import assert_evaluation_equal, assert_losses_close

from hetjax.config import ConfigError
from hetjax.data import split_window
from hetjax.instruct import IGNORED, Tokens, pack, read_records
from hetjax.train import train

X = IGNORED


def _write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_records_packed_by_hand(tmp_path):
    """Bytes: "ab" -> "c" is ids 97 98 99 (prompt 2); text "xyz" is 120 121 122 (every
    token after the first a target); "pq" -> "rstu" (6 ids) does not fit the first row's
    2 free positions of 8 and starts the second; a 10-id record is cut to 8, counted."""
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "ab", "completion": "c"},
            {"text": "xyz"},
            {"prompt": "pq", "completion": "rstu"},
            {"prompt": "0123456", "completion": "789"},
        ],
    )
    packed = pack(read_records(path, Tokens(""), 256), seq_len=8)
    assert packed.cut == 1 and packed.records == 4
    ids, pos, tgt = (packed.rows[:, i] for i in range(3))
    np.testing.assert_array_equal(ids[0], [97, 98, 99, 120, 121, 122, 0, 0])
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 0, 1, 2, 0, 1])
    np.testing.assert_array_equal(tgt[0], [X, 99, X, 121, 122, X, X, X])
    np.testing.assert_array_equal(ids[1], [112, 113, 114, 115, 116, 117, 0, 0])
    np.testing.assert_array_equal(pos[1], [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(tgt[1], [X, 114, 115, 116, 117, X, X, X])
    np.testing.assert_array_equal(ids[2], [48, 49, 50, 51, 52, 53, 54, 55])
    np.testing.assert_array_equal(tgt[2], [X] * 6 + [55, X])  # "7" after the prompt
    # a batch row is ids | positions | targets; split_window makes tokens (B, 2, T)
    tokens, targets = split_window("lm", packed.rows.reshape(3, 24), 8)
    np.testing.assert_array_equal(tokens[:, 0], ids)
    np.testing.assert_array_equal(tokens[:, 1], pos)
    np.testing.assert_array_equal(targets, tgt)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "a"}, "line 2: a record needs 'prompt' and 'completion'"),
        ({"prompt": "a", "completion": ""}, "line 2: the completion is empty"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "line 2: a 'messages' record needs the tokenizer's chat template",
        ),  # fmt: skip
        ("{not json", "line 2: not a JSON record"),
        (
            {"prompt": "a", "completion": "\u00ff"},
            "line 2: token id 195 .* outside the model's vocabulary .model.vocab_size 128.",
        ),  # fmt: skip
    ],
)
def test_bad_record_names_its_line(tmp_path, record, message):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(ConfigError, match=message):
        read_records(path, Tokens(""), 128)


def _jsonl_config(tiny, path, **offload):
    return tiny(
        data=dict(format="jsonl", path=path, shuffle=False, val_fraction=0.2),
        train=dict(steps=4, batch_size=4, seq_len=32, eval_batches=1),
        model=dict(max_seq_len=32),
        offload=offload or dict(mode="none"),
    )


def _dataset(tmp_path) -> str:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    records = [
        {"prompt": " ".join(rng.choice(words, 2)) + "?", "completion": " " + str(rng.choice(words))}
        for _ in range(60)
    ]
    return _write(tmp_path / "train.jsonl", records)


# ~30 s each on 2 busy cores: two tiny runs
@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        dict(mode="stream"),
        # a kept block and a swapped one (their vjps hold the context: the positions),
        # boundaries on the host
        dict(mode="stream", keep_blocks=1, swap_blocks=1, activations="host"),
        dict(mode="stream", params="nvme", optimizer="nvme"),
    ],
    ids=["stream", "keep_swap_host", "nvme"],
)
def test_jsonl_trains_streamed_as_in_memory(tiny, tmp_path, offload):
    """The same jsonl run in memory and streamed: per-step losses, validation loss
    within 1e-5; the loss falls."""
    path = _dataset(tmp_path)
    ref = train(_jsonl_config(tiny, path), tmp_path / "none", verbose=False)
    streamed = train(_jsonl_config(tiny, path, **offload), tmp_path / "s", verbose=False)
    assert_losses_close(streamed.losses, ref.losses)
    assert_evaluation_equal(streamed, ref)
    assert ref.losses[-1] < ref.losses[0]


# ~60 s on 2 busy cores
@pytest.mark.slow
def test_jsonl_first_loss_data_parallel_is_the_mean_of_each_devices(tiny, tmp_path):
    """ZeRO-3 over 2 devices, each its half of the micro-batch's rows: the first step's
    loss is the mean of each half's mean over its completion tokens (what the step
    reports with a mean over devices), and on one device the whole batch's mean; both
    from the initial params and the model's loss (not the runtime), 1e-5."""
    import jax

    from hetjax.instruct import make_datasets
    from models import build_model

    path = _dataset(tmp_path)
    config = _jsonl_config(tiny, path, mode="stream")
    one = train(config, tmp_path / "one", verbose=False)
    two = train(config.replace(distributed=dict(data_parallel=2)), tmp_path / "two", verbose=False)
    model = build_model(config.model)
    params = model.init(jax.random.key(config.train.seed))
    rows = make_datasets(config)[0].batch(0)  # (B, 3 T)
    loss = lambda r: float(model.loss(params, *split_window("lm", r, config.train.seq_len)))
    half = len(rows) // 2
    whole, halves = loss(rows), (loss(rows[:half]) + loss(rows[half:])) / 2
    assert abs(whole - halves) > 1e-4 * whole  # the halves' counts differ: the two differ
    assert_losses_close([one.losses[0]], [whole])
    assert_losses_close([two.losses[0]], [halves])


# -- chat records: as transformers' apply_chat_template(tokenize=True) -----------------

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML = (  # Qwen2.5's shape: a default system turn, no BOS
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
MISTRAL = (  # the system message folded into the first user turn; a BOS of its own
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}"
    "{%- endif %}{%- endfor %}"
)
GENERATION = CHATML.replace(  # transformers' assistant markers, saved as chat_template.jinja
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.role == 'assistant' %}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{%- else %}"
    "{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}",
)
SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what colour is the sky?"},
    {"role": "assistant", "content": "blue, mostly."},
    {"role": "user", "content": "and grass?"},
    {"role": "assistant", "content": "green"},
]
SHAPES = {  # name: (template, where it is saved, the tokenizer's pre-tokenizer, adds a BOS)
    "llama3_own_bos": (LLAMA3, "config", "bytes", True),
    "chatml_no_bos": (CHATML, "config", "bytes", False),
    "mistral_system_folded": (MISTRAL, "config", "metaspace", True),
    "jinja_file": (GENERATION, "file", "bytes", False),
}


def _tokenizer_dir(tmp_path, shape: str):
    """A tokenizer made here (BPE of 160 ids over the conversation's characters, so a
    256-id model takes it), saved by transformers with its chat template where the shape
    says: (directory, transformers' tokenizer loaded back from it)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, where, pre, bos = SHAPES[shape]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if pre == "metaspace":  # sentencepiece-like: a word-start marker, the first word too
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    text = [json.dumps(CONVERSATION), LLAMA3, CHATML, MISTRAL] * 4  # every character used
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", *SPECIALS])
    tok.train_from_iterator(text, trainer)
    if bos:  # as Llama's and Mistral's tokenizers: a BOS added to every encoding
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    eos = "<|eot_id|>" if template is LLAMA3 else "<|im_end|>" if "im_end" in template else "</s>"
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=eos, unk_token="<unk>"
    )
    hf.chat_template = template
    out = tmp_path / shape
    hf.save_pretrained(out)
    if where == "config":  # the older layout: the template in tokenizer_config.json
        (out / "chat_template.jinja").unlink()
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    assert (out / "chat_template.jinja").is_file() == (where == "file")
    return out, transformers.PreTrainedTokenizerFast.from_pretrained(out)


def _reference_ids(hf_tok, messages, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_chat_record_is_apply_chat_template_token_for_token(tmp_path, shape):
    """A two-turn chat record's ids equal transformers' apply_chat_template(tokenize=
    True) (one BOS where the template writes it, none added again); the loss is on both
    assistant turns: the tokens of each turn's content and end of turn, read back as
    text, and nothing of the system or user turns."""
    folder, hf_tok = _tokenizer_dir(tmp_path, shape)
    path = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    (rec,) = read_records(path, Tokens(str(folder)), 256)
    assert list(rec.ids) == _reference_ids(hf_tok, CONVERSATION)
    assert hf_tok.unk_token_id not in rec.ids
    writes_bos = shape in ("llama3_own_bos", "mistral_system_folded")
    assert rec.ids.count(hf_tok.convert_tokens_to_ids("<s>")) == writes_bos
    taken = hf_tok.decode([i for i, m in zip(rec.ids, rec.mask, strict=True) if m])
    text = taken.replace(" ", "")
    for part in ("blue,mostly.", "green", "user", "sky", "grass", "brief"):
        assert (part in text) == (part in ("blue,mostly.", "green")), (shape, taken)


# ~10 s: a transformers model, its import, a loss per template shape
@pytest.mark.slow
def test_chat_loss_equals_torch_masked_loss(tiny, tmp_path):
    """Chat records of every template shape (a two-turn conversation and two short
    ones, packed into one or two rows), through an imported
    tiny random Llama: hetjax's loss equals torch's cross-entropy of the same model over
    each conversation's apply_chat_template ids, labels -100 outside its assistant turns
    (the mean over every assistant token of the rows), 1e-5."""
    import dataclasses

    import torch
    from hf_models import build_hf_model

    from hetjax.hf import model_config_from_hf, open_checkpoint
    from hetjax.instruct import make_datasets
    from models import build_model

    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    short = [{"role": "user", "content": "grass?"}, {"role": "assistant", "content": "green"}]
    for shape in SHAPES:
        folder, hf_tok = _tokenizer_dir(tmp_path, shape)
        records = [{"messages": m} for m in (CONVERSATION, short, short)]
        path = _write(tmp_path / f"{shape}.jsonl", records + records)
        model_config = model_config_from_hf(tmp_path / "hf", tiny().model)
        config = tiny(
            model=dict(dataclasses.asdict(model_config), max_seq_len=128),
            data=dict(format="jsonl", path=path, tokenizer=str(folder), val_fraction=0.5),
            train=dict(batch_size=2, seq_len=128),
        )
        train_rows = make_datasets(config)[0]
        assert train_rows.num_windows < 3  # three records, two in a row at least
        model = build_model(config.model)
        params = open_checkpoint(config.model).params()
        ours = float(model.loss(params, *split_window("lm", train_rows.batch(0), 128)))
        total, count = 0.0, 0
        for messages in (CONVERSATION, short, short):
            ids = torch.tensor([_reference_ids(hf_tok, messages)])
            labels = torch.full_like(ids, -100)
            for i, m in enumerate(messages):  # each assistant turn's tokens, by transformers
                if m["role"] == "assistant":
                    a = len(_reference_ids(hf_tok, messages[:i], add_generation_prompt=True))
                    b = len(_reference_ids(hf_tok, messages[: i + 1]))
                    labels[0, a:b] = ids[0, a:b]
            with torch.no_grad():
                logits = hf(input_ids=ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum")
            total, count = total + float(loss), count + int((labels[0, 1:] >= 0).sum())
        assert_losses_close([ours], [total / count])


@pytest.mark.parametrize(
    "record, message",
    [
        (  # the template's raise_exception: a role it does not know
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "wizard", "content": "x"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "line 2: the chat template refused the record: Only user and assistant roles",
        ),
        ({"messages": ["hi", "hello"]}, "line 2: 'messages' must be a non-empty list of objects"),
        ({"messages": "hi"}, "line 2: 'messages' must be a non-empty list of objects"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "line 2: 'messages' has no non-empty assistant message",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "line 2: the chat template refused the record: Conversation roles must alternate",
        ),
    ],
    ids=["unknown_role", "strings", "not_a_list", "no_assistant", "not_alternating"],
)
def test_bad_chat_record_names_its_file_and_line(tmp_path, record, message):
    folder, _ = _tokenizer_dir(tmp_path, "mistral_system_folded")
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(ConfigError, match=f"^{path} {message}"):
        read_records(path, Tokens(str(folder)), 256)


@pytest.mark.parametrize(
    "content", [b"\xff\xfe{}\n", bytes(range(255, -1, -1))], ids=["latin1_bytes", "binary"]
)
def test_jsonl_not_utf8_names_its_file_and_line(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n' + content)
    with pytest.raises(ConfigError, match=f"^{path} line 2: not UTF-8 text"):
        read_records(str(path), Tokens(""), 256)


def test_jsonl_starting_with_a_utf8_bom_reads(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "completion": "b"}\n')
    assert read_records(str(path), Tokens(""), 256)[0].ids == (97, 98)


def test_named_chat_templates_take_the_default(tmp_path):
    """The list form of tokenizer_config.json's chat_template (named templates): the one
    named "default", as transformers takes it; a list without one is refused."""
    folder, hf_tok = _tokenizer_dir(tmp_path, "chatml_no_bos")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": CHATML},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids, _ = Tokens(str(folder)).chat(CONVERSATION, "test")
    assert ids == _reference_ids(hf_tok, CONVERSATION)
    cfg["chat_template"] = cfg["chat_template"][:1]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lists templates .'tool_use'. but none named 'default'"):
        Tokens(str(folder))


BAD_FILES = {
    "not_utf8": (b'{"prompt": "a", "completion": "b"}\n\xff\xfe\n', "line 2: not UTF-8 text"),
    "unknown_role": (
        b'{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "a"}, '
        b'{"role": "wizard", "content": "b"}, {"role": "user", "content": "a"}, '
        b'{"role": "assistant", "content": "b"}]}\n',
        "line 2: the chat template refused the record: Only user and assistant roles",
    ),
    "strings": (b'{"messages": ["hi", "hello"]}\n', "line 1: 'messages' must be a non-empty"),
}


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_jsonl_is_one_line_in_every_command(tmp_path, capsys, command, case):
    """train and eval of a bad jsonl file: exit status 1, one line on stderr naming the
    file and line, no traceback, no checkpoint written."""
    from hetjax import cli

    folder, _ = _tokenizer_dir(tmp_path, "mistral_system_folded")
    content, message = BAD_FILES[case]
    (tmp_path / "bad.jsonl").write_bytes(content)
    argv = [
        command, "--workdir", str(tmp_path / "run"), "--config", "gpt_tiny",
        "--config.data.format=jsonl", f"--config.data.path={tmp_path / 'bad.jsonl'}",
        f"--config.data.tokenizer={folder}", "--config.offload.mode=none",
    ]  # fmt: skip
    if command == "eval":
        argv += ["--hf", str(_hf_dir(tmp_path))]
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'bad.jsonl'} {message}" in err[0], err
    assert not list((tmp_path / "run").glob("**/step_*"))


def _hf_dir(tmp_path):
    """A tiny Llama's config.json saved by transformers (vocab 256), no weights: what
    is read before the data (the weights load after it)."""
    import transformers

    transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=256, max_position_embeddings=128,
    ).save_pretrained(tmp_path / "hf")  # fmt: skip
    return tmp_path / "hf"


def test_hf_directory_tokenizer_is_the_default_everywhere(tmp_path, capsys):
    """--hf DIR holding a tokenizer, no data.tokenizer: train's data (make_datasets,
    which eval uses too) and generate's prompts are the directory's tokenizer's ids, not
    bytes; train's first line and generate's name it and the weights' checkpoint;
    data.tokenizer, when set, wins."""
    from hetjax import cli, launch
    from hetjax.generate import _prepare
    from hetjax.instruct import make_datasets

    hf = _hf_dir(tmp_path)
    folder, hf_tok = _tokenizer_dir(tmp_path, "chatml_no_bos")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            (hf / name).write_bytes((folder / name).read_bytes())
    path = _write(tmp_path / "d.jsonl", [{"messages": CONVERSATION}] * 2)
    jsonl = [
        "--config.data.format=jsonl", f"--config.data.path={path}", "--config.train.seq_len=128",
        "--config.model.max_seq_len=128", "--config.offload.mode=none",
    ]  # fmt: skip
    config = launch.run_config(*launch.parse_args(["--hf", str(hf), *jsonl]))
    rows = make_datasets(config)[0].tokens
    assert rows[0, 0, :77].tolist() == _reference_ids(hf_tok, CONVERSATION)
    generate_line = _prepare(["--hf", str(hf), "--prompt", "sky"])[-1]
    tokens = _prepare(["--hf", str(hf), "--prompt", "sky"])[-2]
    assert tokens.spec == str(hf) and tokens.encode("sky", True) == hf_tok("sky").input_ids
    named = f"initial weights: hf:{hf} (model.init_from); tokenizer: {hf}"
    assert named in generate_line
    capsys.readouterr()
    argv = ["train", "--hf", str(hf), "--workdir", str(tmp_path / "run"), *jsonl]
    assert cli.main([*argv, "--config.data.path=missing.jsonl"]) == 1
    assert named in capsys.readouterr().out.splitlines()[0]
    own = launch.run_config(
        *launch.parse_args(["--hf", str(hf), *jsonl, "--config.data.tokenizer="])
    )
    assert Tokens(str(folder)).spec != own.data.tokenizer  # (empty: the directory's)
    bytes_config = own.replace(data=dict(tokenizer=str(folder)))
    assert make_datasets(bytes_config)[2].count(str(folder)) == 1


# ~3-5 min on 2 busy cores (pip installs hetjax's dependencies from its cache or index)
@pytest.mark.slow
def test_clean_install_trains_a_chat_record(tmp_path):
    """A venv made as the README makes one (``pip install -e .``, no test extra: no
    transformers, no torch) trains on chat records: the chat template's jinja2 is
    hetjax's own dependency. Needs pip to reach its index (or a cache holding the
    wheels); offline CI without one cannot run it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folder, _ = _tokenizer_dir(tmp_path, "chatml_no_bos")
    path = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *argv: subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    pip = run(str(venv / "bin/pip"), "install", "-q", "-e", str(root))
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert run(str(venv / "bin/python"), "-c", "import transformers").returncode != 0
    out = run(
        str(venv / "bin/hetjax"), "train", "--workdir", str(tmp_path / "run"),
        "--config.data.format=jsonl", f"--config.data.path={path}",
        f"--config.data.tokenizer={folder}", "--config.offload.mode=none",
        "--config.train.steps=1", "--config.train.batch_size=1", "--config.train.seq_len=128",
        "--config.model.max_seq_len=128", "--config.train.eval_batches=1",
        "--config.train.trace_every=0", "--config.train.in_memory_steps=0",
        "--config.data.val_fraction=0.5",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(record["loss"])
