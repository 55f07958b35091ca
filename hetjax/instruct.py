"""Instruction data (``data.format=jsonl``): records of prompt and completion, tokenised,
packed into rows of ``train.seq_len`` with their positions and a loss on the completion.

Each line of ``data.path`` is one JSON record, one of:

* ``{"prompt": ..., "completion": ...}``: the loss is taken on the completion's tokens;
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the tokenizer's
  chat template and encoded as transformers' ``apply_chat_template(tokenize=True)``
  encodes it (no special tokens added to the rendered text); the loss is taken on every
  assistant turn (``hetjax/chat.py``); T5's completion is the last assistant turn;
* ``{"text": ...}``: plain text, the loss on every token.

Tokens come from the run's tokenizer (:func:`hetjax.chat.tokenizer_spec`:
``data.tokenizer``, else the ``tokenizer.json`` of the HF directory the weights come
from, else bytes, ids 0..255). A prompt is encoded with the tokenizer's special tokens
(a BOS where the tokenizer adds one), the completion without, followed by the
tokenizer's end-of-sequence token (``eos_token`` of ``tokenizer_config.json``) when it
names one (a chat record ends as its template ends the assistant's turn). A line that is
not UTF-8 or JSON, or a record that is malformed, is refused naming the file and line.

Packing: records are placed in rows in file order, a record in the current row while it
fits, else in a new row (first fit in order); the rest of a row is padding, a record of
its own that takes no loss. A row carries, per position, the token id, its position in
its record (0 where a record starts: ``models/staged.py``'s packed rows, whose attention
and positions restart per record) and its target: the next token of the same record
where that token is part of the completion, else ``IGNORED`` (-1). A record longer than
a row is cut to the row's length, and counted: the count is in the data's description
the run logs. The held-out split is the last ``data.val_fraction`` of the records (at
least one).

An encoder-decoder model (T5, ``data.objective=prefix_lm``) packs records on both sides
(:func:`pack_seq2seq`): the prompts' ids and positions are the encoder's input, the
completions the decoder's targets (the loss on every one of them) with their own
positions, record k the k-th on each side; each record attends only to itself in the
encoder, the decoder and the cross-attention (``models.t5.row_records``). A record
without a prompt is refused, a prompt or completion longer than a row cut to it and
counted. Its rows are ``(B, 4 T)``: ids | positions | decoder positions | targets.

Batch rows are int32 ``(B, 3 T)``: ids | positions | targets
(:func:`hetjax.data.split_window` makes tokens (B, 2, T) and targets (B, T) of them).
Which row a batch row is follows ``data.shuffle`` as token windows do
(:class:`hetjax.data.TokenWindows`). The loss a step reports is the mean over its
micro-batches of each one's mean over its completion tokens (data-parallel: of each
device's rows, then the mean over devices; tests/test_instruct.py checks both); tokens/s
counts every position of a row, padding and prompt included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetjax import data
from hetjax.chat import BYTE_VOCAB, Tokens, tokenizer_spec  # noqa: F401 (instruct.Tokens)
from hetjax.config_values import ConfigError

IGNORED = -1  # models/staged.py's IGNORED: a target that takes no loss


@dataclass(frozen=True)
class Record:
    """One record's tokens and how many of them are the prompt (no loss)."""

    ids: tuple[int, ...]
    prompt: int
    line: int  # 1-based line of data.path
    prompt_tokens: int = 0  # the prompt's own (``prompt`` is at least 1: a first token)
    # per id, whether it takes the loss (a chat record's assistant turns); None: every id
    # from ``prompt`` on
    mask: tuple[bool, ...] | None = None


def read_records(path: str, tokens: Tokens, vocab_size: int) -> list[Record]:
    """The records of a jsonl file, tokenised. Raises ``ConfigError`` naming the file
    and line of a record that is not UTF-8 or JSON, has none of the fields, an empty
    completion, messages that are malformed or that the chat template refuses (or
    without a chat template), or a token id the model's vocabulary lacks."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key 'data.path': no such file {path!r}")
    records = []
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path} line {n}"
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # (a BOM first)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{where}: not UTF-8 text (byte {e.start} of the line is "
                    f"{raw[e.start : e.start + 1]!r}); data.format=jsonl reads JSON lines"
                ) from None
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not a JSON record ({e.msg})") from None
            record = _record(rec, tokens, where, n)
            top = max(record.ids)
            if top >= vocab_size:
                raise ConfigError(
                    f"{where}: token id {top} from the tokenizer "
                    f"({tokens.spec or 'bytes'}, {tokens.vocab_size} tokens) is outside the "
                    f"model's vocabulary (model.vocab_size {vocab_size}): the tokenizer is "
                    "not the checkpoint's"
                )
            records.append(record)
    if not records:
        raise ConfigError(f"data.path {path!r} holds no records")
    return records


def _record(rec, tokens: Tokens, where: str, line: int) -> Record:
    """A parsed record's tokens: a chat record's from its template (the loss on its
    assistant turns), else the prompt encoded with the tokenizer's special tokens and
    the completion without, then EOS."""
    if isinstance(rec, dict) and "messages" in rec and "prompt" not in rec:
        if not tokens.chat_template:
            raise ConfigError(
                f"{where}: a 'messages' record needs the tokenizer's chat template "
                f"(chat_template.jinja, or chat_template in tokenizer_config.json, beside "
                f"the tokenizer {tokens.spec or '(bytes)'!r}); there is none"
            )
        ids, mask = tokens.chat(rec["messages"], where)
        if sum(mask[1:]) < 1:
            raise ConfigError(f"{where}: the assistant turns encode to no tokens")
        first = mask.index(True)
        last = len(mask) - 1 - mask[::-1].index(True)
        start = max(j for j in range(last + 1) if mask[j] and not (j and mask[j - 1]))
        return Record(tuple(ids), max(first, 1), line, start, tuple(mask))
    prompt, completion = _fields(rec, where)
    ids = tokens.encode(prompt, special=True) if prompt else []
    n_prompt = len(ids)
    ids += tokens.encode(completion, special=not prompt)
    if prompt is not None and tokens.eos is not None:
        ids.append(tokens.eos)
    if len(ids) - n_prompt < 1:
        raise ConfigError(f"{where}: the completion encodes to no tokens")
    # a record's first token is never a target: with no prompt, the first completion
    # token is context only
    return Record(tuple(ids), max(n_prompt, 1), line, n_prompt)


def _fields(rec, where: str) -> tuple[str | None, str]:
    """(prompt or None for plain text, completion) of a parsed non-chat record."""
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: a record must be a JSON object")
    if "prompt" in rec and "completion" in rec:
        prompt, completion = rec["prompt"], rec["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings")
        if not completion:
            raise ConfigError(f"{where}: the completion is empty")
        return prompt, completion
    if "text" in rec:
        if not isinstance(rec["text"], str) or not rec["text"]:
            raise ConfigError(f"{where}: 'text' must be a non-empty string")
        return None, rec["text"]
    raise ConfigError(
        f"{where}: a record needs 'prompt' and 'completion', 'messages', or 'text'; "
        f"it has {sorted(rec)}"
    )


@dataclass(frozen=True)
class Packed:
    """Rows (N, 3, T) int32: ids, positions, targets (T5's (N, 4, T): :func:`pack_seq2seq`);
    and how many records were cut."""

    rows: np.ndarray
    records: int
    cut: int


def pack(records: list[Record], seq_len: int) -> Packed:
    """Records into rows of ``seq_len`` (first fit in order; see the module docstring)."""
    rows, current, cut = [], [], 0
    used = 0
    for rec in records:
        n = len(rec.ids)
        if n > seq_len:
            cut += 1
            n = seq_len
        if used + n > seq_len:
            rows.append(_row(current, seq_len))
            current, used = [], 0
        current.append((rec, n))
        used += n
    rows.append(_row(current, seq_len))
    return Packed(np.stack(rows), len(records), cut)


def _row(placed: list[tuple[Record, int]], seq_len: int) -> np.ndarray:
    ids = np.zeros(seq_len, np.int32)
    pos = np.zeros(seq_len, np.int32)
    tgt = np.full(seq_len, IGNORED, np.int32)
    at = 0
    for rec, n in placed:
        r = np.asarray(rec.ids[:n], np.int32)
        ids[at : at + n] = r
        pos[at : at + n] = np.arange(n)
        # target of position t is token t + 1 where that token is a completion token
        for t in range(max(rec.prompt - 1, 0), n - 1):
            if rec.mask is None or rec.mask[t + 1]:
                tgt[at + t] = r[t + 1]
        at += n
    pos[at:] = np.arange(seq_len - at)  # padding: a record of its own, no loss
    return np.stack([ids, pos, tgt])


def pack_seq2seq(records: list[Record], seq_len: int) -> Packed:
    """An encoder-decoder model's rows (T5), (N, 4, T): records packed first fit in
    order, while both the prompt and the completion fit their side of the row: the
    prompts' ids and positions (the encoder's input), the completions' positions, and
    the completions' ids as the decoder's targets (record k is the k-th on both sides;
    the rest of each side padding, its positions from 0 again, its targets
    ``IGNORED``). A prompt or completion longer than the row is cut to it, and
    counted. Raises ``ConfigError`` for a record without a prompt (a ``text`` record:
    the encoder would read nothing)."""
    rows, current, cut = [], [], 0
    used = [0, 0]
    for rec in records:
        n = rec.prompt_tokens
        if n == 0:
            raise ConfigError(
                f"line {rec.line}: an encoder-decoder model (T5) needs a prompt for its "
                "encoder; this record has none (give 'prompt' and 'completion', or "
                "'messages')"
            )
        prompt, completion = rec.ids[:n][:seq_len], rec.ids[n:][:seq_len]
        cut += len(prompt) + len(completion) < len(rec.ids)
        if used[0] + len(prompt) > seq_len or used[1] + len(completion) > seq_len:
            rows.append(_seq2seq_row(current, seq_len))
            current, used = [], [0, 0]
        current.append((prompt, completion))
        used = [used[0] + len(prompt), used[1] + len(completion)]
    rows.append(_seq2seq_row(current, seq_len))
    return Packed(np.stack(rows), len(records), cut)


def _seq2seq_row(placed: list[tuple], seq_len: int) -> np.ndarray:
    """Records' (prompt, completion) ids -> a row (4, T): encoder ids and positions,
    decoder positions and targets."""
    row = np.zeros((4, seq_len), np.int32)
    row[3] = IGNORED
    at = [0, 0]
    for prompt, completion in placed:
        for side, ids in enumerate((prompt, completion)):
            n = len(ids)
            pos = (1, 2)[side]
            row[pos, at[side] : at[side] + n] = np.arange(n)
            row[(0, 3)[side], at[side] : at[side] + n] = ids
            at[side] += n
    for side in (0, 1):  # padding: a record of its own on each side, no loss
        row[(1, 2)[side], at[side] :] = np.arange(seq_len - at[side])
    return row


@dataclass(kw_only=True)
class PackedRows(data.TokenWindows):
    """Batches of packed rows ``(B / processes, K T)`` (ids | positions | targets; T5's
    K = 4: ids | positions | the decoder's positions | targets), in
    :class:`TokenWindows`' order over rows instead of windows. ``tokens`` holds the rows
    (N, K, T)."""

    def __post_init__(self):
        if self.batch_size % (self.grad_accum * self.process_count):
            raise ConfigError(
                f"config key 'train.batch_size' ({self.batch_size}) must split evenly into "
                f"{self.grad_accum} micro-batch(es) over {self.process_count} processes"
            )
        self.num_windows = len(self.tokens)
        self._perm_pass, self._perm = -1, None

    def batch(self, i: int) -> np.ndarray:
        rows = [self.tokens[self.window_index(i, r)] for r in self.own_rows()]
        return np.stack(rows).reshape(len(rows), -1)


def make_datasets(config) -> tuple[data.TokenWindows, data.TokenWindows, str]:
    """(train, validation, description) for the configured data: records packed into
    rows (``data.format=jsonl``), else the token data (``hetjax.data.make_datasets``)."""
    if config.data.format == "jsonl":
        return make_packed_datasets(config)
    return data.make_datasets(config)


def make_packed_datasets(config) -> tuple[PackedRows, PackedRows, str]:
    """(train, validation, description) for ``data.format=jsonl``."""
    import jax

    d, t, m = config.data, config.train, config.model
    tokens = Tokens(tokenizer_spec(config))
    records = read_records(d.path, tokens, m.vocab_size)
    rows_of = pack_seq2seq if m.encoder_decoder else pack
    n_val = max(int(len(records) * d.val_fraction), 1)
    if len(records) - n_val < 1:
        raise ConfigError(
            f"data.path {d.path!r} holds {len(records)} record(s): too few for a training "
            f"split and a held-out one of {n_val}"
        )
    train, val = rows_of(records[:-n_val], t.seq_len), rows_of(records[-n_val:], t.seq_len)
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    common = dict(seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed, **shard)
    train_rows = PackedRows(tokens=train.rows, shuffle=d.shuffle, grad_accum=t.grad_accum, **common)
    val_rows = PackedRows(tokens=val.rows, shuffle=False, **common)
    taken = int((train.rows[:, -1] >= 0).sum())
    where = "longer than a row cut to it"
    if m.encoder_decoder:
        where = (
            "whose prompt or completion is longer than a row cut to it; packed on both "
            "sides (T5: the prompts the encoder's, the completions the decoder's targets, "
            "each record attending only to itself)"
        )
    desc = (
        f"{d.path}: {len(records):,} records ({train.records:,} train in "
        f"{len(train.rows):,} rows of {t.seq_len}, {val.records:,} val in {len(val.rows):,}), "
        f"tokenizer {tokens.spec or 'bytes'}; {train.cut + val.cut} record(s) {where}; the "
        f"loss is over completion tokens only ({taken:,} of {train.rows[:, 0].size:,} train "
        "positions); tokens/s counts every position"
    )
    return train_rows, val_rows, desc
