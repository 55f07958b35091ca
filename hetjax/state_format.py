"""The optimizer state's format: which kinds of state a stage has and the dtype of each.

A stage's optimizer state is its fp32 master params plus one slab per *state kind* of
the optimizer (``mu`` and ``nu`` for Adam, ``mu`` for Lion, ``trace`` for SGD with
momentum; ``optimizer/slab.py``). :class:`StateFormat` says, per kind, the dtype its
slab is stored in and, for a block-quantized kind, how many elements share one scale.
It is the one place those bytes are declared: the memory model (``memory.py``,
``memory_host.py``), the planner's workload, the state stores, the NVMe tier's I/O pool,
the checkpoint and the host kernel all read it, so planner and runtime bytes move
together when it changes (``tests/test_state_format.py``).

``optimizer.state_dtype`` chooses the moments' format (:func:`state_format`):
``float32`` (the default), ``bfloat16`` (rounded to nearest even after each update) or
``int8`` (blockwise: one fp32 scale per :data:`INT8_BLOCK` elements, the moments' own
code, ``optimizer/moments.py``). The master is always fp32. Imports numpy and ml_dtypes
only (and ``hetjax.types`` for the master's name), so the memory model can use it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from hetjax.types import MASTER

if TYPE_CHECKING:
    from hetjax.config import OptimizerConfig

MASTER_DTYPE = np.dtype(np.float32)  # the master params': what every update accumulates in
SCALE_DTYPE = np.dtype(np.float32)  # one scale of a block-quantized kind
BF16 = np.dtype(ml_dtypes.bfloat16)
INT8_BLOCK = 2048  # elements per scale of int8 moments (bitsandbytes' block size)

# The state kinds besides the master of each optimizer (``optimizer.name``), as
# ``SlabOptimizer`` finds them in optax's state (it checks they agree); SGD has its
# ``trace`` only with momentum.
OPTIMIZER_KINDS: dict[str, tuple[str, ...]] = {
    "adamw": ("mu", "nu"),
    "adam": ("mu", "nu"),
    "lion": ("mu",),
    "sgd": ("trace",),
}


@dataclasses.dataclass(frozen=True)
class KindFormat:
    """How one kind of state is stored: elements of ``dtype`` and, where ``block_size``
    is set, one :data:`SCALE_DTYPE` scale per ``block_size`` elements (int8 moments:
    held in memory as ``moments.Int8Blocks``, each chunk its own blocks)."""

    dtype: np.dtype
    block_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, not {self.block_size}")

    def nbytes(self, elems: int, page_elems: int = 0) -> int:
        """Bytes of ``elems`` elements (with their blocks' scales). ``page_elems``: the
        elements are whole pages of that many, each page's blocks its own (a host slab's:
        ``moments.py``); 0: one run of blocks."""
        data = elems * self.dtype.itemsize
        if self.block_size is None:
            return data
        blocks = -(-elems // self.block_size)
        if page_elems:
            pages, rest = divmod(elems, page_elems)
            blocks = pages * -(-page_elems // self.block_size) + -(-rest // self.block_size)
        return data + blocks * SCALE_DTYPE.itemsize

    @property
    def bytes_per_elem(self) -> float:
        """Bytes per element, a block's scale shared by its elements."""
        if self.block_size is None:
            return self.dtype.itemsize
        return self.dtype.itemsize + SCALE_DTYPE.itemsize / self.block_size


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """Every kind of a stage's optimizer state, the master first, with its
    :class:`KindFormat`. Hashable; build it with :meth:`of` or :meth:`fp32`."""

    formats: tuple[tuple[str, KindFormat], ...]

    def __post_init__(self):
        names = [k for k, _ in self.formats]
        if not names or names[0] != MASTER or len(set(names)) != len(names):
            raise ValueError(f"state kinds must be {MASTER!r} first, each once: {names}")
        master = self.formats[0][1]
        if master.dtype != MASTER_DTYPE or master.block_size is not None:
            raise ValueError(f"the master is {MASTER_DTYPE.name}, not {master}")

    @classmethod
    def of(cls, kinds: Mapping[str, Any]) -> StateFormat:
        """From ``{kind: dtype or KindFormat}`` (the master first)."""
        wrap = lambda f: f if isinstance(f, KindFormat) else KindFormat(f)
        return cls(tuple((k, wrap(f)) for k, f in kinds.items()))

    @classmethod
    def fp32(cls, moments: Sequence[str]) -> StateFormat:
        """The fp32 master and the state kinds ``moments``, all fp32."""
        return cls.of({MASTER: MASTER_DTYPE, **dict.fromkeys(moments, np.float32)})

    @property
    def kinds(self) -> list[str]:
        """Every kind, the master first."""
        return [k for k, _ in self.formats]

    @property
    def moments(self) -> list[str]:
        """The kinds besides the master."""
        return self.kinds[1:]

    @functools.cached_property
    def _by_kind(self) -> dict[str, KindFormat]:
        return dict(self.formats)

    @functools.cached_property
    def _elem_bytes(self) -> int | None:  # every kind's bytes an element; None: scaled
        if any(f.block_size is not None for _, f in self.formats):
            return None
        return sum(f.dtype.itemsize for _, f in self.formats)

    def kind(self, kind: str) -> KindFormat:
        return self._by_kind[kind]

    def dtype(self, kind: str) -> np.dtype:
        """The dtype a store holds ``kind`` in, one array of it. Raises
        ``NotImplementedError`` for a block-scaled kind: its elements and scales are two
        arrays (``moments.Int8Blocks``), which the page stores (NVMe, checkpoints) and
        the native kernel do not hold."""
        f = self.kind(kind)
        if f.block_size is not None:
            raise NotImplementedError(
                f"state kind {kind!r} has block scales: not one array of one dtype"
            )
        return f.dtype

    @property
    def dtypes(self) -> dict[str, np.dtype]:
        """``{kind: dtype}``, the master first (:meth:`dtype` of each)."""
        return {k: self.dtype(k) for k in self.kinds}

    def nbytes(self, elems: int, kinds: Iterable[str] | None = None, page_elems: int = 0) -> int:
        """Bytes of ``elems`` elements of each kind in ``kinds`` (default: every kind);
        ``page_elems``: as :meth:`KindFormat.nbytes`'s."""
        if kinds is None:
            if self._elem_bytes is not None:  # the memory model's case, thousands of times
                return elems * self._elem_bytes
            kinds = self.kinds
        return sum(self.kind(k).nbytes(elems, page_elems) for k in kinds)

    @property
    def bytes_per_param(self) -> float:
        """Bytes per parameter of every kind (an int where no kind has block scales)."""
        return sum(f.bytes_per_elem for _, f in self.formats)

    @property
    def moment_bytes_per_param(self) -> float:
        """Bytes per parameter of the kinds besides the master."""
        return self.bytes_per_param - self.formats[0][1].bytes_per_elem

    def describe(self) -> str:
        """E.g. ``master float32, mu float32, nu float32``."""
        scale = lambda f: f" (a scale per {f.block_size})" if f.block_size else ""
        return ", ".join(f"{k} {f.dtype.name}{scale(f)}" for k, f in self.formats)


def moment_format(state_dtype: str) -> KindFormat:
    """How moments of ``optimizer.state_dtype`` are stored."""
    if state_dtype == "int8":
        return KindFormat(np.int8, block_size=INT8_BLOCK)
    return KindFormat({"float32": MASTER_DTYPE, "bfloat16": BF16}[state_dtype])


def state_format(cfg: OptimizerConfig) -> StateFormat:
    """The state format of the optimizer ``cfg`` configures: the fp32 master and its
    moments in ``optimizer.state_dtype``."""
    moments = OPTIMIZER_KINDS[cfg.name]
    if cfg.name == "sgd" and not cfg.momentum:
        moments = ()
    moment = moment_format(cfg.state_dtype)
    return StateFormat.of({MASTER: MASTER_DTYPE, **dict.fromkeys(moments, moment)})
