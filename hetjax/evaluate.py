"""``hetjax eval``: the loss and perplexity of a run's newest checkpoint (``--workdir``),
or of a Hugging Face checkpoint directory (``--hf`` alone), on the configured data (a
token file or jsonl records with their loss masks), in the configured placement
(``offload.mode``: in memory, or the blocks streamed from host RAM or NVMe).

    hetjax eval --config gpt_tiny --workdir runs/tiny                 # newest checkpoint
    hetjax eval --config llama_tiny --hf /path/to/ckpt --config.data.path=val.bin

The batches are those a training run of the same config evaluates (``train.eval_batches``
batches of the held-out split, :func:`hetjax.train.evaluate`), so the loss equals the
validation loss the run reported with the same params; ``--batches N`` takes N instead
(0: every row of the split once), ``--split train`` the training split, unshuffled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from hetjax.config import Config, ConfigError
from hetjax.errors import entry_point


@dataclasses.dataclass(frozen=True)
class EvalResult:
    loss: float  # mean token cross-entropy (jsonl: over completion tokens), nats
    batches: int
    source: str  # what was evaluated

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def evaluate_checkpoint(
    config: Config,
    workdir: str | Path | None = None,
    *,
    split: str = "val",
    batches: int | None = None,
    step: int | None = None,
) -> EvalResult:
    """The loss over ``batches`` batches (default ``train.eval_batches``; 0: the whole
    split once) of ``split`` of ``config``'s data, of the params of ``workdir``'s newest
    checkpoint (or ``step``'s), or without ``workdir`` the initial ones
    (``model.init_from``: an HF checkpoint), run by the runtime ``config.offload``
    places."""
    from hetjax.checkpoint import restore_newest
    from hetjax.instruct import make_datasets
    from hetjax.train import build_runtime, evaluate

    if not config.train.eval_batches and batches is None:
        batches = 0
    train_data, val_data, _ = make_datasets(config)
    data = val_data if split == "val" else train_data
    data.shuffle = False
    n = config.train.eval_batches if batches is None else batches
    n = n or max(data.num_windows // data.batch_size, 1)
    state, source = None, config.model.init_from
    if workdir is None and not source:
        raise ConfigError("hetjax eval needs --workdir (a run's checkpoints) or --hf <dir>")
    if workdir is not None:
        state, meta = restore_newest(config, workdir, step)
        source = f"{workdir} step {meta['step']}"
    # the runtime's own tiers (its NVMe pages) apart from the run's, which its
    # checkpoints may hard-link
    scratch = Path(tempfile.mkdtemp(prefix="hetjax-eval-", dir=workdir))
    runtime = None
    try:
        runtime = build_runtime(config, scratch)
        if state is not None:
            runtime.load_state(state)
        loss = evaluate(runtime, data, n)
    finally:
        if runtime is not None:
            runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return EvalResult(loss, n, source)


@entry_point("hetjax eval")
def main(argv: list[str] | None = None) -> int:
    from hetjax import launch

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.evaluate",
        description="Loss and perplexity of a run's newest checkpoint (--workdir) or an HF "
        "checkpoint directory (--hf, without --workdir) on the configured data. Also "
        "takes launch's --config, --workdir, --hf and --config.<key>=<value>.",
    )
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument(
        "--batches", type=int, default=None,
        help="batches to evaluate (default train.eval_batches; 0: the whole split)",
    )  # fmt: skip
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    args, rest = parser.parse_known_args(argv)
    try:
        run_args, overrides = launch.parse_args(rest)
        config = launch.run_config(run_args, overrides)
    except ConfigError as e:
        print(f"hetjax eval: config error: {e}", file=sys.stderr)
        return 2
    from hetjax.types import CheckpointError

    workdir = run_args.workdir
    if workdir is None and run_args.hf is None:
        workdir = str(Path("runs") / Path(run_args.config).stem)
    try:
        result = evaluate_checkpoint(
            config, workdir, split=args.split, batches=args.batches, step=args.step
        )
    except (ConfigError, CheckpointError) as e:
        print(f"hetjax eval: error: {e}", file=sys.stderr)
        return 1
    what = "completion tokens" if config.data.format == "jsonl" else "tokens"
    print(
        f"{result.source}: {args.split} loss {result.loss:.6f} (mean over {what} of "
        f"{result.batches} batches of {config.train.batch_size} x {config.train.seq_len}), "
        f"perplexity {result.perplexity:.4f}"
    )
    print(json.dumps({"loss": result.loss, "perplexity": result.perplexity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
