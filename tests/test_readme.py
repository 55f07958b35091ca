"""Every command in the README runs (issue #24: the README cannot drift).

The README's ```bash blocks are read here, continuation lines joined and comments
dropped; each command is run as written, with only what makes it cheap or possible
here added: a temporary workdir and NVMe path, two training steps and one validation
batch. ``--plan`` and ``--print-config`` commands run exactly as written, in the default
run; the training commands are slow. The two fresh-machine commands are CI's (the test
one, ``.ci/run``) and the default run's (tests/test_train.py, whole with ``-m slow``);
``gpucheck`` needs a GPU and is run here with ``--help`` (its CPU path,
``--emulate``, is tests/test_gpucheck.py's). A command no rule below knows fails the
test: say how to run it here.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hetjax.launch import main

ROOT = Path(__file__).resolve().parent.parent
CHEAP = ["--config.train.steps=2", "--config.train.eval_batches=1"]
FRESH_MACHINE = ("python3 -m venv .venv",)


def readme_commands() -> list[str]:
    """The README's shell commands, one string each."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                commands.append(command)
    return commands


COMMANDS = readme_commands()
QUICK = [c for c in COMMANDS if "--plan" in c or "--print-config" in c]


def _args(command: str, prefix: str, tmp_path: Path) -> list[str]:
    """The command's hetjax.launch arguments, with the workdir and NVMe path moved
    under ``tmp_path``, and, for a training run, the cheap overrides."""
    args = shlex.split(command.split(prefix, 1)[1] if prefix else command)
    args = [a.replace("/mnt/nvme/hetjax", str(tmp_path / "nvme")) for a in args]
    if "--workdir" in args:
        args[args.index("--workdir") + 1] = str(tmp_path / "run")
    else:
        args += ["--workdir", str(tmp_path / "run")]
    if "--plan" in args or "--print-config" in args:
        return args
    return args + CHEAP


def _subprocess(argv: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def run_readme_command(command: str, tmp_path: Path) -> None:
    if command.startswith(FRESH_MACHINE):
        return  # CI's and the default run's (module docstring)
    if command.startswith("python -m hetjax.launch"):
        args = _args(command, "python -m hetjax.launch", tmp_path)
        if any(a.startswith("--config.model.init_from=hf:/path/") for a in args):
            args = [a for a in args if a not in CHEAP] + ["--print-config"]  # a placeholder
        assert main(args) == 0, command
    elif command.startswith("XLA_FLAGS="):
        env, rest = command.split(" ", 1)
        args = _args(rest, "python -m hetjax.launch", tmp_path)
        flags = env.split("=", 1)[1]
        _subprocess([sys.executable, "-m", "hetjax.launch", *args], {"XLA_FLAGS": flags})
    elif "launch/local.sh" in command:
        env, rest = command.split(" launch/local.sh ", 1)
        name, value = env.split("=", 1)
        count, rest = rest.split(" ", 1)
        args = _args(rest, "", tmp_path)
        script = str(ROOT / "launch" / "local.sh")
        env = {name: value, "PYTHON": sys.executable, "HETJAX_PORT": "12397"}
        _subprocess([script, count, *args], env)
    elif command.startswith("python -m hetjax.gpucheck"):
        _subprocess([sys.executable, "-m", "hetjax.gpucheck", "--help"], {})
    else:
        pytest.fail(f"no rule runs the README command {command!r}: add one to {__file__}")


def test_readme_has_commands():
    assert len(COMMANDS) >= 8 and QUICK, COMMANDS


@pytest.mark.parametrize("command", QUICK)
def test_readme_plan_and_config_commands_run(command, tmp_path):
    run_readme_command(command, tmp_path)


@pytest.mark.slow  # ~2 min: every training command of the README for two steps
@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in QUICK])
def test_readme_commands_run(command, tmp_path):
    run_readme_command(command, tmp_path)
