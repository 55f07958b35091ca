"""``python -m hetjax.export``: write a model as a Hugging Face checkpoint directory.

    python -m hetjax.export --config llama_tiny --out runs/llama_tiny_hf            # init
    python -m hetjax.export --config llama_tiny --train --workdir runs/lt --out runs/lt_hf
    python -m hetjax.export --config gpt_small --config.model.init_from=hf:gpt2 --out gpt2_copy

The params come from the run config: without ``--train``, the initial params (the
``model.init_from`` checkpoint, else the random init of ``train.seed``); with
``--train``, the params at the end of ``hetjax.train.train`` on that config (metrics in
``--workdir``). The output loads with ``transformers``' ``from_pretrained`` and with
``model.init_from=hf:<out>``; see :func:`hetjax.hf.export_hf`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetjax.config import Config, ConfigError, load_config, parse_bytes


def initial_params(config: Config):
    """The params a run of ``config`` starts from, as a numpy tree."""
    import jax
    import numpy as np

    from hetjax.hf import open_checkpoint
    from models import build_model

    checkpoint = open_checkpoint(config.model)
    if checkpoint is not None:
        return checkpoint.params()
    model = build_model(config.model)
    return jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(config.train.seed)))


def main(argv: list[str] | None = None) -> int:
    from hetjax import launch

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.export",
        description="Write a hetjax model as a Hugging Face checkpoint (config.json + "
        "safetensors). Also takes launch's --config, --workdir and --config.<key>=<value>.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--train", action="store_true", help="train the config first and export the result"
    )
    parser.add_argument(
        "--max-shard-size", default="5GiB", help="largest safetensors shard (default 5GiB)"
    )
    args, rest = parser.parse_known_args(argv)
    try:
        run_args, overrides = launch.parse_args(rest)
        config = load_config(run_args.config, overrides)
        shard_bytes = parse_bytes(args.max_shard_size, "--max-shard-size")
    except ConfigError as e:
        print(f"hetjax.export: config error: {e}", file=sys.stderr)
        return 2

    from hetjax.hf import export_hf
    from hetjax.train import TrainingError, train

    try:
        if args.train:
            workdir = Path(run_args.workdir or Path("runs") / Path(run_args.config).stem)
            params = train(config, workdir).params
        else:
            params = initial_params(config)
        out = export_hf(config.model, params, args.out, shard_bytes)
    except (ConfigError, TrainingError) as e:
        print(f"hetjax.export: error: {e}", file=sys.stderr)
        return 1
    print(f"hetjax.export: wrote {config.model.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
