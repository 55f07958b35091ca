"""The staged-model interface every runtime trains, and a base to plug in any Flax blocks.

A model is *stages* the streaming runtime can run one at a time: ``embed``, one or more
*stage groups*, each a stack of identical blocks, and ``head``:

  ``embed``   params shared by the groups: the token embedding (and whatever else every
              group's input is made from)
  groups      ``group_input(g, embed params, previous group's output, tokens, targets)
              -> (x (B, T, D), context)`` starts group g; then each of its
              ``num_layers`` blocks maps ``(x, context) -> (x, stats)``. Its params are
              stored stacked on a leading layer axis under the group's key
  ``head``    x (B, T, D), targets (B, T) -> mean token cross-entropy (fp32 scalar)

A decoder-only model (GPT, Llama, any :class:`FlaxStages`) has one group, ``blocks``
(stages ``block0`` .. ``block{L-1}``), whose input is the token embedding and whose
context is empty: the block is ``(B, T, D) -> (B, T, D)``. An encoder-decoder model
(``models/t5.py``) has two: ``encoder`` reads the input tokens; ``decoder`` reads its
own tokens (the targets shifted right) and, in every block, the encoder's output: that
output is part of the decoder's *context*, which every block of the group reads and
whose gradient is the sum over the group's blocks. A group's context may hold params
too (T5's relative position bias table, one per stack, lives in the embed stage and is
handed to every block of its stack); the runtimes only carry it, and add its gradients.

:class:`StagedModel` is the protocol; :class:`Stages` computes the whole model from the
stage functions (the in-memory reference) for any number of groups. :class:`FlaxStages`
implements the one-group case from three Flax modules, so a user-defined model is a few
lines::

    class MyBlock(nn.Module):            # (B, T, D) -> (B, T, D)
        config: ModelConfig
        @nn.compact
        def __call__(self, x): ...

    def make_model(config: ModelConfig) -> FlaxStages:
        return FlaxStages(config, embed=MyEmbed(config), block=MyBlock(config),
                          head=MyHead(config))

and the run config names the factory: ``model.family = "custom"``,
``model.custom = "my_package.my_module:make_model"`` (importable from the run). The
embed module is called as ``embed(tokens)``; the block as ``block(x)``; the head as
``head(x)`` returning fp32 logits (B, T, V), or ``head(x, embedding)`` with
``tied="<embed param name>"``, which hands it that embed-stage param (an output layer
tied to the token embedding). A block with an auxiliary loss (a mixture of experts'
load balancing, models/llama.py) returns ``(x, stats)``, fp32 statistics of fixed length
``stats_size`` (means over its tokens); the model's ``aux_loss(sum of the blocks'
stats)`` is added to the loss, by every runtime, gradients included. Blocks must not
depend on the layer index (every layer of a group has the same params structure and the
same function). Parameter leaves named ``bias`` or ``scale`` are not weight-decayed
(``hetjax/storage/pages.py``); everything else is.

Packed rows (``data.format=jsonl``, ``hetjax/instruct.py``): several short records in
one row, each with its own positions and attending only to itself. The batch carries
them as data: ``tokens`` is then (B, 2, T), the token ids and each token's position in
its record (0 where a record starts, :func:`unpack`), and targets below 0 take no loss
(the prompt, the padding, a record's last token; :func:`token_loss`). A
:class:`FlaxStages` model's first group's context is then the positions (fp32 (B, T),
so the runtimes carry it as any context, its gradient zero) and its modules are called
as ``embed(tokens, positions)`` and ``block(x, positions=positions)``; GPT and Llama
take them (a user's modules that do not cannot train packed rows).

Blocks the streaming runtime keeps (``offload.keep_blocks``) may keep only some
in-block activations (``offload.keep_level``, ``hetjax/runtime/stages/remat.py``): ``matmuls`` works
for any block (it keeps the outputs of its dots without batch dimensions); a block that
tags its attention output ``jax.ad_checkpoint.checkpoint_name(attn, "attn_out")`` has it
kept too (calling ``models.attention.attention`` does that), and ``probs`` needs the
probabilities tagged ``"attn_probs"`` (as ``models/attention.py``'s reference attention
does). Tags are identities: they change no result.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig
from hetjax.types import group_key

Params = dict[str, Any]

# A model's logical axes (MaxText's logical axis annotations, Levanter's named axes): a
# table of (pattern, axis names) whose first pattern matching a leaf's path inside its
# stage (``c_fc/kernel``; matched at a ``/`` boundary, so ``q/kernel`` matches
# ``SelfAttention/q/kernel``) names that leaf's axes, e.g. ``("embed", "mlp")``. A
# placement maps the names to mesh axes (``hetjax/parallel/rules.py``'s ``RULES``).
AxisTable = tuple[tuple[str, tuple[str, ...]], ...]
LAYERS = "layers"  # the leading axis a stage group's blocks are stacked on


def logical_axes(model, shapes: Params | None = None) -> Params:
    """The logical axis names of every param leaf of ``model`` (its ``init`` tree's
    structure; ``shapes``: that tree, abstract or not, if at hand), a tuple per leaf,
    one name per dimension; a group's leaves start with :data:`LAYERS`. From the
    model's ``logical_axes_table``; a model without one (a user's) names none of its
    axes (None each: whole on every device under any rules). A leaf no pattern matches,
    or one of another rank than its names, is an error: the table must cover the
    model."""
    table: AxisTable = getattr(model, "logical_axes_table", ())
    if shapes is None:
        shapes = jax.eval_shape(model.init, jax.random.key(0))
    group_keys = {g.key for g in model.groups}

    def names(path, leaf) -> tuple[str | None, ...]:
        keys = [str(getattr(k, "key", k)) for k in path]
        stacked = keys[0] in group_keys
        rank = len(leaf.shape) - stacked
        if not table:
            found: tuple[str | None, ...] = (None,) * rank
        else:
            inner = "/".join(keys[1:])
            found = next(
                (axes for pattern, axes in table if re.fullmatch(f"(?:.*/)?(?:{pattern})", inner)),
                None,
            )
            if found is None or len(found) != rank:
                raise ValueError(
                    f"{type(model).__name__}'s logical_axes_table "
                    + (f"names {found} for" if found else "has no pattern matching")
                    + f" param {'/'.join(keys)} of shape {tuple(leaf.shape)}"
                )
        return (LAYERS, *found) if stacked else tuple(found)

    return jax.tree_util.tree_map_with_path(names, shapes)


@dataclasses.dataclass(frozen=True)
class StageGroup:
    """A stack of ``num_layers`` identical blocks: stages ``{name}0`` .. , slab layout
    ``name``, params under :attr:`key` in the model's tree, stacked on a leading axis."""

    name: str  # "block" (a decoder-only model's one group), "encoder", "decoder"
    num_layers: int

    @property
    def key(self) -> str:
        """The group's params in the model's tree: ``blocks`` for ``block``, else the
        name (``hetjax.types.group_key``)."""
        return group_key(self.name)

    def stage(self, i: int) -> str:
        return f"{self.name}{i}"


class StagedModel(Protocol):
    """What the runtimes need from a model. All methods are pure functions of params."""

    config: ModelConfig
    groups: tuple[StageGroup, ...]  # in forward order
    stats_size: int  # length of the statistics each block returns for the auxiliary loss

    def init(self, rng: jax.Array) -> Params:
        """``{'embed': ..., <each group's key>: (each leaf stacked on axis 0, L), 'head':
        ...}``, equal to initialising each stage with its key from :meth:`stage_keys`."""

    def stage_keys(self, rng: jax.Array) -> dict[str, jax.Array]:
        """The init key of each stage; a group's key holds one key per layer (L,)."""

    def init_stage(self, stage: str, key: jax.Array) -> Params:
        """Params of one stage: ``embed``, one block of a group (by the group's name,
        unstacked) or ``head``."""

    def group_input(
        self, g: int, embed_params: Params, prev: jax.Array | None, tokens, targets
    ) -> tuple[jax.Array, Any]:
        """Group g's input (B, T, D) in compute dtype and its context (a pytree every
        block of the group reads), from the embed params, the previous group's output
        ``prev`` (None for the first group), tokens and targets (B, T) int32."""

    def group_block(
        self, g: int, block_params: Params, x: jax.Array, context: Any
    ) -> tuple[jax.Array, jax.Array]:
        """One block of group g with unstacked params: x (B, T, D) and the group's
        context -> ((B, T, D), stats (stats_size,) fp32, means over the block's tokens)."""

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        """The auxiliary loss (fp32 scalar, added to the token cross-entropy) from the sum
        over blocks of their statistics (stats_size,); 0 when stats_size is 0."""

    def head_loss(
        self, head_params: Params, embed_params: Params, x: jax.Array, targets: jax.Array
    ) -> jax.Array:
        """x (B, T, D), targets (B, T) -> mean token cross-entropy (fp32 scalar).
        ``embed_params`` is there for heads tied to the embedding; others ignore it."""

    def logits(self, params: Params, tokens: jax.Array, targets: jax.Array | None = None):
        """The whole model: tokens (B, T) -> fp32 logits (B, T, V) (an encoder-decoder
        model's decoder reads the targets shifted right). Each stage computes with its
        params cast to the compute dtype, as the streaming runtime runs it."""

    def loss(self, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """The whole model's mean token cross-entropy (stages as in :meth:`logits`)."""

    def param_count(self) -> int: ...

    def group_active_params(self, g: int) -> int:
        """Params of one block of group g that a token's forward uses (a MoE block: its
        router, attention and only the experts the token is routed to)."""

    def flops_per_token(self, seq_len: int) -> float: ...


IGNORED = -1  # a target that takes no loss (a packed row's prompt, padding)


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over the tokens that take a loss: logits (B, T, V) fp32,
    targets (B, T) int, those below 0 (:data:`IGNORED`) weighted 0. Without such targets
    it is the mean over every token; with no token taking a loss, 0."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    taken = targets >= 0
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    loss = jnp.where(taken, logz - picked, 0.0)  # (B, T)
    return jnp.sum(loss) / jnp.maximum(jnp.sum(taken), 1).astype(jnp.float32)


def unpack(tokens: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A batch's tokens -> (token ids (B, T), positions (B, T) or None): a packed row's
    tokens are (B, 2, T), ids and each token's position in its record."""
    if tokens.ndim == 3:
        return tokens[:, 0], tokens[:, 1]
    return tokens, None


def segment_ids(positions: jax.Array) -> jax.Array:
    """A packed row's positions (B, T) -> the record each token belongs to (B, T) int32:
    a record starts where its position is 0."""
    return jnp.cumsum(positions.astype(jnp.int32) == 0, axis=-1)


class Stages:
    """The whole model from its stage functions, for any stage groups: init, the
    in-memory reference's logits and loss, and accounting. A subclass sets ``config``,
    ``groups`` and ``tied`` (the embed-stage param a tied head reads, or None) and
    implements ``init_stage``, ``group_input``, ``group_block`` and ``head_logits``."""

    groups: tuple[StageGroup, ...]
    stats_size = 0  # no auxiliary loss: blocks return empty statistics
    # blocks can stream only the experts their tokens are routed to (models/llama.py's
    # and models/t5.py's route and routed_block; hetjax/runtime/experts/routed.py), whose expert
    # leaves are ``.../moe/<one of expert_params>``, the experts on their first axis
    expert_routing = False
    expert_params: tuple[str, ...] = ()
    tied: str | None = None
    # the logical axes of the params (:func:`logical_axes`); empty: none named
    logical_axes_table: AxisTable = ()

    # -- init -----------------------------------------------------------------------------

    def init(self, rng: jax.Array) -> Params:
        keys = self.stage_keys(rng)
        params = {"embed": self.init_stage("embed", keys["embed"])}
        for group in self.groups:
            init_block = lambda k, name=group.name: self.init_stage(name, k)
            params[group.key] = jax.vmap(init_block)(keys[group.key])
        params["head"] = self.init_stage("head", keys["head"])
        return params

    def stage_keys(self, rng: jax.Array) -> dict[str, jax.Array]:
        k_embed, *k_groups, k_head = jax.random.split(rng, 2 + len(self.groups))
        keys = {"embed": k_embed}
        for group, key in zip(self.groups, k_groups, strict=True):
            keys[group.key] = jax.random.split(key, group.num_layers)
        keys["head"] = k_head
        return keys

    # -- stages ---------------------------------------------------------------------------

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        return jnp.float32(0)

    def is_expert(self, path: tuple[str, ...]) -> bool:
        """Whether the block param at ``path`` (its keys) is an expert leaf: ``.../moe/
        <name>`` for ``name`` in ``expert_params``, the experts on its first axis."""
        return len(path) >= 2 and path[-2] == "moe" and path[-1] in self.expert_params

    def head_loss(
        self, head_params: Params, embed_params: Params, x: jax.Array, targets: jax.Array
    ) -> jax.Array:
        return token_loss(self.head_logits(head_params, embed_params, x), targets)

    # -- whole model (the in-memory reference) --------------------------------------------
    #
    # The stages compute the same function here as under the streaming runtime, which
    # holds every stage's params in the compute dtype: each stage gets its params cast to
    # ``compute_dtype`` (LayerNorm scales and embeddings too, not only the matmul weights
    # a Flax ``dtype`` casts). Each use of the embed stage (every group's input, a head
    # tied to it) gets a cast of its own, so their gradients add in fp32 (the streaming
    # runtime adds them on the host), not in the compute dtype. Casts to fp32 are no-ops.

    def logits(self, params: Params, tokens: jax.Array, targets: jax.Array | None = None):
        x, _ = self._forward(params, tokens, targets)
        c = self._compute
        return self.head_logits(c(params["head"]), c(params["embed"]), x)

    def loss(self, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        x, stats = self._forward(params, tokens, targets)
        c = self._compute
        loss = self.head_loss(c(params["head"]), c(params["embed"]), x, targets)
        return loss + self.aux_loss(stats) if self.stats_size else loss

    def _forward(self, params: Params, tokens, targets) -> tuple[jax.Array, jax.Array]:
        """Every group in turn -> (the last group's output (B, T, D), the sum of every
        block's statistics)."""
        c = self._compute
        x, stats = None, jnp.zeros((self.stats_size,), jnp.float32)
        for g, group in enumerate(self.groups):
            x, context = self.group_input(g, c(params["embed"]), x, tokens, targets)
            x, group_stats = self._run_group(g, c(params[group.key]), x, context)
            stats = stats + group_stats
        return x, stats

    def _compute(self, params: Params) -> Params:
        """Params (fp32 masters) as a stage computes with them: in ``compute_dtype``."""
        return jax.tree.map(lambda a: a.astype(self.config.compute_dtype), params)

    def _run_group(
        self, g: int, blocks: Params, x: jax.Array, context
    ) -> tuple[jax.Array, jax.Array]:
        """x (B, T, D) through every block of group g -> (x, the sum of the blocks'
        statistics). The context is a constant of the loop: its gradient is the sum of
        the blocks'."""
        # remat: keep only block-boundary activations and recompute each block's inside
        # in backward, as the streaming runtime does.
        block = lambda p, h: self.group_block(g, p, h, context)
        block = jax.checkpoint(block) if self.config.remat else block

        def step(carry, p):
            h, total = carry
            h, stats = block(p, h)
            return (h, total + stats), None

        stats = jnp.zeros((self.stats_size,), jnp.float32)
        (x, stats), _ = jax.lax.scan(step, (x, stats), blocks)
        return x, stats

    def abstract_inputs(self, batch: int, seq_len: int) -> list[tuple[Any, Any]]:
        """Each group's (x, context) for a micro-batch (batch, seq_len), as abstract
        shapes in the compute dtype (``jax.eval_shape``): nothing is allocated."""
        dtype = jnp.dtype(self.config.compute_dtype)
        embed = jax.eval_shape(lambda k: self.init_stage("embed", k), jax.random.key(0))
        embed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), embed)
        tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
        x, inputs = None, []
        for g in range(len(self.groups)):
            x, context = jax.eval_shape(
                lambda e, p, t, g=g: self.group_input(g, e, p, t, t), embed, x, tokens
            )
            inputs.append((x, context))
        return inputs

    # -- accounting -----------------------------------------------------------------------

    def param_count(self) -> int:
        """Exact number of parameters, from shapes alone (no allocation)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))

    def stage_param_count(self, stage: str) -> int:
        """Params of one stage (``embed``, one block of a group by its name, ``head``),
        from shapes alone."""
        shapes = jax.eval_shape(lambda k: self.init_stage(stage, k), jax.random.key(0))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))

    def block_param_count(self, g: int = 0) -> int:
        """Params of one block of group g, from shapes alone."""
        return self.stage_param_count(self.groups[g].name)

    def group_active_params(self, g: int) -> int:
        return self.block_param_count(g)

    def attention_layers(self) -> int:
        """Attention layers a token passes through (each of a block's attentions, over
        every group), for the FLOPs' attention term."""
        return sum(group.num_layers for group in self.groups)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token (PaLM appendix B): 6 N for the
        parameters used in matmuls (the embed stage's are lookups, so excluded unless the
        head is tied to them; a MoE block's experts a token is not routed to, too) plus
        12 T D per attention layer (each of a block's attentions)."""
        cfg = self.config
        n = self.param_count()
        for g, group in enumerate(self.groups):
            n -= group.num_layers * (self.block_param_count(g) - self.group_active_params(g))
        if self.tied is None:
            n -= self.stage_param_count("embed")
        return 6.0 * n + 12.0 * self.attention_layers() * seq_len * cfg.d_model

    def block_flops_per_row(self, seq_len: int, target_len: int | None = None) -> float:
        """FLOPs of forward + backward of every block for one batch row of ``seq_len``
        tokens (:meth:`flops_per_token`'s block terms; ``target_len``: a decoder's own
        length, for a model that has one)."""
        active = sum(g.num_layers * self.group_active_params(i) for i, g in enumerate(self.groups))
        attention = 12.0 * self.attention_layers() * seq_len**2 * self.config.d_model
        return 6.0 * active * seq_len + attention

    def flops_per_row(self, seq_len: int, target_len: int | None = None) -> float:
        """Model FLOPs of forward + backward of one batch row: :meth:`flops_per_token`
        x ``seq_len``, or, for an encoder-decoder model whose decoder reads
        ``target_len`` tokens, the blocks' FLOPs at both lengths (:meth:`block_flops_per_row`)
        and the head's at the decoder's."""
        whole = self.flops_per_token(seq_len) * seq_len
        if target_len is None or target_len == seq_len:
            return whole
        head = (whole - self.block_flops_per_row(seq_len)) / seq_len  # per decoder token
        return self.block_flops_per_row(seq_len, target_len) + head * target_len


def row_flops(model, seq_len: int, target_len: int) -> float:
    """Model FLOPs of forward + backward of one batch row (``Stages.flops_per_row``); a
    user's model without it is decoder-only: ``flops_per_token(seq_len) x seq_len``."""
    if hasattr(model, "flops_per_row"):
        return model.flops_per_row(seq_len, target_len)
    return model.flops_per_token(seq_len) * seq_len


class FlaxStages(Stages):
    """A :class:`StagedModel` made of three Flax modules (see the module docstring): one
    group of blocks, ``blocks``, whose input is the embedding and whose context is empty.

    ``tied``: the name of the embed-stage param (V, D) the head receives as its second
    argument, or None for a head with its own output layer."""

    def __init__(
        self,
        config: ModelConfig,
        embed: nn.Module,
        block: nn.Module,
        head: nn.Module,
        tied: str | None = None,
    ):
        self.config = config
        self._embed, self._block, self._head = embed, block, head
        self.tied = tied
        self.groups = (StageGroup("block", config.num_layers),)

    def init_stage(self, stage: str, key: jax.Array) -> Params:
        cfg = self.config
        x = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
        if stage == "embed":
            return self._embed.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        if stage == "block":
            return self._block.init(key, x)["params"]
        if stage == "head":
            if self.tied is None:
                return self._head.init(key, x)["params"]
            embedding = jnp.zeros((cfg.vocab_size, cfg.d_model), cfg.param_dtype)
            return self._head.init(key, x, embedding)["params"]
        raise ValueError(f"unknown stage {stage!r}")

    # -- stages ---------------------------------------------------------------------------

    def embed(self, embed_params: Params, tokens: jax.Array) -> jax.Array:
        """tokens (B, T) int32 -> activations (B, T, D) in compute dtype."""
        return self._embed.apply({"params": embed_params}, tokens)

    def group_input(self, g: int, embed_params: Params, prev, tokens, targets):
        ids, positions = unpack(tokens)
        if positions is None:
            return self.embed(embed_params, ids), ()
        x = self._embed.apply({"params": embed_params}, ids, positions)
        return x, positions.astype(jnp.float32)  # the context: a packed row's positions

    def block(self, block_params: Params, x: jax.Array) -> jax.Array:
        """One block with unstacked params: (B, T, D) -> (B, T, D)."""
        return self.block_stats(block_params, x)[0]

    def block_stats(self, block_params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One block and its auxiliary-loss statistics: (B, T, D) -> ((B, T, D), stats
        (stats_size,) fp32, means over the block's tokens)."""
        out = self._block.apply({"params": block_params}, x)
        if self.stats_size:
            return out
        return out, jnp.zeros((0,), jnp.float32)

    def group_block(self, g: int, block_params: Params, x: jax.Array, context):
        if not isinstance(context, tuple):  # a packed row's positions
            out = self._block.apply({"params": block_params}, x, **self._positions(context))
            return out if self.stats_size else (out, jnp.zeros((0,), jnp.float32))
        return self.block_stats(block_params, x)

    # -- generation (hetjax/generate.py) -------------------------------------------------

    def decode_input(self, embed_params: Params, ids: jax.Array, positions: jax.Array):
        """Generation's embedding of new tokens: ids and their positions (B, T) int32
        -> (B, T, D)."""
        return self._embed.apply({"params": embed_params}, ids, positions)

    def decode_block(self, block_params: Params, x: jax.Array, positions: jax.Array, cache):
        """One block over new positions against its KV cache (``cache``: see
        ``models.attention.cached_attention``): -> (x (B, T, D), (k, v) cache updated).
        The block must take ``positions=`` and ``cache=`` (GPT's and Llama's do)."""
        return self._block.apply({"params": block_params}, x, positions=positions, cache=cache)

    def kv_shape(self, batch: int, length: int) -> tuple[int, ...]:
        """One block's key (or value) cache: (B, S, N, K)."""
        cfg = self.config
        return (batch, length, cfg.kv_heads, cfg.head_dim)

    @staticmethod
    def _positions(context) -> dict:
        """The block's keyword arguments for its group's context: a packed row's
        positions (B, T) int32, or none."""
        return {} if isinstance(context, tuple) else {"positions": context.astype(jnp.int32)}

    def head_logits(self, head_params: Params, embed_params: Params, x: jax.Array) -> jax.Array:
        """x (B, T, D) -> fp32 logits (B, T, V)."""
        if self.tied is None:
            logits = self._head.apply({"params": head_params}, x)
        else:
            logits = self._head.apply({"params": head_params}, x, embed_params[self.tied])
        return logits.astype(jnp.float32)

    def block_active_params(self) -> int:
        """Params of one block that a token's forward uses (a MoE block: its router,
        attention and only the experts the token is routed to)."""
        return self.block_param_count()

    def group_active_params(self, g: int) -> int:
        return self.block_active_params()

    def _run_blocks(self, blocks: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x (B, T, D) through every block -> (x, the sum of the blocks' statistics)."""
        return self._run_group(0, blocks, x, ())


def split_experts(block: dict, names: tuple[str, ...]) -> tuple[dict, dict]:
    """A MoE block's params -> (the rest, its experts): the leaves ``.../moe/<name>`` for
    ``name`` in ``names`` (the model's ``expert_params``, as ``is_expert`` reads them; a
    Llama's ``moe`` is at the block's top, a T5's under ``sparse``), each with the
    experts on its leading axis, in the same nesting. Works on any pytree leaves
    (arrays, shapes)."""
    rest, experts = {}, {}
    for key, value in block.items():
        if not isinstance(value, dict):
            rest[key] = value
            continue
        if key == "moe":
            rest[key] = {k: v for k, v in value.items() if k not in names}
            found = {k: value[k] for k in names if k in value}
        else:
            rest[key], found = split_experts(value, names)
        if found:
            experts[key] = found
    return rest, experts


def join_experts(rest: dict, experts: dict) -> dict:
    """The inverse of :func:`split_experts`."""
    out = dict(rest)
    for key, found in experts.items():
        out[key] = {**rest[key], **found} if key == "moe" else join_experts(rest[key], found)
    return out
