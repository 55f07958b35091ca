"""int8 moments on NVMe (``optimizer.state_dtype=int8``, ``offload.optimizer=nvme``):
their codes in the state tier's page files, their scales in page files of their own.

An int8 moment is two arrays (``moments.Int8Blocks``): one byte a element, and an fp32
scale a block of ``INT8_BLOCK`` elements, the blocks restarting at each page's first
element (``moments.py``), so a page's scales are its own: ``ceil(page / INT8_BLOCK)``
of them. A page file holds one dtype and one page size, so :class:`ScaledStateStore`
keeps two :class:`~hetjax.storage.states.NvmeStateStore` side by side with the same
stages, pages and copies:

* ``codes`` (``<nvme>/optimizer``): the master (fp32) and each moment's codes (int8),
  pages of ``page_elems``: the pages every other format has, O_DIRECT where their
  bytes are whole 4 KiB blocks, hard links between copies, the params' reads of
  the master (``params.MasterPages``);
* ``scales`` (``<nvme>/optimizer_scales``): each moment's scales, pages of
  ``ceil(page_elems / INT8_BLOCK)`` fp32 (0.2 % of the codes' bytes), through
  TensorStore where that is not whole 4 KiB blocks (pages under 2M elements). No page
  is left unwritten and linked (``links``: deferred updates update every page).

Every call goes to both, each moment split into its codes and scales on the way in and
joined on the way out (views of the two stores' pooled buffers: the native kernel
updates them in place). Each store keeps its own CRC-32s of every page, its
copies (two, or one written in place: ``nvme_copies.py``) and its manifest; a
commit or abort flips both. A checkpoint takes an int8 moment as the float32 values it
holds (as from host RAM, ``runtime/state_io.py``), read page by page from the frozen
committed copy of both stores when the checkpoint writes the stage: nothing of
the tier is hard-linked into it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hetjax.state_format import INT8_BLOCK, SCALE_DTYPE, KindFormat, StateFormat
from hetjax.storage.nvme_states import NvmeStateStore
from hetjax.storage.stripes import Stripes

SCALES_SUFFIX = "_scales"  # the scales' directory: the codes' name and this


def has_scales(state_format: StateFormat) -> bool:
    """Whether a state format has block-scaled kinds (int8 moments)."""
    return any(state_format.kind(k).block_size for k in state_format.kinds)


def page_scales(page_elems: int) -> int:
    """Scales a page of ``page_elems`` elements has (blocks from its first element)."""
    return -(-page_elems // INT8_BLOCK)


class ScaleFormat:
    """The scales store's "format" (what :class:`NvmeStateStore` reads of a
    ``StateFormat``): the scaled kinds, each fp32 and no master."""

    def __init__(self, kinds: list[str]):
        self.kinds = list(kinds)
        self.dtypes = dict.fromkeys(self.kinds, SCALE_DTYPE)

    def nbytes(self, elems: int, kinds=None) -> int:
        return elems * SCALE_DTYPE.itemsize * len(self.kinds if kinds is None else list(kinds))


def code_format(state_format: StateFormat) -> StateFormat:
    """``state_format`` with each block-scaled kind as its codes alone (one array)."""
    return StateFormat.of(
        {k: KindFormat(f.dtype) if f.block_size else f for k, f in state_format.formats}
    )


def _join(blocks: Callable, codes: Any, scales: Any) -> Any:
    """A moment's codes and scales (each a slab or a list of chunks) as ``blocks``."""
    if isinstance(codes, list):
        return [blocks(c, s) for c, s in zip(codes, scales, strict=True)]
    return blocks(codes, scales)


def _split(slab: Any) -> tuple[Any, Any]:
    """:func:`_join`'s inverse."""
    if isinstance(slab, list):
        return [c.codes for c in slab], [c.scales for c in slab]
    return slab.codes, slab.scales


class ScaledStateStore:
    """Optimizer state with int8 moments on NVMe (module docstring); the interface of
    :class:`NvmeStateStore`, whose arguments it takes, and ``blocks``: what holds a
    moment's codes and scales, built from the two (``moments.Int8Blocks``: the
    optimizer's type, handed in, as this group does not import the optimizer's)."""

    def __init__(
        self,
        path: Path,
        state_format: StateFormat,
        stage_pages: dict[str, tuple[int, int]],
        page_elems: int,
        *,
        cached: list[str],
        sharding,
        io_slots: int,
        master_reads_kept: int = 0,
        copies: int = 2,
        stripes: Stripes | None = None,
        blocks: Callable,
    ):
        path = Path(path)
        self.blocks = blocks
        self.state_format = state_format
        self.kinds = state_format.kinds
        self.scaled = [k for k in self.kinds if state_format.kind(k).block_size]
        assert all(state_format.kind(k).block_size == INT8_BLOCK for k in self.scaled)
        self.stage_pages, self.page_elems = stage_pages, page_elems
        both = dict(cached=cached, sharding=sharding, io_slots=io_slots)
        both |= dict(copies=copies, stripes=stripes)
        self.codes = NvmeStateStore(
            path, code_format(state_format), stage_pages, page_elems,
            master_reads_kept=master_reads_kept, **both,
        )  # fmt: skip
        self.scales = NvmeStateStore(
            path.with_name(path.name + SCALES_SUFFIX), ScaleFormat(self.scaled), stage_pages,
            page_scales(page_elems), **both,
        )  # fmt: skip

    # -- both stores --------------------------------------------------------------------

    def _split(self, slabs: dict) -> tuple[dict, dict]:
        codes, scales = dict(slabs), {}
        for k in self.scaled:
            codes[k], scales[k] = _split(slabs[k])
        return codes, scales

    def _join(self, codes: dict, scales: dict) -> dict:
        return {k: _join(self.blocks, v, scales[k]) if k in scales else v for k, v in codes.items()}

    def init_stage(self, stage: str, slabs: dict, scalars: list) -> None:
        codes, scales = self._split(slabs)
        self.scales.init_stage(stage, scales, [])
        self.codes.init_stage(stage, codes, scalars)

    def wait_init(self) -> None:
        self.scales.wait_init()
        self.codes.wait_init()

    def prefetch(self, stage: str, skip: frozenset[int] = frozenset()) -> Any:
        codes = self.codes.prefetch(stage, skip)
        return None if codes is None else (codes, self.scales.prefetch(stage, skip))

    def get(self, stage: str, handle: Any = None, skip: frozenset[int] = frozenset()) -> tuple:
        codes, scales = handle if handle is not None else (None, None)
        scale_slabs, _ = self.scales.get(stage, scales, skip)
        slabs, scalars = self.codes.get(stage, codes, skip)
        return self._join(slabs, scale_slabs), scalars

    def recycle(self, stage: str) -> tuple[dict | None, bool]:
        codes, in_place = self.codes.recycle(stage)
        scales, _ = self.scales.recycle(stage)
        return (None if codes is None else self._join(codes, scales)), in_place

    def put(
        self, stage: str, slabs: dict, scalars: list, skip: frozenset[int] = frozenset()
    ) -> None:
        codes, scales = self._split(slabs)
        self.scales.put(stage, scales, [], skip)
        self.codes.put(stage, codes, scalars, skip)

    def commit(self) -> None:
        self.scales.commit()
        self.codes.commit()

    def abort(self) -> None:
        self.scales.abort()
        self.codes.abort()

    def flush(self) -> None:
        self.scales.flush()
        self.codes.flush()

    def links(self, stage: str) -> bool:
        """False: a step updates every page of an int8 stage (deferred updates, which
        leave pages unwritten and link them between copies, are not offered)."""
        return False

    def committed(self, stage: str) -> tuple[dict, list]:
        """A stage's committed state as fresh host copies; an int8 moment as int8 blocks."""
        codes, scalars = self.codes.committed(stage)
        scales, _ = self.scales.committed(stage)
        return self._join(codes, scales), scalars

    def freeze(self, stage: str) -> tuple[Any, list, Callable[[], None]]:
        """A stage's committed state for a checkpoint, unchanged until the release: a
        cached stage's slabs, or a streamed stage's pages as a mapping that reads them
        (an int8 moment as int8 blocks) when the checkpoint writes the stage."""
        codes, scalars, release_codes = self.codes.freeze(stage)
        scales, _, release_scales = self.scales.freeze(stage)

        def release() -> None:
            release_scales()
            release_codes()

        if isinstance(codes, tuple):  # a streamed stage's files
            n = self.stage_pages[stage][1]
            held = _FrozenPages(codes, scales, n, self.scaled, self.blocks)
        else:
            held = self._join(codes, scales)
        return held, scalars, release

    # -- the codes store's (the master and the params' view of it) ----------------------

    def master(self, stage: str) -> np.ndarray:
        return self.codes.master(stage)

    def offer_master_read(self, stage: str, read) -> None:
        self.codes.offer_master_read(stage, read)

    def written(self, stage: str, kind: str) -> list:
        return self.codes.written(stage, kind)

    @property
    def cached(self) -> set[str]:
        return self.codes.cached

    @property
    def cache(self) -> dict:
        return self.codes.cache

    @property
    def disk(self) -> list:
        return self.codes.disk

    @property
    def current(self) -> int:
        return self.codes.current

    # -- bytes --------------------------------------------------------------------------

    @property
    def read_bytes(self) -> int:
        return self.codes.read_bytes + self.scales.read_bytes

    @property
    def write_bytes(self) -> int:
        return self.codes.write_bytes + self.scales.write_bytes

    @property
    def read_kinds(self) -> collections.Counter:
        """Bytes read by kind (an int8 moment's codes and scales together)."""
        return self.codes.read_kinds + self.scales.read_kinds

    def host_bytes(self) -> int:
        return self.codes.host_bytes() + self.scales.host_bytes()

    def device_bytes(self) -> int:
        return 0

    @property
    def nvme_bytes(self) -> int:
        return self.codes.nvme_bytes + self.scales.nvme_bytes


class _FrozenPages(Mapping):
    """A streamed stage's committed pages in both stores' frozen copy, read when
    iterated: ``{kind: [slab]}`` (an int8 moment as int8 blocks), the form a
    checkpoint's ``SlabOptimizer.values`` takes (one chunk, the whole slab)."""

    def __init__(self, codes: tuple, scales: tuple, n: int, scaled: list[str], blocks: Callable):
        (self._codes, self._first), (self._scales, _) = codes, scales
        self._n, self._scaled, self._blocks = n, scaled, blocks

    def __getitem__(self, kind: str) -> list:
        codes = self._codes.read(kind, self._first, self._n).result().reshape(-1)
        if kind not in self._scaled:
            return [codes]
        scales = self._scales.read(kind, self._first, self._n).result().reshape(-1)
        return [self._blocks(codes, scales)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._codes.kinds)

    def __len__(self) -> int:
        return len(self._codes.kinds)
