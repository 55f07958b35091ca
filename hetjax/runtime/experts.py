"""Expert parallelism's block slab (``distributed.expert_parallel``): a mixture of
experts' block laid out so that ZeRO-3's pages split its experts by device.

With the experts split over the G devices of the ``expert`` axis (N = S x G devices: S on
the ``data`` axis), a device computes with the block's dense params (attention, norms,
router) and only its own group of E/G experts: the block's slab is a
:class:`~hetjax.runtime.grouped.GroupedSlabLayout` whose grouped leaves are the experts,
already stacked on their first axis (:class:`ExpertGrouping`). Device n = (s, g)'s
share holds share s of expert group g's slab and share n of the dense slab; the dense
shares are all-gathered over every device, a group's expert shares over the ``data``
axis only, never over ``expert`` (``zero.py``), and the gradients are reduce-scattered
the same ways. Checkpoints record the pieces and restore into any other layout
(``grouped.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.distributed import EXPERT_AXIS
from hetjax.runtime.grouped import GroupedSlabLayout
from models.llama import join_experts, split_experts


@dataclasses.dataclass(frozen=True)
class ExpertGrouping:
    """A MoE block's experts (``models.llama.split_experts``), a group of E/G experts
    per device of the ``expert`` axis; nothing is moved (experts are the first axis)."""

    axis: str = EXPERT_AXIS

    def split(self, params: Any) -> tuple[Any, Any]:
        return split_experts(params)

    def join(self, rest: Any, grouped: Any) -> Any:
        return join_experts(rest, grouped)

    def cut(self, path: tuple[str, ...]) -> tuple[int, int]:
        return 0, 1


class ExpertSlabLayout(GroupedSlabLayout):
    """A MoE block's slab laid out for expert parallelism (see the module docstring)."""

    @classmethod
    def of(cls, block: Any, page_bytes: int, groups: int, shares: int) -> ExpertSlabLayout:  # type: ignore[override]
        """The layout of a block's params (arrays or shapes) with its experts split into
        ``groups`` groups, on ``groups`` x ``shares`` devices."""
        return super().of(block, page_bytes, groups, shares, ExpertGrouping())
