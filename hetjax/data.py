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

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetjax.config import Config, ConfigError


def window_length(objective: str, seq_len: int) -> int:
    """Tokens of one window (a batch row) for ``data.objective`` and ``train.seq_len``:
    ``T + 1`` (lm) or ``2 T`` (prefix_lm)."""
    return 2 * seq_len if objective == "prefix_lm" else seq_len + 1


def split_window(objective: str, windows):
    """Batch rows (..., W) -> (tokens (..., T), targets (..., T)): for ``lm`` the inputs
    and the next tokens; for ``prefix_lm`` the encoder's input and the decoder's targets
    (the decoder's input is made from the targets by the model, as HF's T5 does from its
    labels). Works on numpy and JAX arrays alike."""
    if objective == "prefix_lm":
        T = windows.shape[-1] // 2
        return windows[..., :T], windows[..., T:]
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
    """Memory-maps a token file: flat little-endian uint16 ``.bin`` or 1-D ``.npy``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key 'data.path': no such file {path!r}")
    if p.suffix == ".npy":
        tokens = np.load(p, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ConfigError(
                f"data.path {path!r}: expected a 1-D integer array, got {tokens.dtype} "
                f"with shape {tokens.shape}"
            )
        return tokens
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ConfigError(
                f"data.path {path!r}: a .bin token file holds uint16, so its size must be even"
            )
        return np.memmap(p, dtype="<u2", mode="r")
    raise ConfigError(f"data.path {path!r}: unknown token file type; use .bin (uint16) or .npy")


@dataclass
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
        """This process's rows of batch ``i`` as int32 ``(B / processes, W)``."""
        T, W = self.seq_len, self.window
        rows = [
            np.asarray(self.tokens[(k := self.window_index(i, r)) * T : k * T + W])
            for r in self.own_rows()
        ]
        return np.stack(rows).astype(np.int32)


def make_datasets(config: Config) -> tuple[TokenWindows, TokenWindows, str]:
    """Returns (train, validation, description) for the configured data."""
    d, t = config.data, config.train
    if d.path:
        tokens, source = load_tokens(d.path), d.path
    else:
        tokens = embedded_corpus(d.corpus_bytes)
        source = f"embedded corpus (Python {sys.version.split()[0]} stdlib, bytes)"
    if len(tokens) <= 16 * 1024 * 1024:  # a full scan is cheap; huge files are checked per batch
        top = int(tokens.max())
        if top >= config.model.vocab_size:
            raise ConfigError(
                f"data holds token id {top} but model.vocab_size is {config.model.vocab_size}; "
                "raise model.vocab_size to at least max id + 1"
            )
    window = window_length(d.objective, t.seq_len)
    n_val = max(int(len(tokens) * d.val_fraction), window)
    import jax

    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train = TokenWindows(
        tokens[:-n_val],
        t.seq_len,
        t.batch_size,
        d.shuffle,
        t.seed,
        **shard,
        grad_accum=t.grad_accum,
        window=window,
    )
    val = TokenWindows(
        tokens[-n_val:], t.seq_len, t.batch_size, False, t.seed, **shard, window=window
    )
    desc = f"{source}: {len(tokens):,} tokens ({len(tokens) - n_val:,} train, {n_val:,} val)"
    return train, val, desc
