"""Checkpoints of the complete training state, and resume.

**What is saved.** Everything a run needs to go on exactly as if it had not stopped:
the step, the fp32 master params and the optimizer state wherever they live (device,
host RAM or NVMe), the optax scalars (step counts), the data position, the fp16 loss
scale and the config. The training RNG is ``train.seed`` (no dropout), so the data
position and the step fix it. Lock-free mode applies its outstanding gradients before a
snapshot, so its buffers are empty in every checkpoint.

**Format: placement-free** (``checkpoint_state.py``). Each process stores the pages of
every stage it holds, with an index mapping them to the stage's *canonical slab* (its
leaves back to back, named in the meta): nothing depends on page size, memory tier,
device or process count, so a checkpoint saved by the streaming runtime with its state
on NVMe over 2 processes restores into the in-memory runtime on one device and the
reverse; each process reads only the range it owns.

**Two phases** (CheckFreq's snapshot/persist), **no copy in RAM**: ``save`` hard-links
the NVMe tier's committed page files into the checkpoint (the training step waits for
that only); orbax's background threads write the rest stage by stage from the buffers it
lives in (frozen until written) while training goes on. orbax writes into a temporary
directory and renames it when complete, so a checkpoint counts only once it is whole: a
crash during a save leaves the earlier ones intact and the partial one is ignored (and
removed by the next run). Old checkpoints are deleted only after a newer one is
complete.

Layout on disk (``checkpoint.dir``, default ``<workdir>/checkpoints``)::

    checkpoints/<step>/state/proc<p>/   the pages of process p, index.json (pages
                                        striped over drives: links to each drive's
                                        directory of the save, checkpoint_drives.py)
    checkpoints/<step>/meta/            JSON: step, data position, loss scale, kinds,
                                        each stage's leaves, optax scalars, config

**Integrity.** Raw chunks carry no checksum, so a damaged file can read as wrong
numbers without an error; the CRC-32 of each page, taken as it is saved and compared at
restore, turns that into :class:`~hetjax.types.CheckpointDamaged` naming the page and
its file (the training loop then falls back to the checkpoint before). NVMe pages are
taken only if they match the tier's live sums (``storage/checksums.py``). A hard-linked
checkpoint's NVMe pages are the live files themselves, the same blocks on disk: not a
second copy. ``copy_every`` makes every K-th save a real one.

Params for inference: ``python -m hetjax.checkpoint --workdir runs/x --export out/``
writes the newest checkpoint's params as a plain orbax PyTree (the model's ``params``
tree, ``blocks`` stacked on a layer axis), loadable with ``orbax.checkpoint`` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetjax.checkpoint_drives import DriveLinks, DriveRetention
from hetjax.checkpoint_state import (
    SaveReport,
    StateSource,
    StoredState,
    StreamedStateHandler,
    StreamedStateRestore,
    StreamedStateSave,
    layout_meta,
    scalars_meta,
)
from hetjax.config import Config, ConfigError, format_bytes
from hetjax.errors import check_output_dir, entry_point
from hetjax.types import CheckpointError, RuntimeState

FORMAT_VERSION = 2


# -- on disk -----------------------------------------------------------------------------


def checkpoint_dir(config: Config, workdir: str | Path) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(workdir) / "checkpoints"


class Checkpointer:
    """orbax ``CheckpointManager`` over ``directory``: async two-phase saves, the last
    ``keep`` complete checkpoints kept, clear errors on unwritable or full disks.
    ``writing=False`` (listing, export) skips the write probe, so the checkpoints of a
    full disk still list and restore. ``link_nvme``: hard-link NVMe-resident state
    (``checkpoint.link_nvme``); ``copy_every``: but copy it in every ``copy_every``-th
    save (the first, the ``copy_every + 1``-th, ...; ``checkpoint.copy_every``)."""

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        async_save: bool = True,
        writing: bool = True,
        link_nvme: bool = True,
        copy_every: int = 0,
    ):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if writing:
                # one name per process: the processes of a run share the directory
                probe = self.directory / f".hetjax-write-test-{socket.gethostname()}-{os.getpid()}"
                probe.write_bytes(b"ok")
                probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"checkpoint directory {self.directory} is not writable ({e.strerror}); "
                "set checkpoint.dir to a writable directory"
            ) from e
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            # Partial saves of a crashed run, removed by the writer alone: a reader's
            # manager cleaning in its background thread races the writer's own cleanup.
            cleanup_tmp_directories=writing,
            # Directories made in the step, not by a background thread: when making them
            # fails (a full disk) orbax's other threads would wait 300 s for them, holding
            # up the process's exit after the error.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self._handler = StreamedStateHandler(link=link_nvme)
        self.link_nvme, self.copy_every = link_nvme, copy_every
        self.saves = 0  # saves started by this Checkpointer
        self.completed: list[str] = []  # a line per save found complete, for the log
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", StreamedStateSave, self._handler)
        registry.add("state", StreamedStateRestore, self._handler)
        registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        self._last_bytes = 0
        self.drives = DriveRetention(self.directory)  # pages linked on their drives

    # -- queries ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def missing_parts(self, step: int) -> str | None:
        """What of checkpoint ``step``, listed complete by orbax, is gone or unreadable
        (its metadata, its state), or None. A cheap look at the files, for listings:
        the pages are checked as they are restored."""
        where = self.directory / str(step)
        try:
            meta = json.loads((where / "meta" / "metadata").read_text())
        except FileNotFoundError:
            return "its metadata (meta/metadata) is missing"
        except (OSError, ValueError) as e:
            return f"its metadata (meta/metadata) cannot be read ({_os_reason(e)})"
        if not isinstance(meta, dict) or meta.get("step") != step:
            return "its metadata (meta/metadata) is not this checkpoint's"
        if not any((where / "state").glob("proc*")):
            return "its state (state/proc*) is missing"
        return None

    # -- save ---------------------------------------------------------------------------

    def save(self, step: int, state: RuntimeState | StateSource, meta: dict[str, Any]) -> None:
        """Phase one: checks the disk, hard-links the NVMe-resident state and hands the
        rest to orbax's background threads, which write it stage by stage from where it
        lives (``checkpoint_state.py``). Raises CheckpointError if the previous save
        failed or the disk cannot hold this one."""
        ocp = self._ocp
        source = state if isinstance(state, StateSource) else StateSource.from_state(state)
        try:
            self.wait()  # one save in flight at a time; surfaces a failed one
            self._check_space(step, source)
            self.drives.note(source)
            self.drives.collect(self.steps())  # (a crashed save's, found once its drives are)
        except BaseException:
            source.release_all()
            raise
        self.saves += 1
        copy = self.copy_every and (self.saves - 1) % self.copy_every == 0
        self._handler.link = self.link_nvme and not copy
        meta = {
            **meta,
            "format": FORMAT_VERSION,
            "kinds": source.kinds,
            "layouts": layout_meta(source.layouts),
            "scalars": scalars_meta(source.scalars),
            "loss_scale": list(source.loss_scale) if source.loss_scale else None,
        }
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=StreamedStateSave(source, DriveLinks(self.directory, step)),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 - any failure of the writer
            source.release_all()
            raise self._write_error(step, e) from e
        self._pending = step

    def _check_space(self, step: int, source: StateSource) -> None:
        """Every process's bytes (equal shares), hard-linked ones included: those stay
        on the disk once the NVMe tier writes newer copies."""
        per_page = source.state_format.nbytes(source.page_elems)
        need = source.num_pages * per_page * jax.process_count() + (64 << 10)
        free = shutil.disk_usage(self.directory).free
        if need > free:
            raise CheckpointError(
                f"not enough space for the checkpoint of step {step} in {self.directory}: "
                f"needs about {format_bytes(need)}, {format_bytes(free)} free (short by "
                f"{format_bytes(need - free)}). Free space, lower checkpoint.keep or point "
                f"checkpoint.dir elsewhere; the checkpoints already there are intact"
            )

    @property
    def report(self) -> SaveReport:
        """What the last save did (bytes linked and written, seconds)."""
        return self._handler.report

    def wait(self) -> None:
        """Waits for the background write; raises CheckpointError if it failed."""
        step = getattr(self, "_pending", None)
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._pending = None
            self._failed = True
            raise self._write_error(step, e) from e
        self._pending = None
        if step is not None:
            self.completed.append(self.report.describe(step))
            self.drives.collect(self.steps())  # those of checkpoints keep retired

    def close_manager(self, quiet: bool = False) -> None:
        """Closes orbax's manager at the end of a run. A background write that failed
        raises :class:`CheckpointError`, unless ``wait`` reported the failure already
        or ``quiet`` (another error is on its way out: it must not be masked)."""
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001
            if quiet or getattr(self, "_failed", False):
                return
            raise self._write_error(getattr(self, "_pending", None), e) from e

    def _write_error(self, step, e: BaseException) -> CheckpointError:
        cause: BaseException | None = e
        while cause is not None:  # the writer's own refusal (non-finite state) as it is
            if isinstance(cause, CheckpointError):
                return CheckpointError(str(cause))
            cause = cause.__cause__ or cause.__context__
        return CheckpointError(
            f"writing the checkpoint of step {step} to {self.directory} failed "
            f"({_os_reason(e)}); the checkpoints already complete there are intact. Free "
            "space or point checkpoint.dir at a writable disk, then restart: the run resumes "
            "from the newest complete checkpoint"
        )

    # -- restore ------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> tuple[StoredState, dict[str, Any]]:
        """The state (read on demand, :class:`StoredState`) and metadata of checkpoint
        ``step`` (default: the newest)."""
        ocp = self._ocp
        step = self.latest() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        where = self.directory / str(step)
        try:
            meta = dict(
                self.manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                ).meta
            )
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {str(e)[:300]}"
            raise CheckpointError(
                f"checkpoint {where} cannot be read ({why}). " + self._discard_hint(step)
            ) from e
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {where} has format {meta.get('format')}, this hetjax reads "
                f"format {FORMAT_VERSION}: resume it with the hetjax version that wrote it, "
                "or start over with a new --workdir"
            )
        try:
            state = StoredState(where / "state", meta, self._discard_hint(step))
        except CheckpointError as e:
            raise type(e)(f"{e}. {self._discard_hint(step)}") from e
        return state, meta

    def _discard_hint(self, step: int) -> str:
        older = [s for s in self.steps() if s < step]
        where = f"the newest older one (step {older[-1]})" if older else "the start"
        return (
            f"Delete {self.directory / str(step)} to resume from {where}, or start over "
            "with a new --workdir"
        )

    def delete_all(self) -> None:
        self.wait()
        for step in self.steps():
            self.manager.delete(step)
        self.drives.collect([])

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def _os_reason(e: BaseException) -> str:
    """The operating system's reason for a failed write, e.g. ``No space left on
    device``: an OSError's in the exception chain, or the ``os_error_code`` TensorStore
    puts in its messages (it raises ValueError); else the exception, shortened."""
    cause: BaseException | None = e
    seen = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        code = re.search(r"os_error_code='?(\d+)", str(cause))
        if code:
            return os.strerror(int(code.group(1)))
        cause = cause.__cause__ or cause.__context__
    text = repr(e)
    return text if len(text) <= 300 else text[:300] + "..."


def check_compatible(meta: dict[str, Any], config: Config, where: Path) -> None:
    """A checkpoint restores into any placement, but not into another model or
    optimizer: those keys must match (the error names each one that differs)."""
    saved = meta.get("config", {})
    now = config.to_dict()
    diffs = []
    free = {"remat", "compute_dtype", "init_from", "init_std"}  # not part of the state
    for key, value in saved.get("model", {}).items():
        if key not in free and now["model"].get(key) != value:
            diffs.append(f"model.{key}: checkpoint {value!r}, this run {now['model'].get(key)!r}")
    opt_saved, opt_now = saved.get("optimizer", {}), now["optimizer"]
    if opt_saved.get("name") != opt_now["name"]:
        diffs.append(
            f"optimizer.name: checkpoint {opt_saved.get('name')!r}, this run {opt_now['name']!r}"
        )
    elif opt_now["name"] == "sgd" and bool(opt_saved.get("momentum")) != bool(opt_now["momentum"]):
        diffs.append(  # the momentum trace is state only with momentum > 0
            f"optimizer.momentum: checkpoint {opt_saved.get('momentum')!r}, this run "
            f"{opt_now['momentum']!r} (state kinds {meta.get('kinds')})"
        )
    if diffs:
        raise ConfigError(
            f"the checkpoint in {where} was saved by a different model or optimizer: "
            + "; ".join(diffs)
            + ". Use a new --workdir (or checkpoint.resume=never with checkpoint.overwrite=true "
            "to discard it)"
        )


def restore_newest(config: Config, workdir: str | Path, step: int | None = None):
    """(the newest complete checkpoint's state (or ``step``'s), its meta) of a run's
    workdir, checked against ``config``. Raises ``CheckpointError`` when none."""
    directory = checkpoint_dir(config, workdir)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory {directory}")
    ckpt = Checkpointer(directory, writing=False)
    try:
        if step is None and ckpt.latest() is None:
            raise CheckpointError(f"{directory} holds no complete checkpoint")
        state, meta = ckpt.restore(step)
    finally:
        ckpt.close()
    check_compatible(meta, config, directory)
    return state, meta


# -- export ------------------------------------------------------------------------------


def export_params(params: Any, out: str | Path) -> Path:
    """Writes a params pytree as a plain orbax PyTree checkpoint at ``out``."""
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    if out.exists():
        raise CheckpointError(f"export target {out} exists; remove it or choose another path")
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(out, jax.tree.map(np.asarray, params))
    return out


def load_params(path: str | Path) -> Any:
    """Reads params written by :func:`export_params` (numpy arrays)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        return jax.tree.map(np.asarray, ckptr.restore(Path(path).absolute()))


@entry_point("hetjax")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.checkpoint",
        description="List a run's checkpoints, or export a checkpoint's params for inference.",
    )
    parser.add_argument("--workdir", required=True, help="the run's workdir")
    parser.add_argument(
        "--dir", default="", help="checkpoint directory (default <workdir>/checkpoints)"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    parser.add_argument("--export", default=None, help="write the params here (orbax PyTree)")
    args = parser.parse_args(argv)
    directory = Path(args.dir) if args.dir else Path(args.workdir) / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory {directory}")
    if args.export is not None:  # before reading anything
        if Path(args.export).exists():
            raise CheckpointError(
                f"--export {args.export} exists: refusing to replace it; remove it or choose "
                "another path"
            )
        check_output_dir(args.export, "--export")  # not under a file, writable
    ckpt = Checkpointer(directory, writing=False)
    try:
        if args.export is None:
            _list(ckpt, directory)
            return 0
        state, meta = ckpt.restore(args.step)
        out = export_params(state.params(), args.export)
    finally:
        ckpt.close()
    n = sum(a.size for a in jax.tree.leaves(state.params()))
    print(f"exported the params of step {meta['step']} ({n:,} values) to {out}")
    print(json.dumps({"step": meta["step"], "path": str(out)}))
    return 0


def _list(ckpt: Checkpointer, directory: Path) -> None:
    """Prints the complete checkpoints in ``directory``, and each one orbax lists whose
    files are not all there, with what is missing."""
    steps = ckpt.steps()
    missing = {s: why for s in steps if (why := ckpt.missing_parts(s)) is not None}
    complete = [s for s in steps if s not in missing]
    print(f"{directory}: complete checkpoints at steps {complete or 'none'}")
    for step, why in missing.items():
        newest = " (the newest: a run resuming stops on it)" if step == steps[-1] else ""
        print(f"{directory / str(step)}: not complete, {why}{newest}; delete it")


if __name__ == "__main__":
    sys.exit(main())
