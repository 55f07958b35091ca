"""``python -m hetjax.launch``: train a model from a config file.

    python -m hetjax.launch --config configs/gpt_tiny.py --workdir runs/tiny \\
        --config.train.steps=50 --config.optimizer.lr=3e-4

A workdir that holds checkpoints resumes from the newest complete one; ``--resume=never``
starts fresh (refusing to delete them unless ``--overwrite`` is given). One run at a time
holds a workdir (``hetjax/run_lock.py``).

Exit status (``hetjax/errors.py``): 0 trained to the end; 1 an error (the message says
what to change); 2 a bad config or command line; 75
(:data:`~hetjax.preemption.PREEMPTED_EXIT_STATUS`) preempted by SIGTERM, SIGUSR1 or
Ctrl-C with a complete checkpoint written: run the same command again to resume
(``hetjax/preemption.py``); 130 a second Ctrl-C, which stops the run at once. Everything
that can fail at start-up (the config, the data, the budgets, the workdir) is checked
before anything in the workdir is written or deleted.

Every config key can be overridden as ``--config.<section>.<name>=<value>`` (or with
the value as the next argument). With no ``--config`` the embedded default,
``configs/gpt_tiny.py``, trains a small GPT on the bundled corpus.

Run from the command line with ``HETJAX_MALLOC=1``, it sets glibc's allocator to return
freed buffers to the system (:func:`tune_malloc`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from hetjax import xla_env
from hetjax.allocator import tune_malloc
from hetjax.config import Config, ConfigError, load_config
from hetjax.data import check_token_file
from hetjax.errors import UserError, check_output_dir, entry_point, note_path
from hetjax.planning.hardware import PROFILES

DEFAULT_CONFIG = "gpt_tiny"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    """Splits ``--config.a.b=v`` overrides from the ordinary flags (:func:`_parser`)."""
    overrides, rest = _split_overrides(argv)
    args = _parser().parse_args(rest)
    args.config_given = args.config is not None  # --hf without it: not the tiny demo's
    args.config = args.config or DEFAULT_CONFIG
    if args.resume is not None:
        overrides["checkpoint.resume"] = args.resume
    if args.overwrite:
        overrides["checkpoint.overwrite"] = "true"
    return args, overrides


def _split_overrides(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--config.a.b=v`` and ``--config.a.b v`` (as ``{"a.b": "v"}``), and the rest."""
    overrides: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, eq, value = arg[len("--config.") :].partition("=")
            if not eq:
                # The value is the next argument, unless that is missing or another flag
                # (a value never starts with "--": negative numbers have one dash).
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    after = f" (the next argument is {argv[i + 1]})" if i + 1 < len(argv) else ""
                    raise ConfigError(
                        f"override --config.{key} needs a value: --config.{key}=VALUE or "
                        f"--config.{key} VALUE{after}"
                    )
                value, i = argv[i + 1], i + 1
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def _parser() -> argparse.ArgumentParser:
    """The command line's flags (the overrides aside)."""
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.launch",
        description="Train a transformer with hetjax. Override any config key with "
        "--config.<section>.<name>=<value>.",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="config file: a path, or a name in configs/ (default: gpt_tiny; with --hf, "
        "the library's defaults: offload.mode=auto within this machine's memory)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where metrics, config and state go (default: runs/<config name>)",
    )
    parser.add_argument(
        "--resume",
        choices=("auto", "never"),
        default=None,
        help="auto: continue from the newest complete checkpoint in the workdir (the "
        "default); never: start fresh, refusing if checkpoints exist (see --overwrite)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --resume=never: delete the workdir's checkpoints and start fresh",
    )
    parser.add_argument(
        "--hf",
        default=None,
        help="a Hugging Face checkpoint directory: the model's shape from its config.json "
        "and its params the initial ones (model.init_from=hf:<dir>)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print the plans' parts and the run summary in full (summary.json holds them "
        "either way; the terms: docs/guide/running.md#the-runs-output)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print where the planner puts every kind of state and the predicted step "
        "time, tokens/s and TFLOP/s, then exit (nothing of the model is allocated)",
    )
    parser.add_argument(
        "--hardware",
        default="local",
        help="with --plan: the machine to plan for, a profile (" + ", ".join(PROFILES) + ") "
        "or local (measured here; the default)",
    )
    return parser


def run_config(args: argparse.Namespace, overrides: dict[str, str]) -> Config:
    """The config of parsed arguments: the config file with the overrides, and with
    ``--hf`` its model read off the checkpoint's ``config.json`` (shape fields and
    ``init_from``; the overrides' other model fields kept). ``--hf`` without ``--config``
    starts from the library's defaults (``offload.mode=auto``, the budgets measured from
    this machine), not the tiny demo's budgets and trace."""
    if args.hf and not getattr(args, "config_given", True):
        config = Config().override(overrides)
    else:
        config = load_config(args.config, overrides)
    if args.hf:
        from hetjax.hf import model_config_from_hf

        config = dataclasses.replace(config, model=model_config_from_hf(args.hf, config.model))
    for key in ("data.path", "data.tokenizer", "checkpoint.dir"):  # named in an OSError's line
        section, name = key.split(".")
        note_path(key, getattr(getattr(config, section), name))
    for drive in config.memory.nvme_paths:
        note_path("memory.nvme_path", drive)
    return config


@entry_point("hetjax")
def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # tests pass their argv: no process-wide change
    argv = sys.argv[1:] if command_line else argv
    args, overrides = parse_args(argv)
    config = run_config(args, overrides)
    # HETJAX_MALLOC=1 trades step time for a smaller RSS (MALLOC_ENV); a host budget is
    # held without it (hetjax/allocator.py)
    if command_line and os.environ.get("HETJAX_MALLOC") == "1" and tune_malloc():
        print(
            "hetjax: HETJAX_MALLOC=1, so glibc's allocator returns freed buffers to the OS "
            "(a smaller peak RSS, slower steps)",
            file=sys.stderr,
        )
    if args.print_config:
        for section, fields in config.to_dict().items():
            for name, value in fields.items():
                print(f"{section}.{name} = {value!r}")
        return 0
    workdir = Path(args.workdir or Path("runs") / Path(args.config).stem)
    if args.plan:
        return _plan(config, args.hardware, workdir)
    check_output_dir(workdir, "--workdir")
    check_token_file(config)  # in a second, not after JAX has started

    from hetjax.distributed import initialize  # imports JAX: after argument checks
    from hetjax.train import train

    if command_line:  # before JAX starts its backends: XLA reads these once
        for note in xla_env.apply(config):
            print(f"hetjax: {note}", file=sys.stderr)
    try:
        initialize(config)  # jax.distributed, when the run has several processes
        train(config, workdir, return_params=False, details=args.verbose)
    except ConfigError as e:  # found once running (a busy workdir, another model's state)
        raise UserError(str(e)) from None
    return 0


def _plan(config, hardware: str, workdir: Path) -> int:
    from hetjax.planning.hardware import HardwareError, get_profile
    from hetjax.planning.search import PlanError, make_plan
    from hetjax.planning.workload import measured_expert_fraction

    try:
        hw = get_profile(hardware, config.memory.nvme_path, config.model.compute_dtype)
    except HardwareError as e:
        print(f"hetjax: {e}", file=sys.stderr)
        return 2
    print(hw.describe())
    try:
        # a MoE's routing as the workdir's last run measured it, if one did
        print(make_plan(config, hw, expert_fraction=measured_expert_fraction(workdir)).table())
    except PlanError as e:
        print(f"hetjax: does not fit: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # e.g. distributed.expert_parallel against the profile's devices
        print(f"hetjax: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
