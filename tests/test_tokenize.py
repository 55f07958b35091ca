"""python -m hetjax.tokenize with a small BPE tokenizer trained here (no download)."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hetjax import tokenize
from hetjax.data import load_tokens
from hetjax.train import train

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\nThe dog sleeps.\n",
    "Streaming layers over device memory, host RAM and NVMe.\n",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 300) trained on a few lines, saved as
    tokenizer.json the way HF checkpoints ship one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def text_files(tmp_path):
    paths = []
    for i, text in enumerate(TEXT):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(text * 30)
    return paths


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_tokenize_cli_writes_what_data_path_reads(tokenizer_json, text_files, tmp_path, suffix):
    out = tmp_path / f"tokens{suffix}"
    rc = tokenize.main(
        ["--tokenizer", str(tokenizer_json.parent), "--text", *map(str, text_files),
         "--out", str(out), "--separator", "<|endoftext|>"]
    )  # fmt: skip
    assert rc == 0
    tok = Tokenizer.from_file(str(tokenizer_json))
    eot = tok.token_to_id("<|endoftext|>")
    expected = []
    for path in text_files:
        expected += tok.encode(path.read_text(), add_special_tokens=False).ids + [eot]
    tokens = np.asarray(load_tokens(str(out)))
    np.testing.assert_array_equal(tokens, expected)
    assert tokens.dtype == np.uint16
    assert tok.decode(tokens[: len(tokens) // 3].tolist()).startswith(TEXT[0])


@pytest.mark.slow  # ~7 s; the token file format itself is checked above
def test_train_on_tokenized_text(tokenizer_json, text_files, tmp_path, tiny):
    out = tmp_path / "tokens.bin"
    tokenize.tokenize_files(tokenize.load_tokenizer(tokenizer_json), text_files, out)
    config = tiny(
        model=dict(family="llama", vocab_size=300, tie_embeddings=False),
        data=dict(path=str(out)),
        train=dict(steps=2, eval_batches=1),
    )
    result = train(config, tmp_path / "run", verbose=False)
    assert np.isfinite(result.val_loss) and result.losses[-1] < result.losses[0]


def test_errors(tokenizer_json, text_files, tmp_path):
    tok = tokenize.load_tokenizer(tokenizer_json)
    with pytest.raises(tokenize.TokenizeError, match="no tokenizer file"):
        tokenize.load_tokenizer(tmp_path)
    with pytest.raises(tokenize.TokenizeError, match="not a token"):
        tokenize.tokenize_files(tok, text_files, tmp_path / "t.bin", separator="<eos>")
    with pytest.raises(tokenize.TokenizeError, match="use a .bin"):
        tokenize.tokenize_files(tok, text_files, tmp_path / "t.txt")
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    with pytest.raises(tokenize.TokenizeError, match="70000 tokens.*write a .npy"):
        tokenize.tokenize_files(big, text_files, tmp_path / "t.bin")


def test_out_is_replaced_only_when_asked(tokenizer_json, text_files, tmp_path, capsys):
    """An existing --out is refused (unchanged), and replaced with --overwrite."""
    out = tmp_path / "tokens.bin"
    out.write_bytes(b"an earlier token file")
    args = ["--tokenizer", str(tokenizer_json), "--text", str(text_files[0]), "--out", str(out)]
    assert tokenize.main(args) == 1
    assert out.read_bytes() == b"an earlier token file"
    assert f"--out {out} exists: refusing to replace it" in capsys.readouterr().err
    assert tokenize.main([*args, "--overwrite"]) == 0
    assert len(load_tokens(str(out))) > 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial
