"""A plan: where every kind of state lives and what a step is predicted to cost, as
:func:`hetjax.planning.search.make_plan` chose it, and the table ``--plan`` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.config import ConfigError, format_bytes
from hetjax.placement import Placement
from hetjax.planning.batch import BatchCost
from hetjax.planning.cost import Candidate
from hetjax.planning.wear import Wear

# budgets' key for offload.mode=none's device budget where it differs from a streamed
# plan's: on the CPU backend, the RAM the host tier would otherwise share (_shared_ram)
IN_MEMORY = "device, in memory"


class PlanError(ConfigError):
    """The configuration cannot fit the hardware; the message names the tier and the
    shortfall."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Where every kind of state lives (a :class:`Candidate`: a placement, or mode none),
    and what the step is predicted to cost."""

    hardware: str
    workload: str
    candidate: Candidate  # with the prefetch depth and resident blocks the plans chose
    optimizer_cache: int  # host bytes caching NVMe optimizer state (whole stages)
    device: dict[str, int]  # bytes by what they hold, per device
    host: dict[str, int]  # per process
    nvme: dict[str, int]
    budgets: dict[str, int]  # device, host, nvme
    lanes: dict[str, float]  # seconds per step by lane
    step_s: float
    tokens_per_s: float
    tflops: float  # model FLOP/s per device
    bottleneck: str
    # s/step when global-norm clipping binds (sync mode: the update after backward)
    step_clipped_s: float = 0.0
    num_devices: int = 1
    # NVMe bytes a step writes and what that costs the drives (planning/wear.py)
    wear: Wear | None = None

    @property
    def placement(self) -> Placement:
        """The placement planned (mode none: everything on the device)."""
        return self.candidate.placement

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        """The config sections that train with this plan (``Config.replace(**...)``);
        with tensor parallelism the data x model split too."""
        overrides = self.candidate.config_overrides()
        if self.tensor_parallel > 1:
            overrides["distributed"] = dict(
                data_parallel=self.num_devices // self.tensor_parallel,
                tensor_parallel=self.tensor_parallel,
            )
        return overrides

    def table(self) -> str:
        lines = [f"plan for {self.workload} on {self.hardware}"]
        if self.candidate.mode == "none":
            lines += self._in_memory_lines()
        else:
            lines += self._stage_lines() + self._streamed_notes()
        lines += [f"  {line}" for line in self.fallbacks]
        lines += [f"  {self.split}"] if self.split else []
        per = " per device" if self.num_devices > 1 else ""
        for tier in ("device", "host", "nvme"):
            held = getattr(self, tier)
            total = sum(held.values())
            if not total:
                continue
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items() if v)
            budget = self.budgets.get(tier, 0)
            if tier == "device" and self.candidate.mode == "none":
                budget = self.budgets.get(IN_MEMORY, budget)
            lines.append(
                f"  {tier:<7}{format_bytes(total):>12} of {format_bytes(budget)}{per}  ({parts})"
            )
        lines += self._prediction_lines()
        return "\n".join(lines)

    def _in_memory_lines(self) -> list[str]:
        """offload.mode=none: where the state is, on one device or a mesh."""
        c, lines = self.candidate, []
        lines.append(
            "  offload.mode=none: params, gradients, optimizer state and activations on "
            "the device" + (" (model.remat: blocks recompute in backward)" if c.remat else "")
        )
        if self.num_devices > 1:
            data = self.num_devices // self.tensor_parallel
            held = ["whole over data"] if data > 1 else []
            if self.tensor_parallel > 1:
                held.append("split over the model axis by Megatron's rules")
            lines.append(
                f"  each device holds the state ({', '.join(held)}) and its data group's "
                "rows' activations" + ("; the gradients all-reduced over data" if data > 1 else "")
            )
        return lines

    def _stage_lines(self) -> list[str]:
        """A streamed plan's table of stages: where each one's params, state and
        activations are (consecutive blocks placed alike on one row)."""
        p, L, lines = self.candidate.placement, self.num_layers, []
        k = p.device_stages
        state = lambda cached: "device (cached)" if cached else p.optimizer
        lines += [
            f"  offload.mode=stream, prefetch depth {p.prefetch_depth}",
            f"  {'stage':<16}{'compute params':<22}{'fp32 master + optimizer':<25}activations",
        ]
        if (k >= 1) == (k == L + 2):  # embed and head alike
            lines.append(f"  {'embed, head':<16}{'device':<22}{state(k >= 1):<25}device")
        else:
            lines.append(f"  {'embed':<16}{'device':<22}{state(True):<25}device")
            lines.append(f"  {'head':<16}{'device':<22}{state(False):<25}device")
        rows: list[list] = []  # consecutive blocks of a group placed alike share a row
        labels = [(name, j) for name, n in self.groups or (("block", L),) for j in range(n)]
        for i, (group, j) in enumerate(labels):
            where = "device (resident)" if i < p.resident_blocks else f"{p.params}, streamed"
            if i >= L - p.keep_blocks:
                acts = f"kept on device ({p.keep_level})"
            elif i >= L - p.keep_blocks - p.swap_blocks:
                acts = f"swapped to {p.swap_tier} ({p.swap_level})"
            else:
                acts = f"{p.activations} boundary, recomputed"
            row = [group, where, state(i < k - 1), acts]
            if rows and rows[-1][2:] == row:
                rows[-1][1] = j
            else:
                rows.append([j, j, *row])
        for first, last, group, where, opt, acts in rows:
            plural = "s" if group == "block" else ""  # "blocks 0-3", "decoder 0-3"
            name = f"{group} {first}" if first == last else f"{group}{plural} {first}-{last}"
            lines.append(f"  {name:<16}{where:<22}{opt:<25}{acts}")
        return lines

    def _streamed_notes(self) -> list[str]:
        """A streamed plan's device cache, chunks, host cache and experts, a line each."""
        p, lines = self.candidate.placement, []
        k = p.device_stages
        if k:
            lines.append(
                f"  optimizer state of {k} stage{'s' * (k > 1)} cached on the device "
                f"(offload.optimizer_device_stages={k}): "
                f"{format_bytes(self.device.get('optimizer', 0))} with their gradients "
                "and new params; updated there, no gradient copy"
            )
        if p.batch_chunks > 1:
            lines.append(
                f"  the recomputed blocks and the head run each micro-batch in "
                f"{p.batch_chunks} chunks of rows (offload.batch_chunks={p.batch_chunks}): "
                "one chunk's working set, params fetched once"
            )
        if self.optimizer_cache:
            lines.append(
                f"  optimizer state cached in host RAM: {format_bytes(self.optimizer_cache)}"
            )
        if self.expert_source and p.expert_fetch == "routed":
            lines.append(
                f"  experts: a streamed block that recomputes copies "
                f"{self.expert_fraction:.0%} of its experts in (offload.expert_fetch="
                f"routed; {self.expert_source})"
            )
        if self.deferred_share is not None and p.expert_fetch == "routed":
            lines.append(
                f"  experts' optimizer state: a step updates {self.deferred_share:.0%} "
                "of it on NVMe, the rest caught up when routed again "
                "(offload.expert_updates=deferred)"
            )
        elif self.expert_source:
            lines.append(
                f"  experts: copied whole (offload.expert_fetch=all): routing would copy "
                f"{self.expert_fraction:.0%} of them ({self.expert_source}), not worth "
                "the forward's wait for each block's routing"
            )
        return lines

    def _prediction_lines(self) -> list[str]:
        """The lanes, the predicted step and what bounds it, the wear and the batch cost."""
        per = " per device" if self.num_devices > 1 else ""
        lines = []
        lanes = ", ".join(f"{k} {v:.3g}" for k, v in self.lanes.items() if v)
        lines += [
            f"  lanes (s/step): {lanes}",
            f"  predicted: {self.step_s:.4g} s/step, {self.tokens_per_s:,.0f} tokens/s, "
            f"{self.tflops / 1e12:.3g} TFLOP/s{per} (bound by {self.bottleneck})",
        ]
        if self.step_clipped_s > self.step_s * 1.005:
            lines.append(
                f"  predicted when clipping binds (the update after backward, not during): "
                f"{self.step_clipped_s:.4g} s/step"
            )
        if self.wear is not None and self.wear.written_per_step:
            lines.append(f"  {self.wear.describe()}")
        lines += [f"  {line}" for line in self.batch_cost.lines()] if self.batch_cost else []
        return lines

    num_layers: int = 0
    groups: tuple[tuple[str, int], ...] = ()  # stage groups' (name, blocks); () one group
    # expert-aware streaming: the share of a routed block's experts a copy moves, and
    # where that share comes from ("": no routed blocks)
    expert_fraction: float = 1.0
    expert_source: str = ""
    # deferred expert updates (optimizer/deferred.py): the expected share of the routed
    # experts whose state a step touches (None: not deferred)
    deferred_share: float | None = None
    # what the config asks for that the plan's parallelism does not support, and what
    # the run does instead (support.fallbacks), one line each
    fallbacks: tuple[str, ...] = ()
    # several devices: the data x model split taken and why (planning/split.py)
    split: str = ""
    tensor_parallel: int = 1  # the devices of a model group (distributed.tensor_parallel)
    allreduce_bytes: float = 0.0  # Megatron's all-reduces a step, per device
    # what the batch costs at this placement and what would reach 90% of the compute
    # bound (planning/batch.py)
    batch_cost: BatchCost | None = None


# -- evaluating one candidate ------------------------------------------------------------
