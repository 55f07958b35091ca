"""Instruction data (``data.format=jsonl``): records of prompt and completion, tokenised,
packed into rows of ``train.seq_len`` with their positions and a loss on the completion.

Each line of ``data.path`` is one JSON record, one of:

* ``{"prompt": ..., "completion": ...}``: the loss is taken on the completion's tokens;
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the tokenizer's
  chat template (``chat_template`` in the ``tokenizer_config.json`` next to
  ``data.tokenizer``); the last message is the completion (the assistant's), the
  conversation before it, rendered with the generation prompt, the prompt;
* ``{"text": ...}``: plain text, the loss on every token.

Tokens come from ``data.tokenizer`` (a ``tokenizer.json`` or the checkpoint directory
holding it: the ``tokenizers`` package, as ``hetjax tokenize``) or, when empty, bytes
(ids 0..255). The prompt is encoded with the tokenizer's special tokens (a BOS where the
tokenizer adds one), the completion without, followed by the tokenizer's end-of-sequence
token (``eos_token`` of ``tokenizer_config.json``) when it names one (a chat record ends
as its template ends the assistant's turn).

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
from hetjax.config_values import ConfigError

IGNORED = -1  # models/staged.py's IGNORED: a target that takes no loss
BYTE_VOCAB = 256


class Tokens:
    """Text -> token ids: a ``tokenizers.Tokenizer`` with its chat template and EOS, or
    bytes. ``vocab_size``: the ids it can produce."""

    def __init__(self, spec: str):
        self.spec = spec
        self.chat_template: str | None = None
        self.eos: int | None = None
        self.bos_token = self.eos_token = ""
        if not spec:
            self._tok, self.vocab_size = None, BYTE_VOCAB
            return
        from tokenizers import Tokenizer  # start-up cost: only jsonl runs need it

        path = Path(spec)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                f"config key 'data.tokenizer': no tokenizer file {str(file)!r}; give a "
                "tokenizer.json or the checkpoint directory holding one"
            )
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        settings = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
        if settings.is_file():
            cfg = json.loads(settings.read_text())
            self.chat_template = cfg.get("chat_template") or None
            name = lambda t: t.get("content", "") if isinstance(t, dict) else (t or "")
            self.eos_token, self.bos_token = name(cfg.get("eos_token")), name(cfg.get("bos_token"))
            if self.eos_token:
                self.eos = self._tok.token_to_id(self.eos_token)

    def encode(self, text: str, special: bool) -> list[int]:
        """``text`` -> ids; ``special``: with the tokenizer's added special tokens (BOS)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        if self._tok is None:
            return bytes(int(i) for i in ids if i < BYTE_VOCAB).decode("utf-8", "replace")
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def render(self, messages: list, generation_prompt: bool) -> str:
        """Messages rendered by the chat template (Jinja, as transformers renders it)."""
        import jinja2  # only chat records need it

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


@dataclass(frozen=True)
class Record:
    """One record's tokens and how many of them are the prompt (no loss)."""

    ids: tuple[int, ...]
    prompt: int
    line: int  # 1-based line of data.path
    prompt_tokens: int = 0  # the prompt's own (``prompt`` is at least 1: a first token)


def read_records(path: str, tokens: Tokens, vocab_size: int) -> list[Record]:
    """The records of a jsonl file, tokenised. Raises ``ConfigError`` naming the line of
    a record that is not JSON, has none of the fields, an empty completion, messages
    without a chat template, or a token id the model's vocabulary lacks."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key 'data.path': no such file {path!r}")
    records = []
    with p.open(encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path} line {n}"
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not a JSON record ({e.msg})") from None
            prompt, completion = _fields(rec, tokens, where)
            ids = tokens.encode(prompt, special=True) if prompt else []
            n_prompt = len(ids)
            ids += tokens.encode(completion, special=not prompt)
            # a chat template writes its own end of turn
            if "prompt" in rec and tokens.eos is not None:
                ids.append(tokens.eos)
            if len(ids) - n_prompt < 1:
                raise ConfigError(f"{where}: the completion encodes to no tokens")
            top = max(ids)
            if top >= vocab_size:
                raise ConfigError(
                    f"{where}: token id {top} from data.tokenizer "
                    f"({tokens.spec or 'bytes'}, {tokens.vocab_size} tokens) is outside the "
                    f"model's vocabulary (model.vocab_size {vocab_size}): the tokenizer is "
                    "not the checkpoint's"
                )
            # a record's first token is never a target: with no prompt, the first
            # completion token is context only
            records.append(Record(tuple(ids), max(n_prompt, 1), n, n_prompt))
    if not records:
        raise ConfigError(f"data.path {path!r} holds no records")
    return records


def _fields(rec, tokens: Tokens, where: str) -> tuple[str | None, str]:
    """(prompt or None for plain text, completion) of a parsed record."""
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: a record must be a JSON object")
    if "prompt" in rec and "completion" in rec:
        prompt, completion = rec["prompt"], rec["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings")
        if not completion:
            raise ConfigError(f"{where}: the completion is empty")
        return prompt, completion
    if "messages" in rec:
        messages = rec["messages"]
        if not tokens.chat_template:
            raise ConfigError(
                f"{where}: a 'messages' record needs the tokenizer's chat template "
                f"(chat_template in tokenizer_config.json next to data.tokenizer "
                f"{tokens.spec or '(bytes)'!r}); there is none"
            )
        if not isinstance(messages, list) or not messages or not messages[-1].get("content"):
            raise ConfigError(f"{where}: 'messages' must end with a non-empty message")
        prompt = tokens.render(messages[:-1], generation_prompt=True)
        whole = tokens.render(messages, generation_prompt=False)
        if not whole.startswith(prompt):
            raise ConfigError(f"{where}: the chat template does not extend the prompt")
        return prompt, whole[len(prompt) :]
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
    tokens = Tokens(d.tokenizer)
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
        f"tokenizer {d.tokenizer or 'bytes'}; {train.cut + val.cut} record(s) {where}; the "
        f"loss is over completion tokens only ({taken:,} of {train.rows[:, 0].size:,} train "
        "positions); tokens/s counts every position"
    )
    return train_rows, val_rows, desc
