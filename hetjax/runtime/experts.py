"""Expert parallelism's block slab (``distributed.expert_parallel``): where a mixture of
experts' block keeps its experts so that ZeRO-3's pages split them by device.

Under ZeRO-3 (``zero.py``) a stage's slab is a ``(pages, page_elems)`` array of which
each of the N devices of the mesh owns one contiguous share, and its pages are
all-gathered onto every device before the stage computes. With the experts split over
the G devices of the ``expert`` axis (N = S x G: S devices on the ``data`` axis), a
device computes with the block's dense params (attention, norms, router) and only its
own group of E/G experts, so the block slab is laid out for that
(:class:`ExpertSlabLayout`): device n = (s, g)'s share is

    [ share s of expert group g's slab | share n of the dense slab ]

where the dense slab is the block without its experts (pages a multiple of N, its
leaves right-aligned) and a group's slab holds experts [g E/G, (g+1) E/G) (pages a
multiple of S). So the storage is ZeRO-3's unchanged (every page owned by one device,
each process's pages contiguous: its optimizer, stores and checkpoints are as for any
stage); what changes is the gather: the dense shares are all-gathered over every
device, a group's expert shares over the ``data`` axis only, never over ``expert``
(``zero.py``), and the gradients are reduce-scattered the same ways. Weight decay
stays a single split point: every expert and dense weight comes before the dense
norm scales, which end the slab (the last device's share must hold them all).

Checkpoints record this layout (its leaves, cut at the shares, each piece with where it
starts in its leaf): restored into the same layout, each process reads its pages as
they are; into any other (another ``expert_parallel``, device count or page size, one
device, the in-memory runtime), the stage's params are reassembled from the pieces and
laid out anew (``state_io.restore``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import ConfigError
from hetjax.storage.pages import Leaf, SlabLayout
from models.llama import join_experts, split_experts


class ExpertPages(NamedTuple):
    """A block's params on the device under expert parallelism: the dense pages whole
    (replicated, as any gathered stage's) and this device's group of experts, a
    ``(group pages, page_elems)`` array (globally ``(G x group pages, page_elems)``
    split over the ``expert`` axis)."""

    dense: list
    experts: Any


@dataclasses.dataclass(frozen=True)
class ExpertSlabLayout:
    """A MoE block's slab laid out for expert parallelism (see the module docstring);
    the :class:`~hetjax.storage.pages.SlabLayout` interface the runtime uses."""

    dense: SlabLayout  # the block without its experts; pages a multiple of N
    experts: SlabLayout  # one group's E/G experts; pages a multiple of S
    groups: int  # G: devices on the expert axis
    shares: int  # S: devices on the data axis

    @classmethod
    def of(cls, block: Any, page_bytes: int, groups: int, shares: int) -> ExpertSlabLayout:
        """The layout of a block's params (arrays or shapes) with its experts split into
        ``groups`` groups, on ``groups`` x ``shares`` devices."""
        rest, experts = split_experts(block)
        group = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // groups, *a.shape[1:]), a.dtype), experts
        )
        layout = cls(
            SlabLayout.from_params(rest, page_bytes, groups * shares),
            SlabLayout.from_params(group, page_bytes, shares),
            groups,
            shares,
        )
        assert layout.experts.num_decay == layout.experts.size  # expert weights all decay
        unscaled = layout.dense.size - layout.dense.num_decay  # norm scales: not decayed
        if unscaled > layout.dense_share * layout.page_elems:
            raise ConfigError(
                f"config key 'memory.page_size': a block's {unscaled} norm-scale elements "
                f"(not weight-decayed) exceed one device's share of its dense pages "
                f"({layout.dense_share} pages of {layout.page_elems} elements) under "
                "distributed.expert_parallel; raise memory.page_size"
            )
        return layout

    # -- sizes (pages and elements) -------------------------------------------------------

    @property
    def devices(self) -> int:
        return self.groups * self.shares

    @property
    def page_elems(self) -> int:
        return self.dense.page_elems

    @property
    def dense_share(self) -> int:
        """Pages of the dense slab per device."""
        return self.dense.num_pages // self.devices

    @property
    def expert_share(self) -> int:
        """Pages of a group's expert slab per device of the group."""
        return self.experts.num_pages // self.shares

    @property
    def share(self) -> int:
        """Pages each device owns."""
        return self.expert_share + self.dense_share

    @property
    def num_pages(self) -> int:
        return self.devices * self.share

    @property
    def padded_size(self) -> int:
        return self.num_pages * self.page_elems

    size = padded_size  # no padding at the end: the norm scales end the slab

    @property
    def compute_size(self) -> int:
        """Elements a device computes with: the dense pages and one group's experts."""
        return (self.dense.num_pages + self.experts.num_pages) * self.page_elems

    @property
    def gathered_size(self) -> int:
        """Elements the gather brings each device from the others: (N-1)/N of the dense
        pages, (S-1)/S of its group's experts (none of another group's)."""
        N, S, P = self.devices, self.shares, self.page_elems
        return (self.dense.num_pages * (N - 1) // N + self.experts.num_pages * (S - 1) // S) * P

    @property
    def page_multiple(self) -> int:
        return self.devices

    @property
    def num_decay(self) -> int:
        return self.padded_size - (self.dense.size - self.dense.num_decay)

    @property
    def _shift(self) -> int:
        """Elements of padding before the dense leaves (right-aligned in their pages)."""
        return self.dense.padded_size - self.dense.size

    def nbytes(self, dtype: Any) -> int:
        return self.padded_size * jnp.dtype(dtype).itemsize

    def shard(self, first_page: int, num_pages: int) -> SlabLayout:
        """The layout of a page range, for the optimizer of one process's shards."""
        whole = SlabLayout(
            leaves=(),
            treedef=None,
            tree_order=(),
            num_decay=self.num_decay,
            size=self.size,
            page_elems=self.page_elems,
        )
        return whole.shard(first_page, num_pages)

    @property
    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf's pieces, one per device share it falls in, at their offsets in the
        slab, each with its whole leaf's path and shape and where in that leaf it starts
        (what a checkpoint records of the layout: it reassembles the params from them,
        ``checkpoint_state.StoredState.stage_tree``)."""
        P, pieces = self.page_elems, []

        def cut(leaves, start, stop, at, group=0, groups=1):
            # the pieces of ``leaves`` in slab elements [start, stop), placed at ``at``;
            # the leaves are group ``group`` of ``groups`` stacked on their first axis
            for leaf in leaves:
                lo, hi = max(leaf.offset, start), min(leaf.offset + leaf.size, stop)
                if lo < hi:
                    shape = (leaf.shape[0] * groups, *leaf.shape[1:]) if groups > 1 else leaf.shape
                    first = group * leaf.size + lo - leaf.offset  # in the whole leaf
                    pieces.append(Leaf(leaf.path, shape, at + lo - start, hi - lo, first))

        dense = [dataclasses.replace(f, offset=f.offset + self._shift) for f in self.dense.leaves]
        Pe, Pd = self.expert_share * P, self.dense_share * P
        for n in range(self.devices):
            s, g = divmod(n, self.groups)
            at = n * self.share * P
            cut(self.experts.leaves, s * Pe, (s + 1) * Pe, at, g, self.groups)
            cut(dense, n * Pd, (n + 1) * Pd, at + Pe)
        return tuple(pieces)

    # -- params <-> slab ------------------------------------------------------------------

    def flatten(self, params: Any, dtype: Any = jnp.float32) -> jax.Array:
        """A whole block's params -> its slab (padded_size,) in ``dtype`` (in and out
        of jit)."""
        return self._flatten(params, jnp, lambda lay, p: lay.flatten(p, dtype))

    def flatten_np(self, params: Any, dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`flatten`, on the host with numpy."""
        return self._flatten(params, np, lambda lay, p: lay.flatten_np(p, dtype))

    def _flatten(self, params, xp, flatten):
        rest, experts = split_experts(params)
        P, N, G, S = self.page_elems, self.devices, self.groups, self.shares
        dense = flatten(self.dense, rest)[: self.dense.size]
        dense = xp.concatenate([xp.zeros(self._shift, dense.dtype), dense])
        per_group = self.experts.leaves[0].shape[0]
        group = lambda g: jax.tree.map(lambda a: a[g * per_group : (g + 1) * per_group], experts)
        groups = xp.stack([flatten(self.experts, group(g)) for g in range(G)])  # (G, elements)
        shares = groups.reshape(G, S, -1).transpose(1, 0, 2).reshape(N, -1)  # device n = (s, g)
        return xp.concatenate([shares, dense.reshape(N, self.dense_share * P)], axis=1).reshape(-1)

    def unflatten(self, slab: Any) -> Any:
        """Slab -> the whole block's params (numpy in, numpy out; else jnp)."""
        xp = np if isinstance(slab, np.ndarray) else jnp
        P, G, S = self.page_elems, self.groups, self.shares
        rows = slab.reshape(self.devices, self.share * P)
        experts = rows[:, : self.expert_share * P].reshape(S, G, -1).transpose(1, 0, 2)
        experts = experts.reshape(G, self.experts.padded_size)
        rest = self.dense.unflatten(rows[:, self.expert_share * P :].reshape(-1)[self._shift :])
        groups = [self.experts.unflatten(experts[g]) for g in range(G)]
        return join_experts(rest, jax.tree.map(lambda *a: xp.concatenate(a), *groups))

    def unflatten_pages(self, pages: ExpertPages) -> Any:
        """Inside a stage function: the pages a device computes with -> the block's
        params with this device's group of experts (each expert leaf E/G rows)."""
        rest = self.dense.unflatten_pages(pages.dense, offset=self._shift)
        return join_experts(rest, self.experts.unflatten(pages.experts.reshape(-1)))

    leaf_buffers = False  # the device takes pages (ZeRO-3's): pages.SlabLayout's flag

    def grad_pages(self, grad: ExpertPages) -> ExpertPages:
        """A gradient as the block's pages: they are (the device takes pages here)."""
        return grad

    def device_pages(self, dtype: Any) -> ExpertPages:
        """The abstract pages a device computes with (global shapes)."""
        sds, P = jax.ShapeDtypeStruct, self.page_elems
        experts = sds((self.groups * self.experts.num_pages, P), dtype)
        return ExpertPages([sds((P,), dtype)] * self.dense.num_pages, experts)
