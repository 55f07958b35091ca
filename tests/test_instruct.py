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


# ~60 s on 2 busy cores: two tiny runs
@pytest.mark.slow
def test_jsonl_trains_streamed_as_in_memory(tiny, tmp_path):
    """The same jsonl run in memory and under offload.mode=stream: per-step losses,
    validation loss within 1e-5; the loss falls."""
    path = _dataset(tmp_path)
    ref = train(_jsonl_config(tiny, path), tmp_path / "none", verbose=False)
    streamed = train(_jsonl_config(tiny, path, mode="stream"), tmp_path / "s", verbose=False)
    assert_losses_close(streamed.losses, ref.losses)
    assert_evaluation_equal(streamed, ref)
    assert ref.losses[-1] < ref.losses[0]


def test_jsonl_config_is_checked(tiny, tmp_path):
    with pytest.raises(ConfigError, match="'data.format' must be one of"):
        tiny(data=dict(format="csv"))
    with pytest.raises(ConfigError, match="data.format.*needs data.path"):
        tiny(data=dict(format="jsonl"))
    with pytest.raises(ConfigError, match="must be 1 with data.format 'jsonl'"):
        _jsonl_config(tiny, "d.jsonl", mode="stream", batch_chunks=2)
    with pytest.raises(ConfigError, match="encoder-decoder"):  # jsonl rows are decoder-only
        _jsonl_config(tiny, "d.jsonl").replace(model=dict(family="t5"))


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _chat_tokenizer(directory):
    """A byte-level BPE tokenizer.json trained here on a few lines, with <s> and </s>,
    and a tokenizer_config.json naming them and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["hello there, how are you?", "<|user|> <|assistant|> fine"], trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    settings = dict(chat_template=TEMPLATE, bos_token="<s>", eos_token="</s>")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return tok


def test_messages_rendered_as_transformers_renders_them(tmp_path):
    """A chat record: the prompt is the conversation before the last message rendered
    with the generation prompt, the completion the rest (ending in the template's </s>,
    no second one); the renders are transformers' apply_chat_template's."""
    import transformers

    tok = _chat_tokenizer(tmp_path / "tok")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "fine, you?"},
    ]
    path = _write(tmp_path / "chat.jsonl", [{"messages": messages}])
    (rec,) = read_records(path, Tokens(str(tmp_path / "tok")), 300)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"), chat_template=TEMPLATE,
        bos_token="<s>", eos_token="</s>",
    )  # fmt: skip
    render = reference.apply_chat_template
    prompt = render(messages[:-1], tokenize=False, add_generation_prompt=True)
    whole = render(messages, tokenize=False)
    assert prompt == "<s><|system|>be brief<|user|>hello there<|assistant|>"
    completion = whole[len(prompt) :]
    assert completion == "fine, you?</s>"
    ids = tok.encode(prompt).ids
    assert rec.prompt == len(ids)
    assert list(rec.ids) == ids + tok.encode(completion).ids
    assert rec.ids[-1] == tok.token_to_id("</s>")
