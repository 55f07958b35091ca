"""Bad inputs at every entry point (hetjax/errors.py, issue #54): each stops with exit
status 1 or 2 and one line on stderr naming the problem (the key, flag, file or line),
never a traceback, and what it could have replaced is byte-identical afterwards.

The cheap cases stop while the arguments, config and paths are checked: the cases of
one entry point run in one child process (:data:`DRIVER`, a case per call of the
module's ``main``, each with its own stderr and exit status), so a module's imports are
paid once. Cases that must build a runtime or train are marked slow."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import ROOT, config, files_of, launch, saved_params

from hetjax.config import ConfigError
from hetjax.errors import (
    INTERRUPTED_EXIT_STATUS,
    UserError,
    entry_point,
    note_path,
    os_error_line,
)

# Runs each case (a JSON list of argv lists on stdin) through ``<module>.main`` as the
# command line does (argparse's exit included); prints {"rc", "stderr"} a case.
# A case still running after CASE_SECONDS (it went on to train) fails with its traceback.
DRIVER = r"""
import contextlib, importlib, io, json, signal, sys, traceback
class CaseTimeout(BaseException):
    pass
def timeout(signum, frame):
    raise CaseTimeout(f"still running after {sys.argv[2]} s")
signal.signal(signal.SIGALRM, timeout)
module = importlib.import_module(sys.argv[1])
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        signal.alarm(int(sys.argv[2]))
        try:
            rc = module.main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            rc = None
            traceback.print_exc()
        signal.alarm(0)
    print(json.dumps({"rc": rc, "stderr": err.getvalue()}), flush=True)
"""
CASE_SECONDS = 60

LONG = "x" * 300  # a path component longer than any file system takes: a real OSError


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # "{name}" stands for the fixture's file of that name
    status: int
    names: tuple[str, ...]  # what the line must name
    kept: tuple[str, ...] = ()  # files and trees that must be byte-identical afterwards


CASES = {
    "hetjax.launch": [
        Case("config-syntax-error", ("--config", "{syntax.py}"), 2, ("{syntax.py} line 2:",)),
        Case(
            "config-raises",
            ("--config", "{raises.py}"),
            2,
            ("{raises.py} line 4: ZeroDivisionError",),
        ),
        Case("workdir-under-a-file", ("--workdir", "{a_file}/run"), 1, ("--workdir", "{a_file}")),
        Case("workdir-at-a-file", ("--workdir", "{a_file}"), 1, ("--workdir {a_file} is a file",)),
        Case("workdir-oserror", ("--workdir", "{tmp}/" + LONG), 1, ("too long", "(--workdir)")),
        Case("empty-bin", ("--config.data.path={empty.bin}",), 2, ("{empty.bin}", "empty")),
        Case(
            "negative-ids",
            ("--config.data.path={negative.npy}",),
            2,
            ("{negative.npy}", "token id -3"),
        ),
        Case("float-npy", ("--config.data.path={float.npy}",), 2, ("{float.npy}", "float32")),
        Case(
            "overwrite-with-missing-data",
            ("--workdir", "{run}", "--resume=never", "--overwrite", "--config.data.path={nope}"),
            2,
            ("data.path", "{nope}"),
            kept=("{run}",),
        ),
    ],
    "hetjax.tokenize": [
        Case(
            "out-exists",
            ("--tokenizer", "{tokenizer.json}", "--text", "{text.txt}", "--out", "{tokens.bin}"),
            1,
            ("--out {tokens.bin} exists", "--overwrite"),
            kept=("{tokens.bin}",),
        ),
        Case(
            "out-under-a-file",
            ("--tokenizer", "{tokenizer.json}", "--text", "{text.txt}", "--out", "{a_file}/t.bin"),
            1,
            ("--out", "{a_file} is a file"),
        ),
        Case(
            "out-is-a-directory",
            ("--tokenizer", "{tokenizer.json}", "--text", "{text.txt}", "--out", "{tmp}"),
            1,
            ("--out {tmp} is a directory",),
        ),
        Case(
            "out-oserror",
            ("--tokenizer", "{tokenizer.json}", "--text", "{text.txt}", "--out", "{tmp}/" + LONG),
            1,
            ("too long", "(--out)"),
        ),
        Case(
            "binary-text",
            ("--tokenizer", "{tokenizer.json}", "--text", "{binary.txt}", "--out", "{tmp}/b.bin"),
            1,
            ("--text", "{binary.txt}", "not UTF-8"),
        ),
        Case(
            "tokenizer-not-json",
            ("--tokenizer", "{a_file}", "--text", "{text.txt}", "--out", "{tmp}/c.bin"),
            1,
            ("{a_file}", "cannot be read"),
        ),
    ],
    "hetjax.export": [
        Case(
            "out-holds-an-export",
            ("--config", "gpt_tiny", "--out", "{export}"),
            1,
            ("--out {export} exists", "--overwrite"),
            kept=("{export}",),
        ),
        Case("out-under-a-file", ("--out", "{a_file}/hf"), 1, ("--out", "{a_file} is a file")),
        Case("out-at-a-file", ("--out", "{a_file}"), 1, ("--out {a_file} is a file",)),
        Case(
            "config-syntax-error", ("--config", "{syntax.py}", "--out", "{tmp}/e"), 2, ("line 2",)
        ),
    ],
    "hetjax.checkpoint": [
        Case("no-checkpoints", ("--workdir", "{tmp}/none"), 1, ("no checkpoint directory",)),
        Case(
            "export-exists",
            ("--workdir", "{run}", "--export", "{export}"),
            1,
            ("--export {export} exists",),
            kept=("{export}", "{run}"),
        ),
        Case(
            "export-under-a-file",
            ("--workdir", "{run}", "--export", "{a_file}/params"),
            1,
            ("--export", "{a_file} is a file"),
        ),
        Case("workdir-oserror", ("--workdir", "{tmp}/" + LONG), 1, ("too long", "(--workdir)")),
    ],
    "hetjax.gpucheck": [
        Case("out-under-a-file", ("--emulate", "--out", "{a_file}/g"), 1, ("--out", "{a_file}")),
        Case("out-at-a-file", ("--emulate", "--out", "{a_file}"), 1, ("--out {a_file} is a file",)),
    ],
    "hetjax.evaluate": [
        Case("config-syntax-error", ("--config", "{syntax.py}"), 2, ("{syntax.py} line 2:",)),
        Case(
            "negative-ids",
            ("--config.data.path={negative.npy}", "--workdir", "{run}"),
            1,
            ("{negative.npy}", "token id -3"),
        ),
    ],
    "hetjax.generate": [
        Case(
            "config-syntax-error",
            ("--config", "{syntax.py}", "--prompt", "a"),
            2,
            ("{syntax.py} line 2:",),
        ),
    ],
}


def make_inputs(tmp: Path) -> dict[str, str]:
    """The bad (and the existing, not to be replaced) files the cases name."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (tmp / "a_file").write_bytes(b"a file, not a directory\n")
    (tmp / "syntax.py").write_text("from hetjax.config import Config\ndef get_config(:\n")
    (tmp / "raises.py").write_text(
        "from hetjax.config import Config\n\ndef get_config():\n    return 1 / 0\n"
    )
    (tmp / "empty.bin").write_bytes(b"")
    np.save(tmp / "negative.npy", np.full(4096, -3, np.int64))
    np.save(tmp / "float.npy", np.ones(4096, np.float32))
    run = tmp / "run"  # a workdir as a run leaves it (the cases stop before reading it)
    for name, data in {
        "checkpoints/2/meta/metadata": b'{"step": 2}',
        "checkpoints/2/state/proc0/pages": os.urandom(256),
        "config.json": b'{"train": {"steps": 2}}\n',
        "metrics.jsonl": b'{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.0}\n',
        "summary.json": b"{}\n",
        "loss.png": os.urandom(64),
    }.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    (tmp / "export").mkdir()
    (tmp / "export" / "config.json").write_text('{"model_type": "llama"}\n')
    (tmp / "export" / "model.safetensors").write_bytes(os.urandom(128))
    (tmp / "tokens.bin").write_bytes(os.urandom(64))
    (tmp / "text.txt").write_text("a b a\n")
    (tmp / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x80")
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp / "tokenizer.json"))
    names = {p.name: str(p) for p in tmp.iterdir()}
    return {**names, "tmp": str(tmp), "nope": str(tmp / "nope.bin")}


class BadInputs:
    """Runs each entry point's cases once (one child process), on first use."""

    def __init__(self, tmp: Path):
        self.paths = make_inputs(tmp)
        self.outcomes: dict[str, dict[str, tuple[dict, list, list]]] = {}

    def fill(self, text: str) -> str:
        for name, path in self.paths.items():
            text = text.replace(f"{{{name}}}", path)
        return text

    def outcome(self, module: str, case: Case) -> tuple[dict, list, list]:
        if module not in self.outcomes:
            cases = CASES[module]
            before = [[files_of(Path(self.fill(k))) for k in c.kept] for c in cases]
            argvs = [[self.fill(a) for a in c.argv] for c in cases]
            proc = subprocess.run(
                [sys.executable, "-c", DRIVER, module, str(CASE_SECONDS)],
                input=json.dumps(argvs),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60 + CASE_SECONDS * len(cases),
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            results = [json.loads(line) for line in proc.stdout.splitlines()[-len(cases) :]]
            after = [[files_of(Path(self.fill(k))) for k in c.kept] for c in cases]
            self.outcomes[module] = {
                c.id: r
                for c, r in zip(cases, zip(results, before, after, strict=True), strict=True)
            }
        return self.outcomes[module][case.id]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    return BadInputs(tmp_path_factory.mktemp("bad"))


def assert_one_line(stderr: str, rc, status: int, names: list[str]) -> None:
    """Exit status ``status``, no traceback, and one line on stderr naming ``names``."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == status and len(lines) == 1, (rc, stderr)
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize(
    "module, case",
    [(m, c) for m, cases in CASES.items() for c in cases],
    ids=[f"{m.removeprefix('hetjax.')}-{c.id}" for m, cases in CASES.items() for c in cases],
)
def test_bad_input_stops_with_one_line(module, case, bad_inputs):
    result, before, after = bad_inputs.outcome(module, case)
    assert_one_line(
        result["stderr"], result["rc"], case.status, [bad_inputs.fill(n) for n in case.names]
    )
    for kept, was, now in zip(case.kept, before, after, strict=True):
        assert was and now == was, f"{bad_inputs.fill(kept)} changed"


# -- the wrapper itself --------------------------------------------------------------------


def test_wrapper_names_the_key_of_an_os_error_and_reports_ctrl_c(tmp_path, capsys):
    """An OSError on a path under a noted key's is reported with that key; Ctrl-C
    outside training is one line and status 130; a bug keeps its traceback."""
    note_path("data.path", tmp_path / "data")
    e = FileNotFoundError(2, "No such file or directory", str(tmp_path / "data" / "x.bin"))
    assert os_error_line(e) == f"No such file or directory: {tmp_path}/data/x.bin (data.path)"

    @entry_point("hetjax.demo")
    def main(argv):
        raise {"os": e, "user": UserError("the fix"), "ctrl-c": KeyboardInterrupt()}[argv[0]]

    assert main(["os", "--out", str(tmp_path)]) == 1
    assert main(["user"]) == 1
    assert main(["ctrl-c"]) == INTERRUPTED_EXIT_STATUS
    assert capsys.readouterr().err.splitlines() == [
        f"hetjax.demo: error: {os_error_line(e)}",
        "hetjax.demo: error: the fix",
        "hetjax.demo: interrupted (Ctrl-C)",
    ]

    @entry_point("hetjax.demo")
    def buggy(argv):
        raise AssertionError("a bug")

    with pytest.raises(AssertionError):
        buggy([])


# -- nothing lost: a failing start changes nothing ----------------------------------------


@pytest.mark.slow  # a real run, then a runtime built to find the budget too small (~15 s)
def test_overwrite_with_a_budget_that_does_not_fit_keeps_the_run(tmp_path):
    """``--resume=never --overwrite`` with a device budget too small for the model: the
    run stops with the budget's line before deleting anything; the checkpoints,
    config.json and metrics.jsonl are byte-identical and the checkpoint restores."""
    cfg = config(train=dict(steps=2, eval_batches=1))
    launch(cfg, tmp_path)
    before = files_of(tmp_path, skip=("hetjax.lock",))
    assert {"config.json", "metrics.jsonl"} <= set(before) and any(
        "checkpoints/2" in k for k in before
    )
    proc = launch(
        cfg.replace(offload=dict(mode="stream"), memory=dict(device_budget="64KiB")),
        tmp_path,
        expect_rc=1,
        flags=["--resume=never", "--overwrite"],
    )
    assert_one_line(proc.stderr, 1, 1, ["memory.device_budget", "short by"])
    assert files_of(tmp_path, skip=("hetjax.lock",)) == before
    assert saved_params(tmp_path)[1]["step"] == 2


def test_token_file_too_big_to_scan_is_checked_batch_by_batch(tmp_path, monkeypatch, tiny):
    """Above FULL_SCAN tokens the ids are checked as each batch row is read: a negative
    id stops the run naming the file, instead of training on it."""
    from hetjax import data

    tokens = np.arange(4096, dtype=np.int32) % 200
    tokens[3000] = -1
    np.save(tmp_path / "t.npy", tokens)
    monkeypatch.setattr(data, "FULL_SCAN", 1000)
    cfg = tiny(data=dict(path=str(tmp_path / "t.npy"), val_fraction=0.1))
    train_data, _, _ = data.make_datasets(cfg)  # not scanned whole: no error yet
    train_data.batch(0)  # rows of tokens 0..80: good ids
    with pytest.raises(ConfigError, match=r"data.path '.*t.npy' holds token id -1"):
        for i in range(train_data.num_windows // train_data.batch_size + 1):
            train_data.batch(i)
