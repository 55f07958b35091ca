"""Token data: the embedded corpus and user token files, batched deterministically.

Order (``data.shuffle=false``): the training split is cut into windows of W tokens
starting every ``T`` tokens; batch ``i`` row ``r`` is window
``k = (i * B + r) mod num_windows``, i.e. tokens ``[k*T, k*T + W)``. What a window
trains is ``data.objective`` (:func:`split_window`):

* ``lm`` (decoder-only models): W = T + 1; inputs are the first ``T`` tokens, targets
  the same shifted by one.
* ``prefix_lm`` (encoder-decoder models): W = 2 T; the encoder reads the first ``T``
  tokens, the decoder predicts the next ``T`` (its input is them shifted right behind
  ``model.decoder_start_token``, teacher forcing). Windows overlap by half: every
  ``T`` tokens are the targets of one window and the prefix of the next.
* ``span_corruption`` (encoder-decoder models; T5's pre-training objective): a window of
  W raw tokens loses ``data.noise_density`` of them, in spans of ``data.mean_noise_span``
  on average; the encoder reads the rest with a sentinel in place of each span, exactly
  ``T`` tokens, and the decoder predicts each span behind its sentinel (:class:`Spans`
  gives W and the decoder's length, fixed for a given T: no padding, no loss mask).
  Sentinel ``i`` of a window is token ``model.vocab_size - 1 - i``, as T5's
  ``<extra_id_i>``; the data's own ids must lie below them. Where the spans fall is drawn
  from ``train.seed`` and the window's index, so a window is corrupted the same way in
  every pass, at any process count. A batch row is the encoder's T tokens followed by
  the decoder's targets. (T5 also ends both with an end-of-sequence token; the byte
  vocabulary has none, so neither does this.)

With ``data.shuffle=true`` the windows of each pass over the data are visited in a
permutation drawn from ``train.seed`` and the pass number, so a run is still
reproducible.

The validation split is the last ``data.val_fraction`` of the token stream.

With several processes (``distributed.*``) the global batch is the same and each
process reads only its rows: of every micro-batch (``train.grad_accum``) the k-th of
``num_processes`` equal runs of rows. So the global batch is the sum of the
per-process ones, and a run reads the same data at any process count.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetjax.config import Config, ConfigError

SPAN_STREAM = 0x5C  # span corruption's random stream, apart from the data order's


@dataclass(frozen=True)
class Spans:
    """Span corruption's lengths for an encoder input of ``T`` tokens: each window of
    ``window`` raw tokens loses ``noise`` of them in ``spans`` spans; the encoder reads
    the ``window - noise`` kept tokens and a sentinel per span (``T``), the decoder
    predicts a sentinel and the span's tokens per span (``targets``)."""

    window: int
    noise: int
    spans: int

    @property
    def targets(self) -> int:
        return self.noise + self.spans

    @staticmethod
    def of(window: int, density: float, mean_span: float) -> Spans:
        """T5's counts for a window (``random_spans_noise_mask``): round(W density)
        noise tokens, at least one and one kept; round(noise / mean_span) spans, at
        least one and no more than the kept tokens (each span follows a kept run)."""
        noise = min(max(round(window * density), 1), window - 1)
        spans = min(max(round(noise / mean_span), 1), window - noise)
        return Spans(window, noise, spans)

    @staticmethod
    def for_inputs(seq_len: int, density: float, mean_span: float) -> Spans:
        """The window whose encoder input is exactly ``seq_len`` tokens. One more raw
        token adds 0 or 1 to the input's length (a noise token adds a span at most),
        so the search meets every length."""
        for window in range(seq_len, 4 * seq_len + 8):
            spans = Spans.of(window, density, mean_span)
            if window - spans.noise + spans.spans == seq_len:
                return spans
        raise ConfigError(
            f"span corruption finds no window whose encoder input is train.seq_len="
            f"{seq_len} tokens at data.noise_density={density}; use a longer seq_len"
        )

    def corrupt(self, raw: np.ndarray, vocab_size: int, rng: np.random.Generator):
        """One window (``window``,) -> the encoder's tokens followed by the decoder's
        targets (``T + targets``,): kept runs and noise spans alternate, a kept run
        first; sentinel ``i`` (token ``vocab_size - 1 - i``) stands for span ``i`` in
        the input and precedes its tokens in the targets."""
        noise = _segments(self.noise, self.spans, rng)
        kept = _segments(self.window - self.noise, self.spans, rng)
        inputs, targets, at = [], [], 0
        for i, (k, n) in enumerate(zip(kept, noise, strict=True)):
            sentinel = np.array([vocab_size - 1 - i], raw.dtype)
            inputs += [raw[at : at + k], sentinel]
            targets += [sentinel, raw[at + k : at + k + n]]
            at += k + n
        return np.concatenate(inputs + targets)


def _segments(items: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``items`` cut at random into ``count`` runs of at least one (T5's
    ``_random_segmentation``): their lengths."""
    cuts = np.sort(rng.choice(np.arange(1, items), count - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [items]]))


def spans_of(data, seq_len: int) -> Spans | None:
    """``data.objective=span_corruption``'s lengths for ``train.seq_len``, or None."""
    if data.objective != "span_corruption":
        return None
    return Spans.for_inputs(seq_len, data.noise_density, data.mean_noise_span)


def window_length(data, seq_len: int) -> int:
    """Tokens of a batch row for ``data`` (:class:`~hetjax.config.DataConfig`) and
    ``train.seq_len``: ``T + 1`` (lm), ``2 T`` (prefix_lm), or the encoder's ``T`` and
    the decoder's targets (span_corruption); ``3 T`` for packed rows (jsonl)."""
    if getattr(data, "format", "tokens") == "jsonl":  # (T5's: with the decoder's positions)
        return (4 if data.objective == "prefix_lm" else 3) * seq_len
    if data.objective == "prefix_lm":
        return 2 * seq_len
    if data.objective == "span_corruption":
        return seq_len + spans_of(data, seq_len).targets
    return seq_len + 1


def decoder_length(data, seq_len: int) -> int:
    """Tokens a batch row's targets have (the decoder's rows, the head's): ``seq_len``,
    or span corruption's targets."""
    spans = spans_of(data, seq_len)
    return spans.targets if spans else seq_len


def split_window(objective: str, windows, seq_len: int):
    """Batch rows (..., W) -> (tokens (..., T), targets): for ``lm`` the inputs and the
    next tokens; for ``prefix_lm`` and ``span_corruption`` the encoder's ``seq_len``
    tokens and the decoder's targets (the decoder's input is made from the targets by
    the model, as HF's T5 does from its labels). A packed row (``data.format=jsonl``,
    W = 3 T: ids | positions | targets, ``hetjax/instruct.py``) -> tokens (..., 2, T)
    and targets (..., T). Works on numpy and JAX arrays alike."""
    packed = {"lm": 3, "prefix_lm": 4}.get(objective, 0)  # rows of an instruction row
    if packed and windows.shape[-1] == packed * seq_len:
        k = packed - 1
        tokens = windows[..., : k * seq_len].reshape(*windows.shape[:-1], k, seq_len)
        return tokens, windows[..., k * seq_len :]
    if objective in ("prefix_lm", "span_corruption"):
        return windows[..., :seq_len], windows[..., seq_len:]
    return windows[..., :-1], windows[..., 1:]


def embedded_corpus(max_bytes: int) -> np.ndarray:
    """The running Python's standard-library sources as byte tokens (vocab 256).

    Files are read in sorted path order (``site-packages`` excluded) until ``max_bytes``,
    so the corpus is the same on every run of the same Python. Returns uint16 (N,).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(
            f"the embedded corpus needs the Python standard library sources under {root}, "
            f"found only {total} bytes; point data.path at a token file instead"
        )
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).astype(np.uint16)


def load_tokens(path: str) -> np.ndarray:
    """Memory-maps a token file: flat little-endian uint16 ``.bin`` or 1-D ``.npy`` of
    integers (:func:`check_token_ids` checks the ids against the model)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"data.path {path!r} is a directory: give a .bin or .npy token file")
    if not p.is_file():
        raise ConfigError(f"config key 'data.path': no such file {path!r}")
    if p.suffix not in (".npy", ".bin"):
        raise ConfigError(f"data.path {path!r}: unknown token file type; use .bin (uint16) or .npy")
    if p.stat().st_size == 0:
        raise ConfigError(f"data.path {path!r} is empty: it holds no tokens")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ConfigError(
                f"data.path {path!r}: a .bin token file holds uint16, so its size must be even"
            )
        return np.memmap(p, dtype="<u2", mode="r")
    try:
        tokens = np.load(p, mmap_mode="r")
    except ValueError as e:  # not an .npy array (a pickle, a damaged header)
        raise ConfigError(f"data.path {path!r} is not a .npy array file ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(
            f"data.path {path!r}: expected a 1-D integer array, got {tokens.dtype} "
            f"with shape {tokens.shape}"
        )
    if not len(tokens):
        raise ConfigError(f"data.path {path!r} is empty: it holds no tokens")
    return tokens


FULL_SCAN = 16 * 1024 * 1024  # token files up to this many ids are checked whole at start


def check_token_file(config: Config) -> None:
    """Checks ``data.path``'s token file (``data.format=tokens``): readable, not empty,
    its ids those of the model. Cheap (no JAX): a command runs it before anything heavy."""
    d = config.data
    if d.format == "tokens" and d.path:
        spans = spans_of(d, config.train.seq_len)
        scan_token_ids(load_tokens(d.path), config, spans, f"data.path {d.path!r}")


def scan_token_ids(tokens, config: Config, spans: Spans | None, where: str):
    """Checks every id of ``tokens`` when there are at most :data:`FULL_SCAN`; returns
    None then, else the check for each batch row's ids, ``(low, top) -> None``."""
    if len(tokens) <= FULL_SCAN:  # a full scan is cheap; huge files are checked per batch
        check_token_ids(int(tokens.min()), int(tokens.max()), config, spans, where)
        return None
    return functools.partial(check_token_ids, config=config, spans=spans, where=where)


def check_token_ids(low: int, top: int, config: Config, spans: Spans | None, where: str):
    """Raises ConfigError unless the ids ``low``..``top`` (of ``where``) are token ids of
    ``model.vocab_size``, below span corruption's sentinels when there are any."""
    vocab = config.model.vocab_size
    ids = vocab - (spans.spans if spans else 0)
    if low < 0:
        raise ConfigError(
            f"{where} holds token id {low}: token ids are 0 or more. The file is not a "
            "token file, or was written with another dtype (python -m hetjax.tokenize "
            "writes one)"
        )
    if top >= ids and spans:
        raise ConfigError(
            f"{where} holds token id {top}, but span corruption's {spans.spans} sentinels "
            f"take ids {ids}..{vocab - 1} of model.vocab_size {vocab}; raise "
            f"model.vocab_size to at least {top + 1 + spans.spans}"
        )
    if top >= ids:
        raise ConfigError(
            f"{where} holds token id {top} but model.vocab_size is {vocab}; raise "
            "model.vocab_size to at least max id + 1"
        )


@dataclass(kw_only=True)
class TokenWindows:
    """Batches of ``(B, W)`` token windows (W = ``window``, ``T + 1`` when 0) starting
    every ``T`` tokens, over one split of a token stream."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    process_index: int = 0  # this process reads its share of each micro-batch's rows
    process_count: int = 1
    grad_accum: int = 1
    window: int = 0  # tokens per window; 0: seq_len + 1 (data.objective=lm)
    spans: Spans | None = None  # span corruption's (its window is ``spans.window``)
    vocab_size: int = 0  # whose top ids are the sentinels (span corruption)
    check_ids: Callable[[int, int], None] | None = None  # (low, top) of each row read

    def __post_init__(self):
        if self.batch_size % (self.grad_accum * self.process_count):
            raise ConfigError(
                f"config key 'train.batch_size' ({self.batch_size}) must split evenly into "
                f"{self.grad_accum} micro-batch(es) over {self.process_count} processes"
            )
        self.window = self.window or self.seq_len + 1
        self.num_windows = (len(self.tokens) - self.window) // self.seq_len + 1
        if len(self.tokens) < self.window:
            raise ConfigError(
                f"the data split has {len(self.tokens)} tokens, fewer than one window of "
                f"{self.window} (train.seq_len={self.seq_len}, data.objective); use more "
                "data or a shorter seq_len"
            )
        self._perm_pass, self._perm = -1, None

    def window_index(self, i: int, r: int) -> int:
        k = i * self.batch_size + r
        if not self.shuffle:
            return k % self.num_windows
        data_pass, pos = divmod(k, self.num_windows)
        if data_pass != self._perm_pass:
            rng = np.random.default_rng([self.seed, data_pass])
            self._perm, self._perm_pass = rng.permutation(self.num_windows), data_pass
        return int(self._perm[pos])

    def own_rows(self) -> list[int]:
        """Rows of a global batch this process reads (all of them for one process)."""
        micro = self.batch_size // self.grad_accum
        share = micro // self.process_count
        first = self.process_index * share
        return [a * micro + first + j for a in range(self.grad_accum) for j in range(share)]

    def batch(self, i: int) -> np.ndarray:
        """This process's rows of batch ``i`` as int32 ``(B / processes, W)`` (span
        corruption: each window corrupted, see the module docstring)."""
        T, W = self.seq_len, self.window
        rows = []
        for r in self.own_rows():
            k = self.window_index(i, r)
            raw = np.asarray(self.tokens[k * T : k * T + W])
            if self.check_ids is not None:  # a file too big to scan whole at start
                self.check_ids(int(raw.min()), int(raw.max()))
            row = raw.astype(np.int32)
            if self.spans is not None:
                rng = np.random.default_rng([self.seed, SPAN_STREAM, k])
                row = self.spans.corrupt(row, self.vocab_size, rng)
            rows.append(row)
        return np.stack(rows)


def make_datasets(config: Config) -> tuple[TokenWindows, TokenWindows, str]:
    """Returns (train, validation, description) for the configured token data
    (``data.format=jsonl``'s records: :func:`hetjax.instruct.make_datasets`, which
    calls this for the others)."""
    d, t = config.data, config.train
    if d.format == "jsonl":
        raise ValueError("data.format=jsonl: use hetjax.instruct.make_datasets")
    if d.path:
        tokens, source = load_tokens(d.path), d.path
    else:
        tokens = embedded_corpus(d.corpus_bytes)
        source = f"embedded corpus (Python {sys.version.split()[0]} stdlib, bytes)"
    spans = spans_of(d, t.seq_len)
    checked = scan_token_ids(
        tokens, config, spans, f"data.path {d.path!r}" if d.path else "the data"
    )
    window = spans.window if spans else window_length(d, t.seq_len)
    n_val = max(int(len(tokens) * d.val_fraction), window)
    import jax

    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train = TokenWindows(
        tokens=tokens[:-n_val],
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        shuffle=d.shuffle,
        seed=t.seed,
        **shard,
        grad_accum=t.grad_accum,
        window=window,
        spans=spans,
        vocab_size=config.model.vocab_size,
        check_ids=checked,
    )
    val = TokenWindows(
        tokens=tokens[-n_val:], seq_len=t.seq_len, batch_size=t.batch_size, shuffle=False,
        seed=t.seed, **shard, window=window, spans=spans, vocab_size=config.model.vocab_size,
        check_ids=checked,
    )  # fmt: skip
    desc = f"{source}: {len(tokens):,} tokens ({len(tokens) - n_val:,} train, {n_val:,} val)"
    return train, val, desc
