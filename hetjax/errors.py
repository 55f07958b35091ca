"""What every command does with a mistake the user can fix: one line on stderr and an
exit status, never a traceback.

Each entry point's ``main(argv) -> int`` is wrapped in :func:`entry_point`, the one
place that turns an error into its line and its status:

* 0: done; 1: an error (:class:`UserError`, or an ``OSError``: the line names the path
  and the key or flag it came from); 2: a bad config or command line
  (:class:`~hetjax.config_values.ConfigError`; argparse's own errors exit 2 too);
* 75 (:data:`~hetjax.preemption.PREEMPTED_EXIT_STATUS`): preempted with a complete
  checkpoint (SIGTERM, SIGUSR1 or Ctrl-C; :class:`~hetjax.preemption.Preempted` is a
  :class:`UserError` of that status);
* 130 (128 + SIGINT, the shell's status of a Ctrl-C): interrupted outside training, or
  by a second Ctrl-C during training (which ends the process at once, by the signal).

Any other exception is a bug in hetjax and keeps its traceback.

The ``--out``/``--workdir`` checks (:func:`check_output_dir`, :func:`check_output_file`)
run before a command does any work, so a bad path stops it at once and nothing is
replaced without ``--overwrite``.

This module imports nothing else from hetjax, so every layer can raise
:class:`UserError`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT: what a shell reports for Ctrl-C


class UserError(Exception):
    """A mistake the user can fix (a bad input, a refused overwrite, a path that cannot
    be written); the message is the one line a command prints, naming the problem and
    the fix. ``status`` is the exit status."""

    status = 1
    label = "error"  # the line is "<prog>: <label>: <message>" ("<prog>: <message>" if empty)

    def line(self) -> str:
        return f"{self.label}: {self}" if self.label else str(self)


# path -> the key or flag it came from, for an OSError's line (note_path)
_PATH_KEYS: dict[str, str] = {}


def note_path(key: str, path: str | Path | None) -> None:
    """Remembers that ``path`` came from ``key`` (``--out``, ``data.path``): an
    ``OSError`` on it, or on a file under it, is reported with the key."""
    if path:
        _PATH_KEYS[os.path.abspath(os.fspath(path))] = key


def note_argv(argv: Iterable[str]) -> None:
    """Notes every ``--flag VALUE...``, ``--flag=VALUE`` and ``--config.key=VALUE`` of a
    command line as a path that may come back in an ``OSError``."""
    flag = None
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            flag = None if eq else name
            if eq:
                note_path(name.removeprefix("--config."), value)
        elif flag is not None:  # a flag's value (nargs="+": each of them)
            note_path(flag.removeprefix("--config."), arg)


def key_of(path: str | Path) -> str | None:
    """The key or flag ``path`` (or a directory above it) came from, if noted."""
    p = Path(os.path.abspath(os.fspath(path)))
    for candidate in (p, *p.parents):
        key = _PATH_KEYS.get(str(candidate))
        if key is not None:
            return key
    return None


def os_error_line(e: OSError) -> str:
    """``Permission denied: /data/t.bin (data.path)``: the reason, the path and the key
    it came from."""
    reason = e.strerror or str(e)
    if e.filename is None:
        return reason
    key = key_of(e.filename)
    return f"{reason}: {e.filename}" + (f" ({key})" if key else "")


def entry_point(prog: str) -> Callable:
    """Wraps a command's ``main(argv) -> int``: its user errors become one line on
    stderr, prefixed ``prog:``, and the exit status above."""

    def wrap(run: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
        @functools.wraps(run)
        def main(argv: list[str] | None = None) -> int:
            note_argv(sys.argv[1:] if argv is None else argv)
            try:
                return run(argv)
            except UserError as e:
                return _say(prog, e.line(), e.status)
            except OSError as e:
                return _say(prog, f"error: {os_error_line(e)}", 1)
            except KeyboardInterrupt:
                return _say(prog, "interrupted (Ctrl-C)", INTERRUPTED_EXIT_STATUS)

        return main

    return wrap


def _say(prog: str, line: str, status: int) -> int:
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return status


# -- output paths, checked before any work ------------------------------------------------


def _blocking_file(path: Path) -> Path | None:
    """The existing non-directory at or above ``path`` that stops making it a directory."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def check_output_dir(path: str | Path, key: str, exists_ok: bool = True) -> Path:
    """Raises :class:`UserError` unless ``path`` (given as ``key``) can be a directory
    this command writes: not a file, not under one, and writable. ``exists_ok`` False:
    refuses a directory that exists and is not empty (``--overwrite`` to replace)."""
    path = Path(path)
    note_path(key, path)
    if _blocking_file(path) == path:
        raise UserError(f"{key} {path} is a file, not a directory: give a directory")
    _check_makeable(path, path, key)
    if not exists_ok and path.is_dir() and any(path.iterdir()):
        raise UserError(
            f"{key} {path} exists and is not empty: refusing to write over it. Pass "
            "--overwrite to replace what this command writes there, or choose another path"
        )
    return path


def check_output_file(path: str | Path, key: str, overwrite: bool) -> Path:
    """Raises :class:`UserError` unless ``path`` (given as ``key``) can be written as a
    file: its directory can be made, it is not a directory, and it does not exist
    unless ``overwrite``."""
    path = Path(path)
    note_path(key, path)
    if path.is_dir():
        raise UserError(f"{key} {path} is a directory: give a file name")
    _check_makeable(path.parent, path, key)
    if path.exists() and not overwrite:
        raise UserError(
            f"{key} {path} exists: refusing to replace it. Pass --overwrite to replace it, "
            "or choose another path"
        )
    return path


def _check_makeable(directory: Path, path: Path, key: str) -> None:
    """``directory`` (``path``'s, given as ``key``) exists or can be made: no file at
    or above it, and the nearest existing directory writable."""
    blocking = _blocking_file(directory)
    if blocking is not None:
        raise UserError(
            f"{key} {path}: {blocking} is a file, so nothing can be made under it: give "
            "another path"
        )
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{key} {path}: {existing} is not writable: give another path")
