"""``hetjax generate``: text from a trained run or a Hugging Face checkpoint, with a KV
cache, in memory or with the blocks streamed from host RAM or NVMe.

    hetjax generate --config llama_tiny --workdir runs/lt --prompt "Once upon a time"
    hetjax generate --hf /path/to/ckpt --prompts prompts.txt --max-new-tokens 64 \\
        --temperature 0.8 --top-p 0.9 --seed 1 --config.offload.mode=stream

Prompts (``--prompt``, repeatable, or ``--prompts FILE``, one a line of UTF-8 text) are
tokenised with ``--tokenizer``, else the run's tokenizer as training used it
(:func:`hetjax.chat.tokenizer_spec`: ``data.tokenizer``, else the weights' HF directory's
``tokenizer.json``, else bytes), left-padded to the longest and run as one batch. The
config is ``--config``, else the workdir's ``config.json`` (``hetjax/cli_config.py``).
Every argument and prompt is checked before the model loads; the first line names the
config, the initial weights and the tokenizer.
Decoding: greedy (``--temperature 0``, the default), or sampling at a temperature,
among the ``--top-k`` most likely tokens and the smallest set whose probability reaches
``--top-p``; the draw of step i is from ``jax.random.fold_in(key(seed), i)``, so a seed
gives the same tokens for the same prompts. A row stops at the tokenizer's
end-of-sequence token. The text is printed as the tokens come (:class:`TokenPrinter`):
one prompt's appended to it; several prompts' on a terminal as one line per prompt,
rewritten in place as its row grows, elsewhere (a pipe, a file) as each step's new text
of each row on a line of its own tagged by the prompt's index (``[1] ' world'``), then
every prompt and its whole text, a line each.

Placement (:class:`InMemoryBlocks`, :class:`StreamedBlocks`): ``offload.mode=none``
holds every param on the device; ``offload.mode=stream`` (or ``auto`` for a model that
does not fit) builds the inference runtime (``runtime/inference.py``): the params, read
once from the checkpoint stage by stage, wait in the training runtime's param store in
the tier ``offload.params`` names (host RAM or NVMe files), with no optimizer state and
no gradients, and each block comes to the device through the same prefetch window
(``offload.prefetch_depth``) once per forward; its plan is printed. The prompt is
prefilled a block at a time over the whole batch, then every new token is one more pass
over the blocks (offloaded inference: its speed is the tier's bandwidth over the
params' bytes per token). The KV cache of every block stays on the device:
(L, B, S, N, K) twice in the compute dtype, S the prompt and the new tokens.

T5 (an encoder-decoder model, :class:`Seq2SeqBlocks`): the prompts, right-padded into
one batch with the padding masked, go through the encoder once; then each new token is
one pass over the decoder's blocks, each against its KV cache (its self-attention's keys
and values so far and its cross-attention's of the encoder's output, computed at the
first token), in memory or streamed as above. A T5 with experts (Switch) runs the whole
model again for every new token (:class:`WholeModel`, no KV cache).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hetjax.config import ConfigError
from hetjax.errors import entry_point
from hetjax.inference import Sampling, check_prompts, open_blocks, run


class TokenPrinter:
    """Prints each row's text as its tokens come (``on_tokens`` of the generation
    loops), to ``out``: one prompt: the prompt, then its text appended; several on a
    terminal (``tty``): one line per prompt, rewritten in place (ANSI: the cursor back
    up to the first row's line, each line cleared and written again, cut to ``width``
    columns until the last step); several elsewhere: a line ``[r] 'piece'`` per row
    with new text each step, then each prompt and its whole text. ``tokens``: decodes
    ids (``instruct.Tokens``); a row's ``eos`` ends it and is not shown."""

    def __init__(self, tokens, texts: list[str], out, tty: bool = False, width: int = 0):
        self.tokens, self.texts, self.out = tokens, texts, out
        self.tty, self.width = tty, width
        self.ids: list[list[int]] = [[] for _ in texts]
        self.ended = [False] * len(texts)
        self.shown = [""] * len(texts)
        if len(texts) == 1:
            out.write(texts[0])
        elif tty:
            self._draw(cut=True, first=True)
        out.flush()

    def __call__(self, step: int, step_tokens) -> None:
        pieces = []
        for r, t in enumerate(step_tokens.tolist()):
            if self.ended[r] or t == self.tokens.eos:  # (an ended row repeats its eos)
                self.ended[r] = True
                pieces.append("")
                continue
            self.ids[r].append(int(t))
            text = self.tokens.decode(self.ids[r])
            pieces.append(text[len(self.shown[r]) :])
            self.shown[r] = text
        if len(self.texts) == 1:
            self.out.write(pieces[0])
        elif self.tty:
            self._draw(cut=True)
        else:
            for r, piece in enumerate(pieces):
                if piece:
                    self.out.write(f"[{r}] {piece!r}\n")
        self.out.flush()

    def _draw(self, cut: bool, first: bool = False) -> None:
        """Every row's line, written again over the last drawing (``first``: none)."""
        if not first:
            self.out.write(f"\x1b[{len(self.texts)}F")  # to the first row's line
        for text, shown in zip(self.texts, self.shown, strict=True):
            line = (text + shown).replace("\n", " ")
            if cut and self.width and len(line) >= self.width:  # wrapped, it would not
                line = "..." + line[len(line) - self.width + 4 :]  # be redrawn in place
            self.out.write(f"\x1b[2K{line}\n")

    def finish(self, rows: list[list[int]]) -> None:
        """The last line(s): each prompt's whole text, ``rows`` its new tokens (all of
        them, those no step showed too)."""
        eos = self.tokens.eos
        final = [self.tokens.decode([t for t in row if t != eos]) for row in rows]
        if len(self.texts) == 1:
            self.out.write(final[0][len(self.shown[0]) :] + "\n")
        elif self.tty:
            self.shown = final
            self._draw(cut=False)
        else:
            for text, whole in zip(self.texts, final, strict=True):
                self.out.write(f"{text}{whole}\n")
        self.out.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.generate",
        description="Generate text from a run's newest checkpoint (--workdir) or an HF "
        "checkpoint directory (--hf, without --workdir). Also takes launch's --config "
        "(default: the workdir's config.json), --workdir, --hf and --config.<key>=<value> "
        "(offload.mode=stream streams the blocks).",
    )
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", default=None, help="a file of prompts, one a line")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a prompts file; ``ConfigError`` naming the file (and the
    line that is not UTF-8)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"--prompts {path!r}: {e.strerror or e}") from None
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--prompts {path} line {n}: not UTF-8 text (byte {e.start} of the line "
                f"is {line[e.start : e.start + 1]!r})"
            ) from None
        if text.strip():
            texts.append(text)
    return texts


def _prepare(argv: list[str]):
    """Every argument checked and the prompts tokenised, nothing of the model loaded:
    (launch's arguments, config, sampling, prompts' texts, their ids, tokens, what the
    first line says). Raises ``ConfigError``."""
    from hetjax.chat import Tokens, sources_line, tokenizer_spec
    from hetjax.cli_config import command_config

    args, rest = _parser().parse_known_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be 1 or more, got {args.max_new_tokens}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    texts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
    if not texts:
        raise ConfigError("give --prompt TEXT (repeatable) or --prompts FILE")
    run_args, config, where = command_config(rest)
    spec = tokenizer_spec(config) if args.tokenizer is None else args.tokenizer
    tokens = Tokens(spec)
    prompts = [tokens.encode(t, special=True) for t in texts]
    check_prompts(prompts, config.model.vocab_size)
    line = f"hetjax generate: {where}; {sources_line(config, spec)}"
    if run_args.workdir:
        line += f"; weights: the newest checkpoint in {run_args.workdir}"
    return args, run_args, config, sampling, texts, prompts, tokens, line


@entry_point("hetjax generate")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, run_args, config, sampling, texts, prompts, tokens, line = _prepare(argv)
    except ConfigError as e:
        print(f"hetjax generate: error: {e}", file=sys.stderr)
        return 2
    from hetjax.types import CheckpointError

    print(line, file=sys.stderr)
    workdir = run_args.workdir
    if workdir is None and run_args.hf is None:
        workdir = str(Path("runs") / Path(run_args.config).stem)
    scratch = Path(tempfile.mkdtemp(prefix="hetjax-generate-"))
    blocks = None
    try:
        blocks, config = open_blocks(config, workdir, scratch)
        print(blocks.describe(), file=sys.stderr)
        tty = sys.stdout.isatty()
        width = shutil.get_terminal_size().columns if tty else 0
        show = TokenPrinter(tokens, texts, sys.stdout, tty, width)
        t0 = time.perf_counter()
        rows = run(blocks, prompts, args.max_new_tokens, sampling, tokens.eos, show)
        elapsed = time.perf_counter() - t0
    except (ConfigError, CheckpointError) as e:
        print(f"hetjax generate: error: {e}", file=sys.stderr)
        return 1
    finally:
        if getattr(blocks, "runtime", None) is not None:
            blocks.runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)
    show.finish(rows)
    n = sum(len(r) for r in rows)
    print(
        f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tokens/s, prefill included)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
