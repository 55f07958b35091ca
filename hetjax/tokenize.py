"""``python -m hetjax.tokenize``: text files -> a token file ``data.path`` reads.

    python -m hetjax.tokenize --tokenizer ckpt/tokenizer.json --text a.txt b.txt \\
        --out tokens.bin --separator "<|endoftext|>"

Each text file is one document, encoded with the checkpoint's ``tokenizer.json`` (the
``tokenizers`` package, the same tokenizer ``transformers`` would use) in a single call,
without the tokenizer's added special tokens (no BOS per file); ``--separator`` names a
token (e.g. an end-of-text token) written after every document. Documents are
concatenated in the order given. ``--out`` ending in ``.bin`` writes flat little-endian
uint16 (nanoGPT's format; vocabularies up to 65536), ``.npy`` a 1-D uint16 or uint32
array (for larger vocabularies such as Llama 3's 128256). See ``hetjax/data.py``. An
existing ``--out`` is refused unless ``--overwrite``; the file appears once whole.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from hetjax.errors import UserError, check_output_file, entry_point

UINT16_VOCAB = 2**16


class TokenizeError(UserError, ValueError):
    """The inputs cannot be tokenised as asked; the message says what to change."""


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizeError(
            f"no tokenizer file {str(path)!r}: give a tokenizer.json (HF checkpoints ship "
            "one next to config.json) or the directory holding it"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise TokenizeError(f"tokenizer file {str(path)!r} cannot be read: {e}") from None


def tokenize_files(
    tokenizer, texts: list[str | Path], out: str | Path, separator: str | None = None
) -> int:
    """Encodes each text file (one document each) and writes the token ids to ``out``
    (``.bin``: uint16; ``.npy``: uint16 or uint32). Returns the number of tokens."""
    out = Path(out)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if out.suffix not in (".bin", ".npy"):
        raise TokenizeError(f"--out {str(out)!r}: use a .bin (uint16) or .npy file")
    if out.suffix == ".bin" and vocab > UINT16_VOCAB:
        raise TokenizeError(
            f"the tokenizer has {vocab} tokens, more than a uint16 .bin file holds "
            f"({UINT16_VOCAB}); write a .npy file instead"
        )
    dtype = np.uint16 if vocab <= UINT16_VOCAB else np.uint32
    sep: list[int] = []
    if separator is not None:
        sep_id = tokenizer.token_to_id(separator)
        if sep_id is None:
            raise TokenizeError(f"--separator {separator!r} is not a token of this tokenizer")
        sep = [sep_id]
    documents = []
    for text in texts:
        path = Path(text)
        if not path.is_file():
            raise TokenizeError(f"no text file {str(path)!r}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TokenizeError(
                f"--text {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); give "
                "text files"
            ) from None
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        documents.append(np.asarray(ids + sep, dtype))
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")  # renamed once whole: no half file
    with open(partial, "wb") as f:
        if out.suffix == ".bin":
            tokens.astype("<u2").tofile(f)
        else:
            np.save(f, tokens)
    os.replace(partial, out)
    return len(tokens)


@entry_point("hetjax.tokenize")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.tokenize",
        description="Tokenise text files with a tokenizer.json into a token file for data.path.",
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory")
    parser.add_argument("--text", required=True, nargs="+", help="UTF-8 text files (documents)")
    parser.add_argument("--out", required=True, help="output .bin (uint16) or .npy")
    parser.add_argument("--separator", default=None, help="token written after each document")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (else refused)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_output_file(args.out, "--out", args.overwrite)  # before any work
    tokenizer = load_tokenizer(args.tokenizer)
    n = tokenize_files(tokenizer, args.text, args.out, args.separator)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    print(f"hetjax.tokenize: {n:,} tokens from {len(args.text)} file(s) -> {args.out}")
    print(f"  train with --config.data.path={args.out} --config.model.vocab_size={vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
