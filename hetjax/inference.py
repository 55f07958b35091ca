"""Generation (``hetjax generate``, hetjax/generate.py): sampling, a KV cache, and where
the blocks run. See hetjax/generate.py's docstring for the command and the placements.

:class:`InMemoryBlocks` holds every param on the device; :class:`StreamedBlocks` brings
each block to the device once per forward through the inference runtime
(``runtime/inference.InferenceRuntime.stream_blocks``: the training runtime's param
store and prefetch window, no optimizer state, no gradients); :class:`Seq2SeqBlocks` runs an
encoder-decoder model (dense T5) with a KV cache, :class:`WholeModel` a Switch T5 whole
for every new token (no KV cache). :func:`generate` and
:func:`generate_seq2seq` are the loops; :func:`open_blocks` builds the blocks of a run's
checkpoint or an HF directory as ``offload.mode`` places them.
"""

from __future__ import annotations

import dataclasses
import functools
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


@functools.partial(jax.jit, static_argnums=3)
def _pick(logits: jax.Array, seed, step, sampling: Sampling) -> jax.Array:
    """Step ``step``'s tokens: drawn with ``fold_in(key(seed), step)`` (compiled once
    per sampling setting, not per call)."""
    return sample(logits, jax.random.fold_in(jax.random.key(seed), step), sampling)


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
    """The blocks brought to the device one at a time by an inference runtime
    (``runtime/inference.InferenceRuntime.stream_blocks``: its tier and prefetch
    window); embed and head resident. One jitted function per stage kind; each block's
    cache is its row of the stacked cache."""

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

        def step(i, pages, x):
            x, (ks[i], vs[i]) = self._block(pages, x, positions, ks[i], vs[i], valid, start)
            return x

        x = rt.stream_blocks(step, x)
        logits = self._head(rt.resident_pages("head"), rt.resident_pages("embed"), x[:, -1:])
        return logits, (ks, vs)


class WholeModel:
    """An encoder-decoder model (T5) run whole for every new token (no KV cache):
    ``logits(tokens (B, P), targets (B, N))`` -> fp32 (B, N, V), in memory or, given an
    inference runtime, each stage group's input then its blocks through the runtime's
    window (``stream_blocks``)."""

    def __init__(self, model, params=None, runtime=None):
        self.model, self.runtime = model, runtime
        if runtime is None:
            cast = lambda a: jnp.asarray(a, model.config.compute_dtype)
            self.params = jax.tree.map(cast, params)
            self._logits = jax.jit(model.logits)
            return
        L = runtime.layouts
        E, H = L["embed"], L["head"]
        self._input = [
            jax.jit(
                lambda e, prev, t, y, g=g: model.group_input(g, E.unflatten_pages(e), prev, t, y)
            )
            for g in range(len(model.groups))
        ]
        self._block = [
            jax.jit(
                lambda b, x, c, g=g, B=L[grp.name]: model.group_block(
                    g, B.unflatten_pages(b), x, c
                )[0]
            )
            for g, grp in enumerate(model.groups)
        ]
        self._head = jax.jit(
            lambda h, e, x: model.head_logits(H.unflatten_pages(h), E.unflatten_pages(e), x)
        )

    def describe(self) -> str:
        if self.runtime is not None:
            return "\n".join(self.runtime.plan_lines())
        n = sum(a.size for a in jax.tree.leaves(self.params))
        return f"in memory: {n / 1e6:.2f}M params on {jax.devices()[0].platform} (no KV cache)"

    def logits(self, tokens: np.ndarray, targets: np.ndarray) -> jax.Array:
        if self.runtime is None:
            return self._logits(self.params, tokens, targets)
        rt = self.runtime
        embed, x = rt.resident_pages("embed"), None
        for g in range(len(self._block)):
            x, context = self._input[g](embed, x, tokens, targets)
            x = rt.stream_blocks(
                lambda i, pages, x, g=g, c=context: self._block[g](pages, x, c), x, g
            )
        return self._head(rt.resident_pages("head"), embed, x)


class _InMemory:
    """Params on the device served as the inference runtime serves pages: each group's
    blocks in turn (:meth:`stream_blocks`), embed and head resident."""

    def __init__(self, model, params):
        cast = lambda a: jnp.asarray(a, model.config.compute_dtype)
        params = jax.tree.map(cast, params)
        self.resident = {s: params[s] for s in ("embed", "head")}
        self.groups = [
            [jax.tree.map(lambda a, i=i: a[i], params[g.key]) for i in range(g.num_layers)]
            for g in model.groups
        ]
        self.size = sum(a.size for a in jax.tree.leaves(params))

    def stream_blocks(self, step, carry, group: int):
        for i, block in enumerate(self.groups[group]):
            carry = step(i, block, carry)
        return carry

    def resident_pages(self, stage: str):
        return self.resident[stage]


class Seq2SeqBlocks:
    """An encoder-decoder model (dense T5) with a KV cache: the prompts encoded once
    (the encoder's blocks in turn), then each new token one pass over the decoder's
    blocks, each against its caches (its self-attention's keys and values so far, and
    its cross-attention's of the encoder's output, computed at the first token). The
    blocks in memory (``params``) or brought through an inference runtime's window
    (``runtime``); embed and head resident."""

    def __init__(self, model, params=None, runtime=None):
        self.model, self.runtime = model, runtime
        self.source = runtime if runtime is not None else _InMemory(model, params)
        if runtime is None:
            E = H = Benc = Bdec = lambda p: p
        else:
            L = runtime.layouts
            E, H = L["embed"].unflatten_pages, L["head"].unflatten_pages
            Benc, Bdec = (L[g.name].unflatten_pages for g in model.groups)
        m = model
        self._enc_input = jax.jit(lambda e, t: m.group_input(0, E(e), None, t, None))
        self._enc_block = jax.jit(lambda b, x, c: m.group_block(0, Benc(b), x, c)[0])
        self._context = jax.jit(lambda e, out, t: m.decode_context(E(e), out, t))
        self._embed = jax.jit(lambda e, ids: m.decode_input(E(e), ids))
        self._dec_block = jax.jit(
            lambda b, x, i, cache, c, first: m.decode_block(Bdec(b), x, i, cache, c, first),
            static_argnums=5,
        )
        self._head = jax.jit(lambda h, e, x: m.head_logits(H(h), E(e), x)[:, 0])

    def describe(self) -> str:
        if self.runtime is not None:
            return "\n".join(self.runtime.plan_lines())
        n = self.source.size
        return f"in memory: {n / 1e6:.2f}M params on {jax.devices()[0].platform}"

    def encode(self, tokens: np.ndarray):
        """The prompts (B, 2, P) (ids, positions) -> the decoder's context."""
        src = self.source
        embed = src.resident_pages("embed")
        x, context = self._enc_input(embed, tokens)
        x = src.stream_blocks(lambda i, b, x: self._enc_block(b, x, context), x, 0)
        return self._context(embed, x, tokens)

    def step(self, ids: np.ndarray, i: int, caches: list, context):
        """New tokens (B, 1) at decoder position ``i`` -> (logits (B, V) fp32, the
        decoder blocks' caches updated)."""
        src, caches = self.source, list(caches)
        embed = src.resident_pages("embed")

        def block(j, b, x):
            x, caches[j] = self._dec_block(b, x, jnp.int32(i), caches[j], context, i == 0)
            return x

        x = src.stream_blocks(block, self._embed(embed, ids), 1)
        return self._head(src.resident_pages("head"), embed, x), caches


def generate_seq2seq(
    blocks,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: int | None = None,
    on_tokens: Callable[[int, np.ndarray], None] | None = None,
) -> list[list[int]]:
    """:func:`generate` for an encoder-decoder model: the decoder's tokens after its
    start token. The prompts run as one batch, right-padded, the padding masked
    (``models.t5.row_records``); with :class:`Seq2SeqBlocks` the encoder runs once and
    each step is one decoder pass against the KV cache, with :class:`WholeModel` each
    step runs the whole model over the prompts and the tokens so far."""
    model = blocks.model
    _check_prompts(model, prompts)
    B, P = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((B, 2, P), np.int32)  # ids, positions (the padding's from 0 again)
    for r, p in enumerate(prompts):
        tokens[r, 0, : len(p)] = p
        tokens[r, 1] = np.concatenate([np.arange(len(p)), np.arange(P - len(p))])
    if isinstance(blocks, Seq2SeqBlocks):
        context = blocks.encode(tokens)
        L, cfg = model.groups[1].num_layers, model.config
        dtype = cfg.compute_dtype
        kv = lambda: jnp.zeros((B, max_new_tokens, cfg.num_heads, cfg.head_dim), dtype)
        caches = [(kv(), kv(), None, None) for _ in range(L)]
        ids = np.full((B, 1), cfg.decoder_start_token, np.int32)
    else:
        targets = np.zeros((B, max_new_tokens), np.int32)
    ended = np.zeros(B, bool)
    out = np.zeros((B, max_new_tokens), np.int32)
    for i in range(max_new_tokens):
        if isinstance(blocks, Seq2SeqBlocks):
            logits, caches = blocks.step(ids, i, caches, context)
        else:
            logits = blocks.logits(tokens, targets)[:, i]  # position i predicts token i
        step = np.asarray(_pick(logits, np.int32(sampling.seed), np.int32(i), sampling))
        if eos is not None:
            step = np.where(ended, eos, step)
            ended |= step == eos
        out[:, i] = step
        if isinstance(blocks, Seq2SeqBlocks):
            ids = step[:, None]
        else:
            targets[:, i] = step
        if on_tokens is not None:
            on_tokens(i, step)
        if ended.all():
            break
    return _rows(out[:, : i + 1], eos)


def _check_prompts(model, prompts: list[list[int]]) -> None:
    check_prompts(prompts, model.config.vocab_size)


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Refuses no prompt, an empty one, or a token id outside the model's vocabulary."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate needs at least one prompt, each of at least one token")
    top = max(max(p) for p in prompts)
    if top >= vocab_size:
        raise ConfigError(
            f"a prompt holds token id {top}, outside the model's vocabulary "
            f"(model.vocab_size {vocab_size}): the tokenizer is not the model's"
        )


def _rows(out: np.ndarray, eos: int | None) -> list[list[int]]:
    """Each row's tokens, up to and including its first ``eos``."""
    rows = []
    for row in out.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


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
    _check_prompts(model, prompts)
    B, P = len(prompts), max(len(p) for p in prompts)
    S = P + max_new_tokens
    limit = model.config.max_seq_len
    if model.config.family == "gpt" and limit < S:
        raise ConfigError(
            f"the longest prompt ({P} tokens) and --max-new-tokens {max_new_tokens} exceed "
            f"model.max_seq_len {limit}, GPT's learned positions"
        )
    window = model.config.sliding_window
    if window and window < S:
        raise ConfigError(
            f"the longest prompt ({P} tokens) and --max-new-tokens {max_new_tokens} exceed "
            f"model.sliding_window {window}: hetjax's attention has no window, equal to "
            "it only within its length; shorten the prompt or --max-new-tokens"
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
    pick = lambda logits, i: _pick(logits, np.int32(sampling.seed), np.int32(i), sampling)
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
    return _rows(out, eos)


# -- loading ----------------------------------------------------------------------------


def open_blocks(config: Config, workdir=None, scratch: Path | None = None):
    """The blocks of a run's newest checkpoint (``workdir``), or without one the
    initial params (``model.init_from``: an HF checkpoint directory), placed as
    ``config.offload.mode`` says: (blocks, the config used)."""
    from hetjax.checkpoint import restore_newest
    from models import build_model

    state = None
    if workdir is None and not config.model.init_from:
        raise ConfigError("hetjax generate needs --workdir (a run's checkpoints) or --hf <dir>")
    if workdir is not None:
        state, _ = restore_newest(config, workdir)
    seq2seq = config.model.encoder_decoder
    if config.offload.mode == "auto":  # where the planner puts a training run of it
        from hetjax.planning.auto import resolve_auto

        config = resolve_auto(config, scratch)
    if config.offload.mode == "none":
        if state is not None:
            params = state.params()
        else:
            from hetjax.hf import open_checkpoint

            params = open_checkpoint(config.model).params()
        model = build_model(config.model)
        if seq2seq and model.config.num_experts:  # a Switch T5: no KV cache
            return WholeModel(model, params), config
        if seq2seq:
            return Seq2SeqBlocks(model, params), config
        return InMemoryBlocks(model, params), config
    from hetjax.runtime.inference import InferenceRuntime

    runtime = InferenceRuntime(config, state, scratch)
    if seq2seq and config.model.num_experts:
        return WholeModel(runtime.model, runtime=runtime), config
    if seq2seq:
        return Seq2SeqBlocks(runtime.model, runtime=runtime), config
    return StreamedBlocks(runtime), config


def run(blocks, prompts, max_new_tokens, sampling=Sampling(), eos=None, on_tokens=None):
    """:func:`generate` or, for an encoder-decoder model, :func:`generate_seq2seq`."""
    go = generate_seq2seq if isinstance(blocks, WholeModel | Seq2SeqBlocks) else generate
    return go(blocks, prompts, max_new_tokens, sampling, eos, on_tokens)
