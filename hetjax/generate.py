"""``hetjax generate``: text from a trained run or a Hugging Face checkpoint, with a KV
cache, in memory or with the blocks streamed from host RAM or NVMe.

    hetjax generate --config llama_tiny --workdir runs/lt --prompt "Once upon a time"
    hetjax generate --hf /path/to/ckpt --prompts prompts.txt --max-new-tokens 64 \\
        --temperature 0.8 --top-p 0.9 --seed 1 --config.offload.mode=stream

Prompts (``--prompt``, repeatable, or ``--prompts FILE``, one a line) are tokenised with
the checkpoint's ``tokenizer.json`` (``--tokenizer``; default: the ``--hf`` directory's
when it has one, else ``data.tokenizer``; none: bytes), left-padded to the longest and
run as one batch.
Decoding: greedy (``--temperature 0``, the default), or sampling at a temperature,
among the ``--top-k`` most likely tokens and the smallest set whose probability reaches
``--top-p``; the draw of step i is from ``jax.random.fold_in(key(seed), i)``, so a seed
gives the same tokens for the same prompts. A row stops at the tokenizer's
end-of-sequence token. One prompt: its text is printed as the tokens come; several:
each row's when all are done.

Placement (:class:`InMemoryBlocks`, :class:`StreamedBlocks`): ``offload.mode=none``
holds every param on the device; ``offload.mode=stream`` (or ``auto`` for a model that
does not fit) builds the streaming runtime with the configured tiers and brings each
block's params to the device through its prefetch window, once per forward: the prompt
is prefilled a block at a time over the whole batch, then every new token is one more
pass over the blocks (offloaded inference: its speed is the tiers' bandwidth over the
params' bytes per token). The KV cache of every block stays on the device:
(L, B, S, N, K) twice in the compute dtype, S the prompt and the new tokens.

Decoder-only models (GPT, Llama, Mixtral); T5's decoder is not yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.config import Config, ConfigError

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is chosen from the logits: greedy at temperature 0."""

    temperature: float = 0.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches it
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                f"{self.temperature}, {self.top_k}, {self.top_p}"
            )


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """The next token of each row: logits (B, V) fp32 -> (B,) int32."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]  # (B, 1)
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if s.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1) - jax.nn.softmax(ranked)
        ranked = jnp.where(before < s.top_p, ranked, NEG_INF)  # the first always stays
        logits = (
            jnp.full_like(logits, NEG_INF)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(ranked)
        )
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# -- where the blocks run ---------------------------------------------------------------


class InMemoryBlocks:
    """Every param on the device (in the compute dtype); one jitted forward over the
    stacked blocks (a scan) per call."""

    def __init__(self, model, params):
        self.model = model
        cast = lambda a: jnp.asarray(a, model.config.compute_dtype)
        self.params = jax.tree.map(cast, params)
        self._forward = jax.jit(self._run)

    def describe(self) -> str:
        n = sum(a.size for a in jax.tree.leaves(self.params))
        return f"in memory: {n / 1e6:.2f}M params on {jax.devices()[0].platform}"

    def _run(self, params, ids, positions, cache, valid, start):
        m = self.model
        x = m.decode_input(params["embed"], ids, positions)

        def layer(x, p_k_v):
            p, k, v = p_k_v
            x, (k, v) = m.decode_block(p, x, positions, (k, v, valid, start))
            return x, (k, v)

        x, cache = jax.lax.scan(layer, x, (params["blocks"], *cache))
        logits = m.head_logits(params["head"], params["embed"], x[:, -1:])[:, 0]
        return logits, cache

    def forward(self, ids, positions, cache, valid, start):
        """New tokens (B, T) and their positions through the model against the cache:
        -> (the last position's logits (B, V) fp32, the cache updated)."""
        return self._forward(self.params, ids, positions, cache, valid, jnp.int32(start))


class StreamedBlocks:
    """The blocks brought to the device one at a time by a streaming runtime
    (``runtime.stream_blocks``: its tiers and prefetch window); embed and head resident.
    One jitted function per stage kind; each block's cache is its row of the stacked
    cache."""

    def __init__(self, runtime):
        self.runtime, m = runtime, runtime.model
        self.model = m
        E, H = runtime.layouts["embed"], runtime.layouts["head"]
        B = runtime.layouts[m.groups[0].name]
        self._embed = jax.jit(lambda e, ids, pos: m.decode_input(E.unflatten_pages(e), ids, pos))
        self._block = jax.jit(
            lambda b, x, pos, k, v, valid, start: m.decode_block(
                B.unflatten_pages(b), x, pos, (k, v, valid, start)
            )
        )
        self._head = jax.jit(
            lambda h, e, x: m.head_logits(H.unflatten_pages(h), E.unflatten_pages(e), x)[:, 0]
        )

    def describe(self) -> str:
        return "\n".join(self.runtime.plan_lines())

    def forward(self, ids, positions, cache, valid, start):
        rt, start = self.runtime, jnp.int32(start)
        x = self._embed(rt.resident_pages("embed"), ids, positions)
        ks, vs = list(cache[0]), list(cache[1])

        def step(slot, pages, x):
            x, (ks[slot.index], vs[slot.index]) = self._block(
                pages, x, positions, ks[slot.index], vs[slot.index], valid, start
            )
            return x

        x = rt.stream_blocks(step, x)
        logits = self._head(rt.resident_pages("head"), rt.resident_pages("embed"), x[:, -1:])
        return logits, (ks, vs)


# -- the loop ---------------------------------------------------------------------------


def empty_cache(model, batch: int, length: int, stacked: bool):
    """Zeros for every block's key and value cache: stacked (L, B, S, N, K) (in memory)
    or a list of (B, S, N, K) (streamed), in the compute dtype."""
    shape, L = model.kv_shape(batch, length), model.config.num_layers
    dtype = model.config.compute_dtype
    if stacked:
        return jnp.zeros((L, *shape), dtype), jnp.zeros((L, *shape), dtype)
    return [jnp.zeros(shape, dtype) for _ in range(L)], [jnp.zeros(shape, dtype) for _ in range(L)]


def generate(
    blocks,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: int | None = None,
    on_tokens: Callable[[int, np.ndarray], None] | None = None,
) -> list[list[int]]:
    """Each prompt's new tokens (up to ``max_new_tokens``, ending at ``eos`` where a row
    reaches it). The prompts run as one left-padded batch: the prefill is one forward of
    the whole batch, then one forward per new token. ``on_tokens(i, tokens (B,))`` is
    called as each step's tokens come (rows already ended repeat ``eos``)."""
    model = blocks.model
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate needs at least one prompt, each of at least one token")
    B, P = len(prompts), max(len(p) for p in prompts)
    S = P + max_new_tokens
    limit = model.config.max_seq_len
    if model.config.family == "gpt" and limit < S:
        raise ConfigError(
            f"the longest prompt ({P} tokens) and --max-new-tokens {max_new_tokens} exceed "
            f"model.max_seq_len {limit}, GPT's learned positions"
        )
    lengths = np.array([len(p) for p in prompts])
    pad = P - lengths
    ids = np.zeros((B, P), np.int32)
    for r, p in enumerate(prompts):
        ids[r, pad[r] :] = p
    positions = np.maximum(np.arange(P)[None] - pad[:, None], 0).astype(np.int32)
    valid = np.zeros((B, S), bool)
    valid[:, :P] = np.arange(P)[None] >= pad[:, None]
    cache = empty_cache(model, B, S, stacked=isinstance(blocks, InMemoryBlocks))
    logits, cache = blocks.forward(ids, positions, cache, jnp.asarray(valid), 0)
    key = jax.random.key(sampling.seed)
    pick = jax.jit(lambda logits, i: sample(logits, jax.random.fold_in(key, i), sampling))
    out = np.zeros((B, 0), np.int32)
    ended = np.zeros(B, bool)
    for i in range(max_new_tokens):
        tokens = np.asarray(pick(logits, i))
        if eos is not None:
            tokens = np.where(ended, eos, tokens)
            ended |= tokens == eos
        out = np.concatenate([out, tokens[:, None]], axis=1)
        if on_tokens is not None:
            on_tokens(i, tokens)
        if i + 1 == max_new_tokens or ended.all():
            break
        valid[:, P + i] = True
        pos = (lengths + i)[:, None].astype(np.int32)
        logits, cache = blocks.forward(tokens[:, None], pos, cache, jnp.asarray(valid), P + i)
    rows = []
    for r in range(B):
        row = out[r].tolist()
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


# -- loading ----------------------------------------------------------------------------


def open_blocks(config: Config, workdir=None, scratch: Path | None = None):
    """The blocks of a run's newest checkpoint (``workdir``), or without one the
    initial params (``model.init_from``: an HF checkpoint directory), placed as
    ``config.offload.mode`` says: (blocks, the config used)."""
    from hetjax.evaluate import restore_newest
    from models import build_model

    if config.model.family == "t5":
        raise ConfigError("hetjax generate runs decoder-only models (gpt, llama); not T5 yet")
    state = None
    if workdir is None and not config.model.init_from:
        raise ConfigError("hetjax generate needs --workdir (a run's checkpoints) or --hf <dir>")
    if workdir is not None:
        state, _ = restore_newest(config, workdir)
    if config.offload.mode == "none":
        if state is not None:
            params = state.params()
        else:
            from hetjax.hf import open_checkpoint

            params = open_checkpoint(config.model).params()
        return InMemoryBlocks(build_model(config.model), params), config
    from hetjax.train import build_runtime

    # every expert of a block with it (expert-aware fetching routes a training batch)
    config = config.replace(offload=dict(expert_fetch="all"))
    runtime = build_runtime(config, scratch)
    if state is not None:
        runtime.load_state(state)
    return StreamedBlocks(runtime), config


def _tokenizer(spec: str):
    from hetjax.instruct import Tokens

    return Tokens(spec)


def main(argv: list[str] | None = None) -> int:
    from hetjax import launch

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.generate",
        description="Generate text from a run's newest checkpoint (--workdir) or an HF "
        "checkpoint directory (--hf, without --workdir). Also takes launch's --config, "
        "--workdir, --hf and --config.<key>=<value> (offload.mode=stream streams the blocks).",
    )
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", default=None, help="a file of prompts, one a line")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    try:
        run_args, overrides = launch.parse_args(rest)
        config = launch.run_config(run_args, overrides)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        texts = list(args.prompt)
        if args.prompts:
            texts += [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        if not texts:
            raise ConfigError("give --prompt TEXT (repeatable) or --prompts FILE")
        spec = args.tokenizer
        if spec is None:  # the checkpoint's own, else the data's, else bytes
            hf = run_args.hf
            has = hf and (Path(hf) / "tokenizer.json").is_file()
            spec = hf if has else config.data.tokenizer
        tokens = _tokenizer(spec or "")
    except (ConfigError, OSError) as e:
        print(f"hetjax generate: error: {e}", file=sys.stderr)
        return 2
    from hetjax.types import CheckpointError

    workdir = run_args.workdir
    if workdir is None and run_args.hf is None:
        workdir = str(Path("runs") / Path(run_args.config).stem)
    scratch = Path(tempfile.mkdtemp(prefix="hetjax-generate-"))
    blocks = None
    try:
        blocks, config = open_blocks(config, workdir, scratch)
        print(blocks.describe(), file=sys.stderr)
        prompts = [tokens.encode(t, special=True) for t in texts]
        single = len(prompts) == 1
        if single:
            sys.stdout.write(texts[0])
        shown: list[int] = []

        def show(i, step_tokens):  # one prompt: its text as the tokens come
            if single and step_tokens[0] != tokens.eos:
                before = tokens.decode(shown)
                shown.append(int(step_tokens[0]))
                sys.stdout.write(tokens.decode(shown)[len(before) :])
                sys.stdout.flush()

        t0 = time.perf_counter()
        rows = generate(blocks, prompts, args.max_new_tokens, sampling, tokens.eos, show)
        elapsed = time.perf_counter() - t0
    except (ConfigError, CheckpointError) as e:
        print(f"hetjax generate: error: {e}", file=sys.stderr)
        return 1
    finally:
        if blocks is not None and isinstance(blocks, StreamedBlocks):
            blocks.runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if single:
        sys.stdout.write("\n")
    else:
        for text, row in zip(texts, rows, strict=True):
            print(f"{text}{tokens.decode(row)}")
    n = sum(len(r) for r in rows)
    print(
        f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tokens/s, prefill included)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
