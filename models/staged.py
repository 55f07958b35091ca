"""The staged-model interface every runtime trains, and a base to plug in any Flax blocks.

A model is three *stages* the streaming executor can run one at a time:

  ``embed``   tokens (B, T) int32      -> x (B, T, D) in compute dtype
  ``block``   x (B, T, D)              -> x (B, T, D); ``num_layers`` of them, one
              params structure, stored stacked on a leading layer axis L
  ``head``    x (B, T, D), targets (B, T) -> mean token cross-entropy (fp32 scalar)

:class:`StagedModel` is the protocol (``models.gpt.GPT`` implements it by hand).
:class:`FlaxStages` implements all of it from three Flax modules, so a user-defined
model is a few lines::

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
depend on the layer index (every layer has the same params structure and the same
function). Parameter leaves named ``bias`` or ``scale`` are not weight-decayed
(``hetjax/optim.py``); everything else is.

Blocks the streaming executor keeps (``offload.keep_blocks``) may keep only some
in-block activations (``offload.keep_level``, ``hetjax/remat.py``): ``matmuls`` works
for any block (it keeps the outputs of its dots without batch dimensions); a block that
tags its attention output ``jax.ad_checkpoint.checkpoint_name(attn, "attn_out")`` has it
kept too (calling ``models.attention.attention`` does that), and ``probs`` needs the
probabilities tagged ``"attn_probs"`` (as ``models/attention.py``'s reference attention
does). Tags are identities: they change no result.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.config import ModelConfig

Params = dict[str, Any]


class StagedModel(Protocol):
    """What the runtimes need from a model. All methods are pure functions of params."""

    config: ModelConfig
    stage_names: tuple[str, ...]  # ("embed", "blocks", "head")

    def init(self, rng: jax.Array) -> Params:
        """``{'embed': ..., 'blocks': (each leaf stacked on axis 0, L), 'head': ...}``,
        equal to initialising each stage with its key from :meth:`stage_keys`."""

    def stage_keys(self, rng: jax.Array) -> dict[str, jax.Array]:
        """The init key of each stage; ``blocks`` holds one key per layer (L,)."""

    def init_stage(self, stage: str, key: jax.Array) -> Params:
        """Params of one stage, ``embed``, ``block`` (unstacked) or ``head``."""

    def embed(self, embed_params: Params, tokens: jax.Array) -> jax.Array:
        """tokens (B, T) int32 -> activations (B, T, D) in compute dtype."""

    def block(self, block_params: Params, x: jax.Array) -> jax.Array:
        """One block with unstacked params: (B, T, D) -> (B, T, D)."""

    stats_size: int  # length of the statistics each block returns for the auxiliary loss

    def block_stats(self, block_params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One block and its auxiliary-loss statistics: (B, T, D) -> ((B, T, D), stats
        (stats_size,) fp32, means over the block's tokens)."""

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        """The auxiliary loss (fp32 scalar, added to the token cross-entropy) from the sum
        over blocks of their statistics (stats_size,); 0 when stats_size is 0."""

    def head_loss(
        self, head_params: Params, embed_params: Params, x: jax.Array, targets: jax.Array
    ) -> jax.Array:
        """x (B, T, D), targets (B, T) -> mean token cross-entropy (fp32 scalar).
        ``embed_params`` is there for heads tied to the embedding; others ignore it."""

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        """The whole model: tokens (B, T) -> fp32 logits (B, T, V). Each stage computes
        with its params cast to the compute dtype, as the streaming runtime runs it."""

    def loss(self, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """The whole model's mean token cross-entropy (stages as in :meth:`logits`)."""

    def param_count(self) -> int: ...

    def block_active_params(self) -> int:
        """Params of one block that a token's forward uses (a MoE block: its router,
        attention and only the experts the token is routed to)."""

    def flops_per_token(self, seq_len: int) -> float: ...


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over all tokens: logits (B, T, V) fp32, targets (B, T) int."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


class FlaxStages:
    """A :class:`StagedModel` made of three Flax modules (see the module docstring).

    ``tied``: the name of the embed-stage param (V, D) the head receives as its second
    argument, or None for a head with its own output layer."""

    stage_names = ("embed", "blocks", "head")
    stats_size = 0  # no auxiliary loss: blocks return x alone

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

    # -- init -----------------------------------------------------------------------------

    def init(self, rng: jax.Array) -> Params:
        keys = self.stage_keys(rng)
        return {
            "embed": self.init_stage("embed", keys["embed"]),
            "blocks": jax.vmap(lambda k: self.init_stage("block", k))(keys["blocks"]),
            "head": self.init_stage("head", keys["head"]),
        }

    def stage_keys(self, rng: jax.Array) -> dict[str, jax.Array]:
        k_embed, k_blocks, k_head = jax.random.split(rng, 3)
        blocks = jax.random.split(k_blocks, self.config.num_layers)
        return {"embed": k_embed, "blocks": blocks, "head": k_head}

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
        return self._embed.apply({"params": embed_params}, tokens)

    def block(self, block_params: Params, x: jax.Array) -> jax.Array:
        return self.block_stats(block_params, x)[0]

    def block_stats(self, block_params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = self._block.apply({"params": block_params}, x)
        if self.stats_size:
            return out
        return out, jnp.zeros((0,), jnp.float32)

    def aux_loss(self, stats: jax.Array) -> jax.Array:
        return jnp.float32(0)

    def head_logits(self, head_params: Params, embed_params: Params, x: jax.Array) -> jax.Array:
        """x (B, T, D) -> fp32 logits (B, T, V)."""
        if self.tied is None:
            logits = self._head.apply({"params": head_params}, x)
        else:
            logits = self._head.apply({"params": head_params}, x, embed_params[self.tied])
        return logits.astype(jnp.float32)

    def head_loss(
        self, head_params: Params, embed_params: Params, x: jax.Array, targets: jax.Array
    ) -> jax.Array:
        return token_loss(self.head_logits(head_params, embed_params, x), targets)

    # -- whole model (the in-memory reference) --------------------------------------------
    #
    # The stages compute the same function here as under the streaming runtime, which
    # holds every stage's params in the compute dtype: each stage gets its params cast to
    # ``compute_dtype`` (LayerNorm scales and embeddings too, not only the matmul weights
    # a Flax ``dtype`` casts), and a head tied to the embedding gets a cast of its own, so
    # the two gradients of the tied weight add in fp32 (the streaming runtime adds them on
    # the host), not in the compute dtype. Casts to fp32 are no-ops.

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        c = self._compute
        x, _ = self._run_blocks(c(params["blocks"]), self.embed(c(params["embed"]), tokens))
        return self.head_logits(c(params["head"]), c(params["embed"]), x)

    def loss(self, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        c = self._compute
        x, stats = self._run_blocks(c(params["blocks"]), self.embed(c(params["embed"]), tokens))
        loss = self.head_loss(c(params["head"]), c(params["embed"]), x, targets)
        return loss + self.aux_loss(stats) if self.stats_size else loss

    def _compute(self, params: Params) -> Params:
        """Params (fp32 masters) as a stage computes with them: in ``compute_dtype``."""
        return jax.tree.map(lambda a: a.astype(self.config.compute_dtype), params)

    def _run_blocks(self, blocks: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x (B, T, D) through every block -> (x, the sum of the blocks' statistics)."""
        # remat: keep only block-boundary activations and recompute each block's inside
        # in backward, as the streaming executor does.
        block = jax.checkpoint(self.block_stats) if self.config.remat else self.block_stats

        def step(carry, p):
            h, total = carry
            h, stats = block(p, h)
            return (h, total + stats), None

        stats = jnp.zeros((self.stats_size,), jnp.float32)
        (x, stats), _ = jax.lax.scan(step, (x, stats), blocks)
        return x, stats

    # -- accounting -----------------------------------------------------------------------

    def param_count(self) -> int:
        """Exact number of parameters, from shapes alone (no allocation)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))

    def block_param_count(self) -> int:
        """Params of one block, from shapes alone."""
        shapes = jax.eval_shape(lambda k: self.init_stage("block", k), jax.random.key(0))
        return sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))

    def block_active_params(self) -> int:
        return self.block_param_count()

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token (PaLM appendix B): 6 N for the
        parameters used in matmuls (the embed stage's are lookups, so excluded unless the
        head is tied to them; a MoE block's experts a token is not routed to, too) plus
        12 L T D for attention."""
        cfg = self.config
        n = self.param_count()
        n -= cfg.num_layers * (self.block_param_count() - self.block_active_params())
        if self.tied is None:
            shapes = jax.eval_shape(lambda k: self.init_stage("embed", k), jax.random.key(0))
            n -= sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
        return 6.0 * n + 12.0 * cfg.num_layers * seq_len * cfg.d_model
