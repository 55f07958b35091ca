"""``python -m hetjax.launch`` process set-up: glibc allocator settings, command-line
overrides, the default workdir."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from hetjax import launch
from hetjax.allocator import MALLOC_ENV, tune_host_allocator

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def glibc():
    """The allocator settings are glibc's: elsewhere the test is skipped, or failed
    under CI=true (conftest.require)."""
    require(platform.libc_ver()[0] == "glibc", "glibc (the allocator tuned is glibc's malloc)")


def _tune(**env) -> tuple[dict, dict]:
    """tune_malloc in a fresh interpreter (it changes the process's allocator): what
    it applied and the variables it leaves for child processes."""
    code = (
        "import json, os; from hetjax.allocator import MALLOC_ENV, tune_malloc; "
        "print(json.dumps([tune_malloc(), {k: os.environ.get(k) for k in MALLOC_ENV}]))"
    )
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "HETJAX_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    applied, exported = json.loads(out.stdout)
    return applied, exported


@pytest.mark.usefixtures("glibc")
def test_tune_malloc_applies_the_bench_settings_and_user_variables_win():
    applied, exported = _tune()
    assert applied == exported == MALLOC_ENV
    applied, exported = _tune(MALLOC_ARENA_MAX="4")
    assert "MALLOC_ARENA_MAX" not in applied and exported["MALLOC_ARENA_MAX"] == "4"
    assert exported["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    applied, exported = _tune(HETJAX_MALLOC="0")
    assert applied == {} and set(exported.values()) == {None}


def _launch_exports(*args: str, **env: str) -> tuple[int, dict, str]:
    """``python -m hetjax.launch ARGS --print-config`` as from the command line, in a
    fresh interpreter (it changes the process's allocator): its exit code, the allocator
    variables it leaves for child processes, and its stderr."""
    code = (
        "import json, os, sys; from hetjax import launch; from hetjax.allocator import "
        f"MALLOC_ENV; sys.argv = ['hetjax', *{list(args)!r}, '--print-config']; "
        "rc = launch.main(); print(json.dumps([rc, {k: os.environ.get(k) for k in MALLOC_ENV}]))"
    )
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "HETJAX_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    rc, exported = json.loads(out.stdout.splitlines()[-1])
    return rc, exported, out.stderr


@pytest.mark.usefixtures("glibc")
def test_launcher_bounds_the_allocator_when_asked():
    """HETJAX_MALLOC=1 makes the launcher apply MALLOC_ENV, which child processes
    inherit, and say so; without it, host budget or not, it leaves the allocator to the
    runtime (tune_host_allocator)."""
    rc, exported, err = _launch_exports(HETJAX_MALLOC="1")
    assert rc == 0 and exported == MALLOC_ENV, err
    assert "glibc's allocator returns freed buffers to the OS" in err
    for args in (["--config", "gpt_small"], ["--config.memory.host_budget=8GiB"]):
        rc, exported, err = _launch_exports(*args)
        assert rc == 0 and set(exported.values()) == {None} and "allocator" not in err, args


@pytest.mark.usefixtures("glibc")
def test_training_keeps_freed_host_memory_unless_bounded(monkeypatch):
    """train() keeps freed buffers for reuse (tune_host_allocator) unless asked not to:
    HETJAX_MALLOC set, or a MALLOC_* variable of the user's or the launcher's."""
    for name in (*MALLOC_ENV, "HETJAX_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("HETJAX_MALLOC", "1"), ("HETJAX_MALLOC", "0"), ("MALLOC_ARENA_MAX", "2")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert tune_host_allocator() is False, name
    assert tune_host_allocator() is True


@pytest.mark.parametrize(
    "argv, after",
    [
        (["--config.train.steps"], ""),
        (["--config.train.steps", "--plan"], " (the next argument is --plan)"),
    ],
    ids=["last", "before-a-flag"],
)
def test_override_without_a_value_is_a_clear_error(argv, after, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "config error: override --config.train.steps needs a value: "
        f"--config.train.steps=VALUE or --config.train.steps VALUE{after}"
    ) in err, err


def test_override_value_as_the_next_argument(capsys):
    assert launch.main(["--config.train.steps", "7", "--print-config"]) == 0
    assert "train.steps = 7" in capsys.readouterr().out.splitlines()


def test_default_workdir_is_runs_and_the_config_name(monkeypatch, tmp_path):
    """Without --workdir a run writes to runs/<config file's name> under the current
    directory (the default config: gpt_tiny)."""
    import hetjax.train

    monkeypatch.chdir(tmp_path)
    workdirs = []
    record = lambda config, workdir, **_: workdirs.append(workdir)
    monkeypatch.setattr(hetjax.train, "train", record)
    assert launch.main([]) == 0
    assert launch.main(["--config", "llama_tiny"]) == 0
    assert launch.main(["--config", str(ROOT / "configs" / "gpt_small.py")]) == 0
    assert launch.main(["--config", "gpt_small", "--workdir", "elsewhere"]) == 0
    assert [Path(w) for w in workdirs] == [
        Path("runs/gpt_tiny"),
        Path("runs/llama_tiny"),
        Path("runs/gpt_small"),
        Path("elsewhere"),
    ]
