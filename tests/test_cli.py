"""The ``hetjax`` command (hetjax/cli.py): subcommands that are their modules."""

import pytest

from hetjax import cli, launch


def test_help_lists_every_command_with_an_example(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "bench", "checkpoint", "export", "tokenize", "gpucheck"):
        assert f"\n  {name} " in out, out
    assert "hetjax plan --config gpt175b --hardware a100-80g" in out


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_each_command_has_its_module_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hetjax.")
    assert out.endswith(f"\nexample:\n  {cli.EXAMPLES[name]}\n")  # and how to use it
    assert cli.EXAMPLES[name].startswith(f"hetjax {name} ")


def test_plan_is_launch_plan(capsys):
    args = ["--config", "gpt_tiny", "--hardware", "h100"]
    assert launch.main([*args, "--plan"]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["plan", *args]) == 0
    assert capsys.readouterr().out == expected
    assert "predicted:" in expected


def test_options_alone_train_as_before(capsys):
    """``hetjax --config ...`` with no subcommand is ``hetjax train``."""
    args = ["--config", "gpt_tiny", "--print-config", "--config.train.steps=7"]
    assert cli.main(args) == 0
    bare = capsys.readouterr().out
    assert cli.main(["train", *args]) == 0
    assert capsys.readouterr().out == bare
    assert "steps" in bare and "7" in bare


def test_unknown_command_names_the_commands(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err and "plan" in err


def test_bare_command_prints_help_and_trains_nothing(tmp_path, monkeypatch, capsys):
    """``hetjax`` with no arguments lists the commands (as ``--help`` does) and starts
    no run: nothing is written in the current directory."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    cli.main(["--help"])
    assert out == capsys.readouterr().out and "\n  train " in out
    assert not list(tmp_path.iterdir())
