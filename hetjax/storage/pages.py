"""Page slabs: one stage's parameters flattened into one contiguous 1-D array.

A stage's leaves are laid out back to back, weight-decayed leaves first, then the rest,
and the slab is padded with zeros to a whole number of pages (at most
``memory.page_size`` bytes of fp32 master state, fitted to the block:
:func:`fitted_page_elems`). So a stage is one transfer, one contiguous page range on
NVMe, and the optimizer's decay mask is a single split point. Offsets are static: the
jitted stage functions slice the slab back into the pytree at no runtime cost.

Slabs vs per-leaf transfers, measured with ``python -m hetjax.bench slabs``: on the CPU
backend one ``device_put`` of a whole block slab copies on one thread, leaf by leaf runs
several times faster, and the slab moved as its list of pages in one ``device_put`` is
as fast as per-leaf. Storage keeps the slab layout and its
pages. What one device takes is the stage's leaves (:class:`LeafBuffers`, views of the
host slab, one ``device_put`` per stage): a stage function taking pages must cut every
weight that spans pages out of them, a device copy of it at every use (forward and the
backward's recompute); leaf buffers are read where they lie. ZeRO-3 takes pages, which
it shards and gathers. Gradients leave the device as pages either way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.state_format import MASTER_DTYPE

MASTER_ITEMSIZE = MASTER_DTYPE.itemsize  # pages are sized by fp32 master state
PAGE_ALIGN = 1024  # elements: pages are whole 4 KiB blocks of fp32 (direct I/O's unit)


def fitted_page_elems(block_elems: int, page_elems: int, multiple: int = 1) -> int:
    """The page size (elements) a model's slabs use: at most ``page_elems``
    (``memory.page_size``), as small as keeps a block's page count, so a block pads by
    less than ``PAGE_ALIGN`` elements a page instead of up to a whole page. Every block
    streams, is updated and moves to and from NVMe every step: with 4 MiB pages a
    310.8M GPT's block (12.59M params) padded to 13.63M, 8% more bytes per step than
    its state; fitted, 12.61M. ``multiple``: the page count's (ZeRO-3's data degree)."""
    if page_elems <= PAGE_ALIGN:
        return page_elems
    pages = -(-block_elems // page_elems)
    pages = -(-pages // multiple) * multiple
    fitted = -(-block_elems // pages)
    return min(page_elems, -(-fitted // PAGE_ALIGN) * PAGE_ALIGN)


HOST_ALIGN = 64  # bytes: a numpy array this aligned is shared with JAX, not copied
# bytes: what O_DIRECT transfers are aligned to (buffer address, file offset, length);
# the NVMe tier's pooled buffers are, so that pages are read straight into them
DIRECT_ALIGN = 4096


def aligned_concatenate(arrays: list) -> np.ndarray:
    """``np.concatenate(arrays)`` (1-D) into a buffer aligned to ``HOST_ALIGN`` bytes.

    On the CPU backend ``jax.device_put`` shares an aligned numpy buffer instead of
    copying it (a copy costs its bytes twice in memory traffic plus fresh pages); numpy's
    own allocations are only 16-byte aligned. Host gradient slabs (sums over
    micro-batches) are built here so the host optimizer reads them where they are
    (README, the NVMe table's notes)."""
    arrays = [np.asarray(a).reshape(-1) for a in arrays]
    out = aligned_empty(sum(a.size for a in arrays), np.result_type(*arrays))
    return np.concatenate(arrays, out=out)


def pages_slab(pages: list) -> np.ndarray:
    """Pages as one flat numpy slab: a view of the memory they are consecutive views of,
    when they are (no copy; an ``aligned_empty`` slab's pages too, whose base is the raw
    bytes around it), else a concatenation."""
    arrays = [p if isinstance(p, np.ndarray) else np.asarray(p) for p in pages]
    first, base = arrays[0], arrays[0].base
    if isinstance(base, np.ndarray) and base.flags.c_contiguous:
        end = first.ctypes.data
        for a in arrays:
            if a.base is not base or a.dtype != first.dtype or not a.flags.c_contiguous:
                break
            if a.ctypes.data != end:
                break
            end += a.nbytes
        else:
            raw = base.reshape(-1).view(np.uint8)
            start = first.ctypes.data - base.ctypes.data
            return raw[start : start + end - first.ctypes.data].view(first.dtype)
    return np.concatenate(arrays)


@dataclasses.dataclass(frozen=True)
class GradPages:
    """A stage's gradient on the host as it left the device: its pages in slab order,
    equal 1-D numpy arrays (float32 or bfloat16; views of the host buffers the copy
    landed in, no copy), never concatenated into one slab. The host optimizer reads them
    where they are: the native kernel takes their pointers, the jitted update a chunk's
    pages. A flat slab is one page (:meth:`of`)."""

    pages: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, arrays) -> GradPages:
        """Host arrays (numpy, or JAX arrays in host memory, which are viewed without a
        copy on the CPU backend): 1-D pages, 2-D blocks of pages (rows: ZeRO-3's shards)
        or one flat slab; a ``GradPages`` is returned as it is. Waits for JAX arrays to
        be ready (this is where a device-to-host copy is waited for)."""
        if isinstance(arrays, GradPages):
            return arrays
        if not isinstance(arrays, (list, tuple)):
            arrays = [arrays]
        pages = []
        for a in arrays:
            a = np.asarray(a)
            pages += list(a) if a.ndim == 2 else [a.reshape(-1)]
        return cls(tuple(pages))

    @property
    def dtype(self) -> np.dtype:
        return self.pages[0].dtype

    @property
    def page_elems(self) -> int:
        return self.pages[0].size

    @property
    def size(self) -> int:
        return len(self.pages) * self.page_elems

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def chunk(self, start: int, end: int) -> list[np.ndarray]:
        """Elements ``[start, end)`` as the pages (or parts of a page) covering them."""
        n = self.page_elems
        return [
            self.pages[k][max(start - k * n, 0) : min(end - k * n, n)]
            for k in range(start // n, -(-end // n))
        ]

    def slab(self) -> np.ndarray:
        """The gradient as one flat slab: the one page, or a concatenation (a copy)."""
        return self.pages[0] if len(self.pages) == 1 else aligned_concatenate(self.pages)


@functools.cache
def zero_page(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only page of zeros, one per shape and dtype: what the host takes for a
    gradient page known to be zero (allocating one per page would churn the allocator
    with page-sized blocks freed on another thread)."""
    page = np.zeros(shape, dtype)
    page.flags.writeable = False
    return page


def page_runs(pages) -> list[tuple[int, int]]:
    """Sorted page indices -> runs ``[a, b)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in sorted(pages):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def runs_outside(num_pages: int, pages) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of the pages of ``range(num_pages)`` not in ``pages``."""
    return page_runs(set(range(num_pages)) - set(pages))


def aligned_empty(n: int, dtype, align: int = HOST_ALIGN) -> np.ndarray:
    """``np.empty(n, dtype)`` aligned to ``align`` bytes (``HOST_ALIGN``: see
    aligned_concatenate; ``DIRECT_ALIGN``: for O_DIRECT reads)."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + n * dtype.itemsize].view(dtype)


def weight_decay_mask(params: Any) -> Any:
    """True for weight matrices (kernels, embeddings), False for biases and norm scales.
    Decided by leaf name, since stacked block params give every leaf a layer axis."""

    def is_matrix(path, leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name not in ("bias", "scale")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


@jax.tree_util.register_pytree_node_class
class LeafBuffers(tuple):
    """A stage's params as one device takes them: each leaf its own buffer, shaped, in
    slab order (:attr:`SlabLayout.leaf_buffers`). The stage functions then read every
    weight where it lies; from a list of pages they cut each weight from the pages it
    spans, a device copy of every weight that spans pages at every use (forward, and
    again in the backward's recompute). A pytree of its own type, so a function tells the
    two apart when it is traced."""

    def tree_flatten(self):
        return tuple(self), None

    @classmethod
    def tree_unflatten(cls, _aux, children) -> LeafBuffers:
        return cls(children)


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int  # in elements
    size: int
    # A piece of a leaf (a grouped slab, ``parallel/grouped.py``, cuts leaves by device):
    # where its ``size`` elements start in the leaf's, row-major; with ``parts`` > 1, in
    # the leaf's axis ``axis`` cut into that many slices stacked first (tensor
    # parallelism's slices, ``parallel/groupings.py``).
    start: int = 0
    axis: int = 0
    parts: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlabLayout:
    """Where each leaf of one stage's params sits in its slab (elements, not bytes)."""

    leaves: tuple[Leaf, ...]  # in slab order
    treedef: Any
    tree_order: tuple[int, ...]  # slab index of the k-th leaf in tree-flatten order
    num_decay: int  # elements [0, num_decay) are weight-decayed
    size: int  # elements in use
    page_elems: int
    page_multiple: int = 1  # pages pad to a multiple of this (ZeRO-3: the data degree)
    # The device takes the stage's params leaf by leaf (LeafBuffers: one device; the
    # runtime's stores hand them out so, :meth:`leaf_views`) rather than as pages
    # (ZeRO-3, whose pages are what it shards and gathers). Storage is pages either way.
    leaf_buffers: bool = False

    @classmethod
    def from_params(
        cls, params: Any, page_bytes: int, page_multiple: int = 1, leaf_buffers: bool = False
    ) -> SlabLayout:
        """Builds the layout from a params pytree (arrays or ShapeDtypeStructs); the
        slab pads to a multiple of ``page_multiple`` pages (one equal share per device
        under ZeRO-3). ``leaf_buffers``: the device takes the params leaf by leaf."""
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        decay = jax.tree.leaves(weight_decay_mask(params))
        order = sorted(range(len(paths_leaves)), key=lambda k: (not decay[k], k))
        leaves, offset, num_decay = [], 0, 0
        tree_order = [0] * len(paths_leaves)
        for slab_index, k in enumerate(order):
            path, leaf = paths_leaves[k]
            size = math.prod(leaf.shape)
            keys = tuple(str(getattr(p, "key", p)) for p in path)
            leaves.append(Leaf(keys, tuple(leaf.shape), offset, size))
            tree_order[k] = slab_index
            offset += size
            if decay[k]:
                num_decay = offset
        return cls(
            leaves=tuple(leaves),
            treedef=treedef,
            tree_order=tuple(tree_order),
            num_decay=num_decay,
            size=offset,
            page_elems=page_bytes // MASTER_ITEMSIZE,
            page_multiple=page_multiple,
            leaf_buffers=leaf_buffers,
        )

    def shard(self, first_page: int, num_pages: int) -> SlabLayout:
        """The layout of pages ``[first_page, first_page + num_pages)`` as a slab of
        their own, for the optimizer of one ZeRO-3 shard: the decay split point moves
        with the range; the leaves (which straddle shards) are left out."""
        start = first_page * self.page_elems
        size = num_pages * self.page_elems
        num_decay = min(max(self.num_decay - start, 0), size)
        return SlabLayout(
            leaves=(),
            treedef=None,
            tree_order=(),
            num_decay=num_decay,
            size=size,
            page_elems=self.page_elems,
        )

    @property
    def num_pages(self) -> int:
        pages = -(-self.size // self.page_elems)
        return -(-pages // self.page_multiple) * self.page_multiple

    @property
    def padded_size(self) -> int:
        return self.num_pages * self.page_elems

    @property
    def compute_size(self) -> int:
        """Elements a device computes with: the whole slab (an expert-parallel block's
        layout, ``parallel/layouts.py``, has its device's experts only)."""
        return self.padded_size

    @property
    def gathered_size(self) -> int:
        """Elements an all-gather of the slab brings each device from the others when it
        is split evenly over ``page_multiple`` devices (ZeRO-3); 0 on one device."""
        return self.padded_size * (self.page_multiple - 1) // self.page_multiple

    def device_pages(self, dtype: Any) -> list[jax.ShapeDtypeStruct] | LeafBuffers:
        """The abstract params a stage function takes: its leaves (``leaf_buffers``), or
        its pages."""
        if self.leaf_buffers:
            return LeafBuffers(jax.ShapeDtypeStruct(leaf.shape, dtype) for leaf in self.leaves)
        return [jax.ShapeDtypeStruct((self.page_elems,), dtype)] * self.num_pages

    def leaf_views(self, slab: np.ndarray) -> LeafBuffers:
        """A flat host slab (numpy) -> its leaves as shaped views of it (no copy), for a
        ``device_put`` that gives each leaf a buffer of its own."""
        return LeafBuffers(
            slab[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape) for leaf in self.leaves
        )

    def leaves_of_pages(self, pages: list[jax.Array]) -> LeafBuffers:
        """Pages -> the leaves, each cut from the pages it spans (inside jit: a device
        copy of the stage, made once where the pages are updated, not at every use)."""
        return LeafBuffers(
            self._cut(pages, leaf.offset, leaf.size).reshape(leaf.shape) for leaf in self.leaves
        )

    def grad_pages(self, grad: list[jax.Array] | LeafBuffers) -> list[jax.Array]:
        """Inside a backward's jit: the gradient of a stage's params as pages, whichever
        way the params came (the gradient leaves the device as pages, as the optimizer
        and the stores take them)."""
        if not isinstance(grad, LeafBuffers):
            return grad
        # Each page from just the leaf pieces it covers: a concatenation of the whole
        # slab before cutting it into pages would be one more stage-sized temporary.
        P, flat = self.page_elems, [jnp.ravel(g) for g in grad]
        pages = []
        for k in range(self.num_pages):
            start, end = k * P, (k + 1) * P
            parts = [
                g[max(start - leaf.offset, 0) : min(end - leaf.offset, leaf.size)]
                for leaf, g in zip(self.leaves, flat, strict=True)
                if leaf.offset < end and leaf.offset + leaf.size > start
            ]
            filled = sum(p.shape[0] for p in parts)
            if filled < P:  # the slab's padding
                parts.append(jnp.zeros(P - filled, flat[0].dtype))
            pages.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return pages

    def nbytes(self, dtype: Any) -> int:
        return self.padded_size * jnp.dtype(dtype).itemsize

    def flatten(self, params: Any, dtype: Any = jnp.float32) -> jax.Array:
        """params pytree -> slab (padded_size,) in ``dtype``. Works in and out of jit."""
        flat = jax.tree.leaves(params)
        parts = [None] * len(flat)
        for k, slab_index in enumerate(self.tree_order):
            parts[slab_index] = jnp.ravel(flat[k]).astype(dtype)
        parts.append(jnp.zeros(self.padded_size - self.size, dtype))
        return jnp.concatenate(parts)

    def flatten_np(self, params: Any, dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`flatten`, on the host with numpy (no device memory)."""
        slab = np.zeros(self.padded_size, dtype)
        flat = jax.tree.leaves(params)
        for k, slab_index in enumerate(self.tree_order):
            leaf = self.leaves[slab_index]
            slab[leaf.offset : leaf.offset + leaf.size] = np.ravel(np.asarray(flat[k]))
        return slab

    def to_pages(self, slab: jax.Array) -> list[jax.Array]:
        """slab (padded_size,) -> its pages, each (page_elems,). Works in jit."""
        P = self.page_elems
        return [slab[k * P : (k + 1) * P] for k in range(self.num_pages)]

    def unflatten_pages(self, pages: list[jax.Array] | LeafBuffers, offset: int = 0) -> Any:
        """A stage's params as the device took them -> params pytree (inside jit): its
        :class:`LeafBuffers` as they are, or its pages, each leaf cut from just the pages
        it spans (no copy of the whole slab; a copy of each leaf that spans pages).
        ``offset``: elements before the slab's first leaf in the pages."""
        if isinstance(pages, LeafBuffers):
            assert offset == 0, "leaf buffers hold one slab's leaves"
            flat = [pages[slab_index] for slab_index in self.tree_order]
            return jax.tree.unflatten(self.treedef, flat)
        flat = []
        for slab_index in self.tree_order:
            leaf = self.leaves[slab_index]
            flat.append(self._cut(pages, offset + leaf.offset, leaf.size).reshape(leaf.shape))
        return jax.tree.unflatten(self.treedef, flat)

    def _cut(self, pages: list[jax.Array], start: int, size: int) -> jax.Array:
        """Elements ``[start, start + size)`` of the pages, flat (inside jit)."""
        P, end = self.page_elems, start + size
        parts = [
            pages[k][max(start - k * P, 0) : min(end - k * P, P)]
            for k in range(start // P, (end - 1) // P + 1)
        ]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def unflatten(self, slab: jax.Array) -> Any:
        """slab -> params pytree (static slices; cheap inside jit)."""
        flat = []
        for slab_index in self.tree_order:
            leaf = self.leaves[slab_index]
            flat.append(slab[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape))
        return jax.tree.unflatten(self.treedef, flat)
