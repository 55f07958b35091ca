"""How many copies of the NVMe state and params a run keeps (``memory.nvme_copies``).

Two copies (``states.py``, ``params.py``): the committed one, which a step reads,
and the one its updates write; the commit flips them. The second copy exists for two
reasons, and only those:

* **a written update may have to be dropped**: a speculative update (made as the
  gradient arrives, before the global norm is known) is thrown away when clipping
  binds (and redone with the clip factor), when an fp16 step overflows, or when a
  step's loss or gradient is not finite and training goes on (``train.on_nonfinite=
  skip``); in lock-free mode the forward reads a stage while the loop rewrites it, and
  a stage read must be one version;
* **a crash must leave a state to resume from**: that is the checkpoint's, not the
  tier's: a run always resumes from its newest checkpoint and recreates the tier.
  A checkpoint hard-links the tier's committed page files, and every write of a page
  goes to a new file renamed over the old one (``nvme.DirectIO``, TensorStore's own
  writes), so a linked file never changes: in place or not, the next steps cannot
  touch a checkpoint's pages. A checkpoint that copies instead (another filesystem,
  ``checkpoint.link_nvme`` false) freezes the stage's pages until copied, and the step's
  write of them waits for that (``states.Frozen``).

So one copy, written in place, is exact wherever no written update can be
dropped: every update waits for the global norm (``optimizer.speculation=never``), or
nothing can drop one (no clipping, no fp16 loss scaling, and a non-finite step stops
the run or rolls back to a checkpoint, which replaces the whole state). Should a
dropped step still tear the state in place (rollback's), the store refuses to read or
checkpoint it until a restore rewrote every stage.

What it saves: one copy of the state and of the params on disk (the files a run
keeps). The bytes a step writes are the same either way (each updated page once),
except that a redo (a clipping step that had speculated: every stage read and written
again) cannot happen.
"""

from __future__ import annotations

import dataclasses

from hetjax.config import Config, ConfigError, format_bytes


@dataclasses.dataclass(frozen=True)
class NvmeCopies:
    """The NVMe tier's copies (1 or 2) and why, as the plan says it."""

    count: int
    why: str

    def describe(self, copy_bytes: int = 0) -> str:
        """The plan's line; ``copy_bytes``: one copy of the state and params on NVMe."""
        how = "written in place" if self.count == 1 else "committed + being written"
        line = f"NVMe copies: {self.count} ({how}): {self.why}"
        if copy_bytes and self.count == 1:
            line += (
                f"; saves {format_bytes(copy_bytes)} of files (a second copy); a step "
                "writes the same bytes, and no clipping redo rereads and rewrites the state"
            )
        elif copy_bytes:
            line += f"; the second copy takes {format_bytes(copy_bytes)} of disk"
        return line


def droppers(config: Config) -> list[str]:
    """What in ``config`` may drop an update after it was written (empty: none can)."""
    o, t = config.optimizer, config.train
    if o.mode == "lockfree":
        return ["optimizer.mode=lockfree: the forward reads a stage while the loop rewrites it"]
    if o.speculation == "never":
        return []  # every update waits for the global norm and the step's finiteness
    out = []
    if o.grad_clip > 0:
        out.append(
            f"optimizer.grad_clip={o.grad_clip} with optimizer.speculation={o.speculation}: "
            "a step whose clipping binds redoes its speculative updates"
        )
    if config.model.compute_dtype == "float16":
        out.append("model.compute_dtype=float16: a step that overflows drops its updates")
    if t.on_nonfinite == "skip":
        out.append(
            "train.on_nonfinite=skip: a non-finite step drops its updates and training goes on"
        )
    return out


def nvme_copies(config: Config) -> NvmeCopies:
    """The copies ``config`` gets (``memory.nvme_copies``: 0 chooses 1 where
    :func:`droppers` is empty). Raises ``ConfigError`` for 1 where an update may be
    dropped, naming what drops it."""
    asked = config.memory.nvme_copies
    drop = droppers(config)
    if asked == 2:
        return NvmeCopies(2, "memory.nvme_copies=2")
    if asked == 1 and drop:
        raise ConfigError(
            "config key 'memory.nvme_copies' is 1 (state written in place), but a "
            f"written update may have to be dropped: {'; '.join(drop)}. Set "
            "optimizer.speculation=never (every update waits for the global norm) or "
            "memory.nvme_copies=0"
        )
    if drop:
        return NvmeCopies(2, f"auto: {drop[0]}")
    if config.optimizer.speculation == "never":
        why = "optimizer.speculation=never: every update waits for the global norm"
    else:
        why = (
            "no clipping, no fp16 loss scaling, and a non-finite step stops or rolls back "
            f"(train.on_nonfinite={config.train.on_nonfinite})"
        )
    return NvmeCopies(1, ("" if asked else "auto: ") + why)
