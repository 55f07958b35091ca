"""Every command in the README runs (issue #24: the README cannot drift), as a newcomer
meets them (issue #54): in order, each as written.

The README's ```bash blocks are read here, continuation lines joined and comments
dropped. In the default run, cheap checks: ``--plan`` and ``--print-config`` commands run
exactly as written; every command runs the venv's Python (``.venv/bin/python``, or the
launch scripts that pick it), and every training command has a ``--workdir`` of its own
(a shared one resumes at its last step: "nothing to train"). In the slow suite, the
tour: on a copy of the repository (its ``.venv`` this one's), every command in order, as
written, with only what makes it cheap or possible here added: two training steps and one
validation batch (``CHEAP``); the GPT-2 download replaced by a random GPT-2 and a
byte-level tokenizer saved the same way (no network); ``gpucheck`` with ``--help`` (it
needs a GPU; its CPU path, ``--emulate``, is tests/test_gpucheck.py's); the
fresh-machine set-up (``python3 -m venv``, ``pip install``) not repeated and the test
suite not run from inside itself. The multi-process ``launch/local.sh`` command is also
run in a clean environment (not conftest's 8 virtual devices per process) and its
losses compared with one process's (``run_local_sh_command``). A command no rule below
knows fails the test: say how to run it here.
"""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetjax.launch import main

ROOT = Path(__file__).resolve().parent.parent
CHEAP = [
    "--config.train.steps=2",
    "--config.train.eval_batches=1",
    "--config.train.in_memory_steps=0",
]
PYTHON = ".venv/bin/python"  # the README's, made by its set-up
LAUNCH = f"{PYTHON} -m hetjax.launch"
FRESH_MACHINE = "python3 -m venv .venv"
DEFAULT_WORKDIR = "runs/gpt_tiny"  # the default run's, runs/<config name>


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
# the commands that train, each into its workdir
TRAINING = [
    c for c in COMMANDS if ("hetjax.launch" in c or "launch/local.sh" in c) and c not in QUICK
]


def _args(command: str, prefix: str, tmp_path: Path) -> list[str]:
    """The command's hetjax.launch arguments, with the workdir and NVMe path moved
    under ``tmp_path``, and, for a training run, the cheap overrides."""
    args = shlex.split(command.split(prefix, 1)[1] if prefix else command)
    args = [a.replace("=runs/nvme", f"={tmp_path / 'nvme'}") for a in args]
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
    (XLA_FLAGS), any process-group variable or an active virtual environment, on the CPU
    (local.sh's path)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "VIRTUAL_ENV", "PYTHON")
        and not k.startswith(("HETJAX_", "SLURM_"))
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
    process count, its arguments: 2 processes x 2 virtual CPU devices; the Python it
    picks, the README's venv where there is one) in a clean environment, with metrics
    every step added; its per-step and validation losses equal, within 1e-5
    (tests/test_zero.py's two-process bound), those of one process on one device run
    with the same arguments (the same global batch)."""
    env, rest = command.split(" launch/local.sh ", 1)
    name, value = env.split("=", 1)
    count, rest = rest.split(" ", 1)
    args = [*_args(rest, "", tmp_path), "--config.train.log_every=1"]
    script = str(ROOT / "launch" / "local.sh")
    env = {name: value, "HETJAX_PORT": str(_free_port())}
    if not (ROOT / PYTHON).exists():  # not set up as the README says: this Python
        env["PYTHON"] = sys.executable
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
    """A ``--plan`` or ``--print-config`` command in this process, or the multi-process
    one (``run_local_sh_command``)."""
    if command.startswith(LAUNCH):
        assert main(_args(command, LAUNCH, tmp_path)) == 0, command
    elif "launch/local.sh" in command:
        run_local_sh_command(command, tmp_path)
    else:
        pytest.fail(f"no rule runs the README command {command!r}: add one to {__file__}")


def _workdir(command: str) -> str:
    args = shlex.split(command)
    return args[args.index("--workdir") + 1] if "--workdir" in args else DEFAULT_WORKDIR


def test_readme_has_commands():
    assert len(COMMANDS) >= 8 and QUICK and MULTI_PROCESS and len(TRAINING) >= 6, COMMANDS


def test_commands_run_the_venv_python_each_training_in_its_own_workdir():
    """Every command runs the Python the README's set-up made (no bare ``python``,
    which a fresh machine may lack or have without JAX); every training command has its
    own workdir (a workdir holding a finished run resumes at its end: the next command
    into it would train nothing), the default run's ``runs/gpt_tiny`` only its own."""
    for command in COMMANDS:
        assert not re.search(r"(^|[\s=])python3? -m hetjax", command), command
    workdirs = [_workdir(c) for c in TRAINING]
    assert len(set(workdirs)) == len(workdirs), workdirs
    assert [c.startswith(FRESH_MACHINE) for c in TRAINING if _workdir(c) == DEFAULT_WORKDIR] == [
        True
    ], TRAINING


@pytest.mark.parametrize("command", QUICK)
def test_readme_plan_and_config_commands_run(command, tmp_path):
    run_readme_command(command, tmp_path)


# -- the tour, in order, on a copy of the repository --------------------------------------


def _copy_repository(dest: Path) -> None:
    """The repository's files (no runs, caches or git) into ``dest``, with this one's
    ``.venv`` (or, where there is none, this Python) as its ``.venv``."""
    skip = shutil.ignore_patterns(
        ".git", ".venv", "runs", "hf", "__pycache__", "*.egg-info", ".*_cache"
    )
    shutil.copytree(ROOT, dest, ignore=skip)
    if (ROOT / PYTHON).exists():
        (dest / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    else:
        (dest / ".venv" / "bin").mkdir(parents=True)
        (dest / PYTHON).symlink_to(sys.executable)


def _save_random_gpt2(out: Path) -> None:
    """What the README's download saves, without the network: a GPT-2 (2 x 64, random
    weights; ``save_pretrained``) and a byte-level tokenizer with GPT-2's end-of-text
    token (``tokenizer.json``)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])  # id 256
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=257,
        bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))


def _tour_command(command: str, repo: Path) -> str | None:
    """The shell command the tour runs for a README command in ``repo`` (None: not run
    here; the module docstring says why)."""
    if command.startswith(FRESH_MACHINE):
        last = command.rsplit(" && ", 1)[1]
        return f"{last} {shlex.join(CHEAP)}" if last == LAUNCH else None  # (not pytest)
    if "from_pretrained('gpt2')" in command:
        _save_random_gpt2(repo / "hf" / "gpt2")
        return None
    if command.startswith(f"{PYTHON} -m hetjax.gpucheck"):
        return f"{PYTHON} -m hetjax.gpucheck --help"
    if command in TRAINING:
        return f"{command} {shlex.join(CHEAP)}"
    if command.startswith(f"{PYTHON} -m hetjax."):  # --plan, --print-config, tokenize
        return command
    pytest.fail(f"no rule runs the README command {command!r}: add one to {__file__}")


# ~4 min on 2 idle cores (7 training runs of 2 steps, in order), 3x that on a loaded
# machine: past the suite's 600 s a test
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_tour_runs_in_order_on_a_copy_of_the_repository(tmp_path):
    """Every README command, in order, as written (plus CHEAP) in a shell in a copy of
    the repository: each exits 0, none finds "nothing to train", and each training
    command's workdir holds its own two steps."""
    repo = tmp_path / "repo"
    _copy_repository(repo)
    env = _clean_env(HETJAX_PORT=str(_free_port()))
    for command in COMMANDS:
        shell = _tour_command(command, repo)
        if shell is None:
            continue
        print(f"tour: {shell}", flush=True)  # (where a failure or a timeout stopped)
        out = subprocess.run(
            ["bash", "-c", shell], cwd=repo, env=env, capture_output=True, text=True, timeout=600
        )
        said = out.stdout[-3000:] + out.stderr[-3000:]
        assert out.returncode == 0, f"{command}\n{said}"
        assert "nothing to train" not in out.stdout + out.stderr, f"{command}\n{said}"
        if command in TRAINING:
            metrics = (repo / _workdir(command) / "metrics.jsonl").read_text().splitlines()
            assert len(metrics) == 2, (command, metrics)


@pytest.mark.slow  # ~50 s on 2 cores: 2 processes x 2 devices, then one process
@pytest.mark.parametrize("command", MULTI_PROCESS)
def test_readme_multi_process_command_trains_like_one_process(command, tmp_path):
    run_readme_command(command, tmp_path)  # run_local_sh_command
