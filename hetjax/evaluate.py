"""``hetjax eval``: the loss and perplexity of a run's newest checkpoint (``--workdir``),
or of a Hugging Face checkpoint directory (``--hf`` alone), on the configured data (a
token file or jsonl records with their loss masks), in the configured placement
(``offload.mode``: in memory, or the blocks streamed from host RAM or NVMe).

    hetjax eval --config gpt_tiny --workdir runs/tiny                 # newest checkpoint
    hetjax eval --config llama_tiny --hf /path/to/ckpt --config.data.path=val.bin

The batches are those a training run of the same config evaluates (``train.eval_batches``
batches of the held-out split, :func:`hetjax.train.evaluate`), so the loss equals the
validation loss the run reported with the same params; ``--batches N`` takes N instead,
``--split train`` the training split, unshuffled. ``--batches 0`` evaluates every row of
the split exactly once (:func:`every_row`): its whole batches, then each row of the last
partial one (or of a split smaller than a batch) alone, as a batch of copies of it;
the loss is the mean over every token that takes one (jsonl: completion tokens), each
batch weighted by its tokens. Without ``--config`` the config is the workdir's
``config.json`` (``hetjax/cli_config.py``); arguments are checked before anything loads.
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

import numpy as np

from hetjax.config import Config, ConfigError
from hetjax.errors import entry_point


@dataclasses.dataclass(frozen=True)
class EvalResult:
    loss: float  # mean token cross-entropy (jsonl: over completion tokens), nats
    batches: int  # 0: every row once
    source: str  # what was evaluated
    rows: int = 0  # rows evaluated

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

    check_arguments(batches, step)
    n = config.train.eval_batches if batches is None else batches
    train_data, val_data, _ = make_datasets(config)
    data = val_data if split == "val" else train_data
    data.shuffle = False
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
        if n:
            loss, rows = evaluate(runtime, data, n), n * data.batch_size
        else:
            loss, rows = every_row(runtime, data)
    finally:
        if runtime is not None:
            runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return EvalResult(loss, n, source, rows)


def check_arguments(batches: int | None, step: int | None) -> None:
    """``ConfigError`` for a negative ``--batches`` or ``--step``."""
    if batches is not None and batches < 0:
        raise ConfigError(f"--batches must be 0 (every row once) or more, got {batches}")
    if step is not None and step < 0:
        raise ConfigError(f"--step must be a checkpoint's step (0 or more), got {step}")


def every_row(runtime, data) -> tuple[float, int]:
    """(the mean loss over every row of ``data`` exactly once, the rows): its whole
    batches, then each row of the last partial batch alone as a batch of copies of it
    (the runtimes take whole batches); each batch's mean weighted by the tokens that
    take a loss in it (windows: every row alike; packed jsonl rows: their completion
    tokens; a batch with none is skipped)."""
    from hetjax.instruct import PackedRows

    if data.process_count != 1:
        raise ConfigError("hetjax eval --batches 0 runs in one process")
    B, T = data.batch_size, data.seq_len
    if isinstance(data, PackedRows):
        weigh = lambda rows: int((rows[:, -T:] >= 0).sum())
    else:
        weigh = len
    full, left = divmod(data.num_windows, B)
    last = data.batch(full) if left else None  # rows full * B .. N - 1 first
    batches = [(data.batch(i), None) for i in range(full)]
    batches += [(np.repeat(last[j : j + 1], B, axis=0), last[j : j + 1]) for j in range(left)]
    total = weight = 0.0
    for rows, row in batches:
        w = weigh(rows if row is None else row)
        if w:
            total, weight = total + w * runtime.eval_loss(rows), weight + w
    return total / max(weight, 1), data.num_windows


@entry_point("hetjax eval")
def main(argv: list[str] | None = None) -> int:
    from hetjax.chat import sources_line
    from hetjax.cli_config import command_config

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.evaluate",
        description="Loss and perplexity of a run's newest checkpoint (--workdir) or an HF "
        "checkpoint directory (--hf, without --workdir) on the configured data. Also "
        "takes launch's --config (default: the workdir's config.json), --workdir, --hf "
        "and --config.<key>=<value>.",
    )
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument(
        "--batches", type=int, default=None,
        help="batches to evaluate (default train.eval_batches; 0: every row of the split once)",
    )  # fmt: skip
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    args, rest = parser.parse_known_args(argv)
    try:  # every argument checked before anything loads
        check_arguments(args.batches, args.step)
        run_args, config, where = command_config(rest)
    except ConfigError as e:
        print(f"hetjax eval: config error: {e}", file=sys.stderr)
        return 2
    from hetjax.types import CheckpointError

    workdir = run_args.workdir
    if workdir is None and run_args.hf is None:
        workdir = str(Path("runs") / Path(run_args.config).stem)
    line = f"hetjax eval: {where}; {sources_line(config)}"
    if workdir is not None:
        which = "the newest checkpoint" if args.step is None else f"checkpoint step {args.step}"
        line += f"; weights: {which} in {workdir}"
    print(line)
    try:
        result = evaluate_checkpoint(
            config, workdir, split=args.split, batches=args.batches, step=args.step
        )
    except (ConfigError, CheckpointError) as e:
        print(f"hetjax eval: error: {e}", file=sys.stderr)
        return 1
    what = "completion tokens" if config.data.format == "jsonl" else "tokens"
    t = config.train
    over = f"{result.batches} batches of {t.batch_size} x {t.seq_len}"
    if not result.batches:
        over = f"every row of the split once: {result.rows} rows of {t.seq_len}"
    print(
        f"{result.source}: {args.split} loss {result.loss:.6f} (mean over {what} of {over}), "
        f"perplexity {result.perplexity:.4f}"
    )
    print(json.dumps({"loss": result.loss, "perplexity": result.perplexity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
