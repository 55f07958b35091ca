"""SSD wear: what a run's NVMe writes cost the drives' rated endurance.

An offloaded step writes the optimizer state it streams (and spilled gradients, params
with files of their own, activations on NVMe) once: at a given FLOP rate F and T tokens
a step, about 2F/T bytes a second whatever the model size. A drive is rated for a
number of terabytes written (``memory.nvme_tbw``, per drive; pages stripe over the
``memory.nvme_path`` drives, so the writes share them). :class:`Wear` turns bytes a step
and seconds a step into bytes a day, drive-days of life, and the fraction of the drives'
life a run of ``train.steps`` consumes: the planner's projection (``--plan``, from the
cost model's :func:`~hetjax.planning.cost.nvme_writes`) and the run summary's measure
(the steps' ``nvme_write_bytes``). Wear is the drive's count of bytes written; the
write amplification inside the SSD is not known here and not counted.
"""

from __future__ import annotations

import dataclasses

from hetjax.config import Config, format_bytes

TB = 1e12  # drives are rated in decimal terabytes
DAY_S = 86400.0
# The run's output warns about wear (Wear.warning) only when a run of train.steps uses
# more than this fraction of the drives' rated life: a short demo writing tens of MiB a
# step never does, a long run streaming a large model's state may.
WARN_FRACTION = 0.01
# A drive's rated endurance where memory.nvme_tbw is not set, for that warning only: a
# 1 TB consumer NVMe SSD's (600 TBW: Samsung 990 Pro 1 TB, WD SN850X 1 TB datasheets).
ASSUMED_TBW = 600.0


@dataclasses.dataclass(frozen=True)
class Wear:
    """A run's writes against its drives' endurance."""

    written_per_step: float  # bytes, all drives together
    step_s: float
    steps: int  # train.steps
    drives: int = 1
    tbw: float = 0.0  # each drive's rated terabytes written; 0: unknown

    @classmethod
    def of(cls, config: Config, written_per_step: float, step_s: float) -> Wear:
        m = config.memory
        drives = max(1, len(m.nvme_paths))
        return cls(written_per_step, step_s, config.train.steps, drives, m.nvme_tbw)

    @property
    def bytes_per_day(self) -> float:
        return self.written_per_step * DAY_S / self.step_s if self.step_s > 0 else 0.0

    @property
    def run_bytes(self) -> float:
        return self.written_per_step * self.steps

    @property
    def life_fraction(self) -> float | None:
        """The fraction of the drives' rated life the run consumes (None: unknown)."""
        if not self.tbw:
            return None
        return self.run_bytes / (self.tbw * TB * self.drives)

    @property
    def life_days(self) -> float | None:
        """Days of training at this rate until the drives reach their rating."""
        if not self.tbw or not self.bytes_per_day:
            return None
        return self.tbw * TB * self.drives / self.bytes_per_day

    def describe(self) -> str:
        drives = f"{self.drives} drives" if self.drives > 1 else "1 drive"
        line = (
            f"NVMe wear: {format_bytes(self.written_per_step)} written a step, "
            f"{self.bytes_per_day / TB:.3g} TB a day, {self.run_bytes / TB:.3g} TB over "
            f"{self.steps} steps ({drives})"
        )
        if self.tbw:
            line += (
                f"; {self.life_fraction:.3g} of the drives' rated {self.tbw:g} TBW each "
                f"(memory.nvme_tbw), their life at this rate {self.life_days:.3g} days"
            )
        else:
            line += "; set memory.nvme_tbw for the fraction of drive life"
        return line

    def warning(self) -> str:
        """A warning for the run's output when the run uses more than ``WARN_FRACTION``
        of the drives' life (rated, ``memory.nvme_tbw``, else ``ASSUMED_TBW``), or ""."""
        tbw = self.tbw or ASSUMED_TBW
        fraction = self.run_bytes / (tbw * TB * self.drives)
        if fraction <= WARN_FRACTION:
            return ""
        rated = f"rated {tbw:g} TBW" if self.tbw else f"{tbw:g} TBW assumed (memory.nvme_tbw)"
        return (
            f"warning: SSD wear: a run of {self.steps} steps writes {self.run_bytes / TB:.3g} "
            f"TB to NVMe ({format_bytes(self.written_per_step)} a step), {fraction:.2%} of "
            f"the life of {self.drives} drive(s) at {rated} each; more host RAM "
            "(memory.host_budget) writes less (docs/guide/offload.md#files-metrics-and-"
            "start-up-checks)"
        )

    def over_budget(self, budget: float) -> str:
        """Why the run exceeds ``budget`` (a fraction of drive life), or ""."""
        frac = self.life_fraction
        if not budget or frac is None or frac <= budget:
            return ""
        return (
            f"a run of {self.steps} steps writes {self.run_bytes / TB:.3g} TB "
            f"({format_bytes(self.written_per_step)} a step), {frac:.3g} of the life of "
            f"{self.drives} drive(s) rated {self.tbw:g} TBW each, over "
            f"memory.nvme_wear_budget={budget:g} (at most "
            f"{budget * self.tbw * TB * self.drives / self.written_per_step:,.0f} steps)"
        )
