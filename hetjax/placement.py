"""The placement of a streaming run: which tier holds each kind of state, and the knobs
of how it moves (prefetch depth, resident blocks, kept and swapped blocks, chunks of
rows, the device cache of optimizer state, routed experts, the update mode).

One frozen description, three users: the config builds it (:meth:`Placement.from_config`),
the planner searches over it (``planning/search.py``: a candidate is a placement, a plan a
placement plus its prediction) and writes it back as config overrides
(:meth:`Placement.config_overrides`), and the memory model and the streaming runtime
take it (``memory.py``, ``runtime/streaming.py``). A field that is a config key says so
in its metadata, so a new knob is one field here (plus the config key itself).

Deferred expert updates (``offload.expert_updates``) are not part of it: they change
which state a step reads and writes, not where it lives, and the planner predicts
either from the config.

Not ``parallel/single.py``, which maps stages to devices and shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetjax.config import Config, OffloadConfig, OptimizerConfig

_SECTIONS = {"offload": OffloadConfig, "optimizer": OptimizerConfig}  # where its keys are


def _knob(key: str) -> Any:
    """A field read from config key ``key`` (``section.name``), with that key's default."""
    section, name = key.split(".")
    default = {f.name: f.default for f in dataclasses.fields(_SECTIONS[section])}[name]
    return dataclasses.field(default=default, metadata={"key": key})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a streaming run keeps each kind of state, and how it moves it. Defaults are
    the config keys' (``config.OffloadConfig`` says what each means); keyword-only."""

    params: str = _knob("offload.params")  # host | nvme: compute-dtype params
    optimizer: str = _knob("offload.optimizer")  # device | host | nvme: fp32 master + state
    activations: str = _knob("offload.activations")  # device | host | nvme: boundaries
    prefetch_depth: int = _knob("offload.prefetch_depth")  # the device plan may lower it
    # blocks 0 .. r-1 stay on the device across steps: the device plan's choice, not a key
    resident_blocks: int = 0
    keep_blocks: int = _knob("offload.keep_blocks")  # the last blocks keep in-block acts
    keep_level: str = _knob("offload.keep_level")
    swap_blocks: int = _knob("offload.swap_blocks")  # the blocks before them swap theirs
    swap_level: str = _knob("offload.swap_level")
    swap_tier: str = _knob("offload.swap_tier")  # host | nvme
    # the first stages' optimizer state cached on the device
    device_stages: int = _knob("offload.optimizer_device_stages")
    expert_fetch: str = _knob("offload.expert_fetch")  # routed | all
    batch_chunks: int = _knob("offload.batch_chunks")  # chunks of a micro-batch's rows
    # sync | lockfree: how the host optimizer's updates meet the step (lock-free holds
    # the gradient buffers twice); the config's, which the planner does not search
    update_mode: str = _knob("optimizer.mode")
    # copies of the NVMe state and params (1: in place), as ``memory.nvme_copies``
    # resolves for the config (``nvme_copies.py``); not searched
    copies: int = 2

    @classmethod
    def from_config(cls, config: Config) -> Placement:
        """The placement ``config`` asks for (its prefetch depth and resident blocks
        before the device plan fits them)."""
        values = {}
        for f, section, name in _keyed_fields():
            values[f.name] = getattr(getattr(config, section), name)
        # (imported here: storage imports the config, which imports nothing of placement)
        from hetjax.nvme_copies import nvme_copies

        return cls(**values, copies=nvme_copies(config).count)

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        """The config sections that train with this placement in the streaming runtime
        (``Config.replace(**...)``)."""
        out: dict[str, dict[str, Any]] = {"offload": {"mode": "stream"}}
        for f, section, name in _keyed_fields():
            out.setdefault(section, {})[name] = getattr(self, f.name)
        return out

    def recomputed_blocks(self, num_layers: int) -> int:
        """Blocks that store a boundary and recompute their inside in backward: those
        that neither keep nor swap their in-block activations."""
        return num_layers - self.keep_blocks - self.swap_blocks

    @property
    def uses_nvme(self) -> bool:
        swapped = self.swap_tier if self.swap_blocks else "host"
        return "nvme" in (self.params, self.optimizer, self.activations, swapped)


def _keyed_fields() -> list[tuple[dataclasses.Field, str, str]]:
    """Placement's fields that are config keys: (field, section, name)."""
    return [
        (f, *f.metadata["key"].split("."))
        for f in dataclasses.fields(Placement)
        if "key" in f.metadata
    ]
