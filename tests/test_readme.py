"""Every command in the README runs (issue #24: the README cannot drift).

The README's ```bash blocks are read here, continuation lines joined and comments
dropped; each command is run as written, with only what makes it cheap or possible here
added: a temporary workdir and NVMe path, two training steps and one validation batch.
``--plan`` and ``--print-config`` commands run exactly as written, in the default run;
the training commands are slow. The multi-process ``launch/local.sh`` command runs in a
clean environment (not conftest's 8 virtual devices per process) and its losses are
compared with one process's (``run_local_sh_command``). The two fresh-machine commands
are CI's (the test one, ``.ci/run``) and the default run's (tests/test_train.py, whole
with ``-m slow``); ``gpucheck`` needs a GPU and is run here with ``--help`` (its CPU
path, ``--emulate``, is tests/test_gpucheck.py's). A command no rule below knows fails
the test: say how to run it here.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
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
MULTI_PROCESS = [c for c in COMMANDS if "launch/local.sh" in c]


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


def _subprocess(argv: list[str], env: dict[str, str], inherit: bool = True) -> str:
    """Runs ``argv`` in the repository with ``env`` (added to this environment unless
    ``inherit`` is false); its stdout."""
    env = {**os.environ, **env} if inherit else env
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _clean_env(**env: str) -> dict[str, str]:
    """A user's shell on this machine: this environment without conftest's device count
    (XLA_FLAGS) or any process-group variable, on the CPU (local.sh's path)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("HETJAX_", "SLURM_"))
    }
    return {**base, "JAX_PLATFORMS": "cpu", **env}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(workdir: Path) -> tuple[list[float], float]:
    """A run's per-step losses (metrics.jsonl) and validation loss (summary.json)."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines], json.loads(
        (workdir / "summary.json").read_text()
    )["val_loss"]


def run_local_sh_command(command: str, tmp_path: Path) -> None:
    """The README's ``VAR=VALUE launch/local.sh N ARGS`` as written (its variable, its
    process count, its arguments: 2 processes x 2 virtual CPU devices) in a clean
    environment, with metrics every step added; its per-step and validation losses
    equal, within 1e-5 (tests/test_zero.py's two-process bound), those of one process on
    one device run with the same arguments (the same global batch)."""
    env, rest = command.split(" launch/local.sh ", 1)
    name, value = env.split("=", 1)
    count, rest = rest.split(" ", 1)
    args = [*_args(rest, "", tmp_path), "--config.train.log_every=1"]
    script = str(ROOT / "launch" / "local.sh")
    env = {name: value, "PYTHON": sys.executable, "HETJAX_PORT": str(_free_port())}
    out = _subprocess([script, count, *args], _clean_env(**env), inherit=False)
    assert "cpu x4;" in out and "zero-3: 4 devices (2 processes)" in out, out[-3000:]
    assert (tmp_path / "run" / "proc1.log").is_file()
    one = [a.replace(str(tmp_path / "run"), str(tmp_path / "one")) for a in args]
    flags = "--xla_force_host_platform_device_count=1"
    out = _subprocess(
        [sys.executable, "-m", "hetjax.launch", *one], _clean_env(XLA_FLAGS=flags), inherit=False
    )
    assert "cpu x1;" in out, out[-3000:]
    losses, val_loss = _losses(tmp_path / "run")
    reference, reference_val = _losses(tmp_path / "one")
    assert len(losses) == 2, losses  # CHEAP's two steps, each logged
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    np.testing.assert_allclose(val_loss, reference_val, rtol=1e-5)


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
        run_local_sh_command(command, tmp_path)
    elif command.startswith("python -m hetjax.gpucheck"):
        _subprocess([sys.executable, "-m", "hetjax.gpucheck", "--help"], {})
    else:
        pytest.fail(f"no rule runs the README command {command!r}: add one to {__file__}")


def test_readme_has_commands():
    assert len(COMMANDS) >= 8 and QUICK and MULTI_PROCESS, COMMANDS


@pytest.mark.parametrize("command", QUICK)
def test_readme_plan_and_config_commands_run(command, tmp_path):
    run_readme_command(command, tmp_path)


@pytest.mark.slow  # ~2 min: every training command of the README for two steps
@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in QUICK + MULTI_PROCESS])
def test_readme_commands_run(command, tmp_path):
    run_readme_command(command, tmp_path)


@pytest.mark.slow  # ~50 s on 2 cores: 2 processes x 2 devices, then one process
@pytest.mark.parametrize("command", MULTI_PROCESS)
def test_readme_multi_process_command_trains_like_one_process(command, tmp_path):
    run_readme_command(command, tmp_path)  # run_local_sh_command
