"""The ``hetjax`` command: one subcommand per entry point, each the same as its module.

    hetjax train --config gpt_tiny --config.train.steps=50   python -m hetjax.launch ...
    hetjax plan --config gpt175b --hardware a100-80g         python -m hetjax.launch --plan ...
    hetjax bench nvme                                         python -m hetjax.bench nvme
    hetjax checkpoint --workdir runs/gpt_tiny                 python -m hetjax.checkpoint ...
    hetjax export --workdir runs/gpt_tiny --out hf-out/       python -m hetjax.export ...
    hetjax tokenize --tokenizer gpt2/ --text a.txt --out t.bin  python -m hetjax.tokenize ...
    hetjax eval --config gpt_tiny --workdir runs/gpt_tiny     python -m hetjax.evaluate ...
    hetjax generate --hf llama-hf/ --prompt "Hello"           python -m hetjax.generate ...
    hetjax gpucheck --quick                                   python -m hetjax.gpucheck ...

``hetjax`` alone prints this list of commands; ``hetjax --config ...`` (options first, no
subcommand) trains, as the command did before it had subcommands.
"""

from __future__ import annotations

import sys

from hetjax import bench, checkpoint, evaluate, export, generate, gpucheck, launch, tokenize

# subcommand -> (what it does, its module's main, arguments put before the user's)
COMMANDS = {
    "train": ("train a config (python -m hetjax.launch)", launch.main, []),
    "plan": ("where the state goes, and the predicted speed", launch.main, ["--plan"]),
    "bench": ("run a benchmark (python -m hetjax.bench)", bench.main, []),
    "checkpoint": ("list checkpoints (python -m hetjax.checkpoint)", checkpoint.main, []),
    "export": ("export trained params (python -m hetjax.export)", export.main, []),
    "tokenize": ("make a token file (python -m hetjax.tokenize)", tokenize.main, []),
    "eval": ("loss and perplexity of a checkpoint (python -m hetjax.evaluate)", evaluate.main, []),
    "generate": ("text from a checkpoint (python -m hetjax.generate)", generate.main, []),
    "gpucheck": ("check the GPU data path (python -m hetjax.gpucheck)", gpucheck.main, []),
}
# subcommand -> an example, printed after its --help
EXAMPLES = {
    "train": "hetjax train --config gpt_tiny --config.train.steps=50 --workdir runs/tiny",
    "plan": "hetjax plan --config gpt175b --hardware a100-80g",
    "bench": "hetjax bench peer --quick",
    "checkpoint": "hetjax checkpoint --workdir runs/tiny",
    "export": "hetjax export --config gpt_tiny --workdir runs/tiny --out hf-out/",
    "tokenize": "hetjax tokenize --tokenizer gpt2/ --text a.txt b.txt --out tokens.bin",
    "eval": "hetjax eval --config gpt_tiny --workdir runs/tiny",
    "generate": "hetjax generate --hf llama-hf/ --prompt 'Once upon a time' --max-new-tokens 20",
    "gpucheck": "hetjax gpucheck --quick --out docs/results/gpucheck-h100",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (what, _, _) in COMMANDS.items()]
    return (
        "usage: hetjax <command> [options]   (hetjax <command> --help for its options)\n\n"
        "commands:\n" + "\n".join(lines) + "\n\nexample:\n"
        "  hetjax plan --config gpt175b --hardware a100-80g\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):  # bare `hetjax`: what it can do, not a run
        sys.stdout.write(usage())
        return 0
    if argv[0].startswith("-"):  # options only: train (the command's old form)
        argv = ["train", *argv]
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"hetjax: unknown command {name!r}\n\n{usage()}")
        return 2
    _, run, before = COMMANDS[name]
    try:
        return run([*before, *rest])
    except SystemExit as done:
        if done.code == 0 and any(a in ("-h", "--help") for a in rest):
            sys.stdout.write(f"\nexample:\n  {EXAMPLES[name]}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
