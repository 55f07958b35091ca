"""What a batch costs at a planned placement: the tokens per step at which each lane's
traffic (params over the host link, state over the disk, the host optimizer's update,
...) is hidden behind the compute, the share of the compute bound the configured batch
gets, and the smallest batch (or gradient accumulation) that reaches ``TARGET`` of it
within the memory budgets.

Nothing here prices anything: every time is the cost model's (``cost.lanes``, through
the callables :func:`batch_cost` takes), at the planned workload resized to other
micro-batches (:func:`resized`). A lane's time at a placement is affine in a
micro-batch's rows (fixed bytes per micro-batch or step, plus the boundaries' and
compute's that grow with the rows) and in the number of micro-batches, so two
evaluations give where it meets the compute: bytes / bandwidth = seconds per token x
tokens."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hetjax.planning.workload import Workload

TARGET = 0.9  # of the compute bound the suggested batch reaches
MAX_ACCUM = 64  # the most micro-batches a step the suggestion considers

LANE_WORDS = {
    "host->device": "the host->device link (params, activations)",
    "device->host": "the device->host link (gradients, activations)",
    "nvme": "the disk (NVMe)",
    "optimizer": "the optimizer's update",
    "collectives": "the collectives",
    "compute": "compute",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchCost:
    """What the configured batch gets at a placement, and what would reach ``TARGET``."""

    batch_size: int  # rows a step (train.batch_size), as configured
    grad_accum: int
    tokens_per_step: int
    # lane -> tokens a step at which its time equals the compute's, the micro-batch grown
    # (inf: never; 0: at any batch)
    hidden_at: dict[str, float]
    # lanes a larger grad_accum does not hide (each micro-batch moves them again)
    per_micro_batch: tuple[str, ...]
    compute_fraction: float  # the compute lane / the predicted step
    bound: str  # the lane that bounds the step
    most_rows: int  # the largest micro-batch (rows) within the memory budgets
    # the smallest (batch_size, grad_accum, fraction) reaching TARGET; None: none does
    suggested: tuple[int, int, float] | None
    host_optimizer: bool = True  # the optimizer lane is the host's

    def word(self, lane: str) -> str:
        if lane == "optimizer" and self.host_optimizer:
            return "the host optimizer"
        return LANE_WORDS.get(lane, lane)

    def lines(self) -> list[str]:
        """The batch's cost in words, one line each (the plan's and the summary's)."""
        seq = self.tokens_per_step // self.batch_size
        hidden = []
        for lane, tokens in self.hidden_at.items():
            if math.isinf(tokens):
                at = "never (it grows with the micro-batch as fast as the compute)"
            else:
                at = f"{math.ceil(tokens):,}" if tokens else "any batch"
            again = " (not by grad_accum: each micro-batch moves it)" * (
                lane in self.per_micro_batch and not math.isinf(tokens)
            )
            hidden.append(f"{self.word(lane)} {at}{again}")
        out = [
            f"batch cost: batch {self.batch_size} x seq {seq} = {self.tokens_per_step:,} "
            f"tokens/step gets {self.compute_fraction:.0%} of the compute bound; the step is "
            f"bound by {self.word(self.bound)}"
        ]
        if hidden:
            out.append(
                "  hidden behind compute from (tokens/step, the micro-batch grown): "
                + "; ".join(hidden)
            )
        if self.suggested is None:
            out.append(
                f"  no batch reaches {TARGET:.0%} of it within the memory budgets "
                f"(micro-batches of at most {self.most_rows} rows, grad_accum up to {MAX_ACCUM})"
            )
        else:
            batch, accum, fraction = self.suggested
            out.append(
                f"  {TARGET:.0%} of it from train.batch_size={batch} train.grad_accum={accum} "
                f"({batch * seq:,} tokens/step, {fraction:.0%}; micro-batches of "
                f"{batch // accum} rows, at most {self.most_rows} fit the memory budgets)"
            )
        return out


def resized(w: Workload, factor: float, micro_batches: int) -> Workload:
    """``w`` with each micro-batch ``factor`` times its rows and ``micro_batches`` of them
    a step: FLOPs, stage times and activations (boundaries, kept and swapped residuals,
    working sets, contexts, exchanges) scale with the rows. The working set's param
    temporaries scale too, so a larger micro-batch's is over-counted: the memory check
    errs on the side of fitting the real run."""
    f = factor
    grow = lambda n: int(round(n * f))
    grown = lambda d: {k: grow(v) for k, v in d.items()}
    per_step = f * micro_batches / w.micro_batches
    return dataclasses.replace(
        w,
        micro_batches=micro_batches,
        tokens_per_step=int(round(w.tokens_per_step * per_step)),
        flops_per_step=w.flops_per_step * per_step,
        boundary=grow(w.boundary),
        working_set=grow(w.working_set),
        chunked_working_sets=grown(w.chunked_working_sets),
        kept=grown(w.kept),
        held_kept=grown(w.held_kept),
        held_swapped=grown(w.held_swapped),
        recompute_flops={k: v * f for k, v in w.recompute_flops.items()},
        block_fwd_flops=w.block_fwd_flops * f,
        head_fwd_flops=w.head_fwd_flops * f,
        attention_bwd_flops=w.attention_bwd_flops * f,
        measured={k: v * f for k, v in w.measured.items()} if w.measured else w.measured,
        context=grow(w.context),
        exchange_bytes=grow(w.exchange_bytes),
    )


def _meets(lane: tuple[float, float], compute: float) -> float:
    """Where ``a + b x`` (a lane's time, ``lane = (a, b)``) meets ``compute * x``: the x
    from which the lane is no longer (inf: never; 0: at any x)."""
    a, b = lane
    if abs(compute - b) <= 1e-12 * compute:  # as fast as the compute: hidden, or never
        return 0.0 if a <= 0 else math.inf
    if compute < b:  # faster: never at large x
        return math.inf
    return max(0.0, a / (compute - b))


def _affine(timed: Callable[[Workload], dict[str, float]], at: Callable[[int], Workload]):
    """Each lane's ``(intercept, slope)`` along ``at(1)``, ``at(2)``, and the compute's slope."""
    one, two = timed(at(1)), timed(at(2))
    lanes = {k: (2 * one[k] - two[k], two[k] - one[k]) for k in one if k != "compute" and one[k]}
    return lanes, one["compute"]


def batch_cost(
    w: Workload,
    timed: Callable[[Workload], dict[str, float]],
    planned: Callable[[Workload], tuple[float, dict[str, float]] | None],
    *,
    rows: int,
    unit: int,
    step_s: float,
    host_optimizer: bool = True,
) -> BatchCost:
    """The cost of ``w``'s batch (``rows`` rows a micro-batch, ``w.micro_batches`` of
    them) at a placement: ``timed(v)`` its lanes' seconds for workload ``v`` (the
    placement fixed, memory not checked), ``planned(v)`` its predicted step and lanes
    where ``v`` fits the budgets (None where not), ``step_s`` the planned step. The
    suggestion's micro-batches are multiples of ``unit`` rows (a device's rows over the
    devices, in whole chunks); the smallest batch reaching ``TARGET`` wins, then the
    fewest micro-batches."""
    A = w.micro_batches
    lanes, compute = _affine(timed, lambda k: resized(w, k, A))
    hidden = {k: _meets(lane, compute) * w.tokens_per_step for k, lane in lanes.items()}
    by_accum, _ = _affine(timed, lambda k: resized(w, 1.0, k * A))
    again = tuple(k for k, lane in by_accum.items() if math.isinf(_meets(lane, compute)))
    now = timed(w)
    busiest = max(now, key=now.get)
    most = _most_rows(w, planned, rows, unit)

    def reaches(micro_rows: int, accum: int) -> float | None:
        found = planned(resized(w, micro_rows / rows, accum))
        if found is None:
            return None
        step, by_lane = found
        return by_lane["compute"] / step

    best = None  # (batch, accum, fraction)
    for accum in range(1, MAX_ACCUM + 1):
        if best is not None and accum * unit >= best[0]:
            break  # no smaller batch at more micro-batches
        top = reaches(most, accum) if most else None
        if top is None or top < TARGET:
            continue
        lo, hi = 0, most // unit  # in units: lo does not reach (0: none), hi does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = reaches(mid * unit, accum)
            lo, hi = (lo, mid) if got is not None and got >= TARGET else (mid, hi)
        batch = hi * unit * accum
        if best is None or batch < best[0]:
            best = (batch, accum, reaches(hi * unit, accum))
    return BatchCost(
        batch_size=rows * A,
        grad_accum=A,
        tokens_per_step=w.tokens_per_step,
        hidden_at=hidden,
        per_micro_batch=again,
        compute_fraction=compute / step_s,
        bound=busiest,
        most_rows=most,
        suggested=best,
        host_optimizer=host_optimizer,
    )


def _most_rows(w: Workload, planned, rows: int, unit: int, limit: int = 1 << 20) -> int:
    """The largest micro-batch (a multiple of ``unit`` rows) within the memory budgets,
    0 where none fits; at most ``limit`` units."""
    fits = lambda units: planned(resized(w, units * unit / rows, w.micro_batches)) is not None
    lo = max(1, rows // unit)
    if not fits(lo):
        lo = 1 if lo > 1 and fits(1) else 0
        if not lo:
            return 0
    hi = lo * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit
