"""The model and batch as the planner sees them: stage sizes, activation sizes, FLOPs and
stage times (measured by the tracer, or derived from a hardware profile's FLOP/s)."""

from __future__ import annotations

import dataclasses
import math

import jax

from hetjax import support
from hetjax.config import Config, ConfigError
from hetjax.data import decoder_length
from hetjax.memory import Sizes, block_grad_dtype, grad_policy, zero3_scatter_bytes
from hetjax.optimizer.deferred import deferrable
from hetjax.parallel.grouped import GroupedSlabLayout, axes_of, scattered_elements
from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.rules import DATA_AXIS, EXPERT_AXIS, MODEL_AXIS
from hetjax.planning.hardware import Hardware
from hetjax.planning.traced import keep, param_shapes, vjp_kept
from hetjax.planning.working_set import block_attention, estimate_working_set
from hetjax.runtime.experts.routed import expert_leaves
from hetjax.runtime.stages.measure import context_bytes
from hetjax.state_format import StateFormat, state_format
from models import build_model
from models.staged import row_flops, split_experts

# offload.batch_chunks the planner tries (those that divide a device's rows)
CHUNK_COUNTS = (1, 2, 4, 8, 16)


def kept_key(level: str) -> str:
    """The stage time of a kept block's backward at keep ``level``."""
    return "block_bwd_kept" if level == "all" else f"block_bwd_kept_{level}"


def embed_grad_sends(stage_groups: int) -> int:
    """Times a micro-batch's backward hands the embedding's gradient on, each
    reduce-scattered under ZeRO-3: the head's (tied or not) and each of the model's
    ``stage_groups`` inputs' (runtime/streaming.py: ``_head``, ``_backward``)."""
    return 1 + stage_groups


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The model and batch in the numbers the planner needs (bytes, FLOPs, seconds; per
    micro-batch unless named otherwise)."""

    name: str
    num_layers: int  # blocks, every stage group's
    embed_params: int
    # the block slab a device computes with (expert parallelism: its experts; several
    # stage groups: the largest group's)
    block_params: int
    head_params: int
    compute_bytes: int  # bytes per compute-dtype element
    block_grad_bytes: int  # bytes per element of block gradient slabs (memory.block_grad_dtype)
    state_format: StateFormat  # the optimizer state's kinds and dtypes (its master's among them)
    micro_batches: int
    tokens_per_step: int  # global
    flops_per_step: float  # model FLOPs (6N + attention) of one optimizer step
    boundary: int  # one block-boundary activation of a micro-batch
    working_set: int  # device temporaries of the largest stage function, with x / dx
    # one block's in-block activations kept to backward (its vjp residuals), and the
    # FLOPs its backward recomputes, per offload.keep_level the block supports
    kept: dict[str, int]
    recompute_flops: dict[str, float]
    block_fwd_flops: float
    head_fwd_flops: float
    # FLOPs a block's backward spends recomputing the attention scores tile by tile (the
    # blockwise and fused attentions' fifth matmul, models/attention.py): at every level
    attention_bwd_flops: float = 0.0
    measured: dict[str, float] | None = None  # stage seconds from :func:`trace`
    grad_policy: str = "keep"  # how long gradient buffers are held (memory.grad_policy)
    # a model of several stage groups (encoder, decoder): (name, blocks, padded params of
    # one block) each, in forward order; empty: one group of num_layers x block_params.
    # Block FLOPs and stage times are then means over every block, the kept activations
    # the largest group's
    groups: tuple[tuple[str, int, int], ...] = ()
    context: int = 0  # device bytes of the groups' contexts (stages/measure.py)
    # Expert parallelism: the whole block slab the devices store (every expert; ZeRO-3
    # gives each 1/devices of it) and what one block's gather brings a device from the
    # others (the dense pages' (n-1)/n, its experts' share of their group's); 0: none,
    # the block slab is whole on every device (stored = block_params, gathered its
    # (n-1)/n). And the bytes a device sends by all-to-all in one block's forward.
    stored_block_params: int = 0
    gathered_block_params: int = 0
    # Under tensor parallelism, the elements of a block's gradient one device sends in
    # ZeRO-3's reduce-scatters (grouped.scattered_elements: over the data axis only;
    # without it, what its gather brings)
    scattered_block_params: int = 0
    scattered_rest_params: int = 0  # and of the embedding's and the head's (0: (n-1)/n)
    exchange_bytes: int = 0
    # Expert-aware streaming (offload.expert_fetch=routed, one device): the params of one
    # block's experts, of which a streamed block that recomputes copies only the routed
    # ones, the expected share ``expert_fetch_fraction`` of them (0: not routed)
    routed_expert_params: int = 0
    expert_fetch_fraction: float = 1.0
    expert_fetch_source: str = ""  # where that share comes from (the plan table says)
    # offload.expert_updates=deferred with the state on NVMe (optimizer/deferred.py):
    # the state of the routed experts without a token in a step stays on disk
    deferred_expert_updates: bool = False
    # offload.batch_chunks: the chunks of rows ``working_set`` is for (the config's), and
    # the working set at each other chunk count the planner may choose (a divisor of a
    # device's rows; empty where the blocks' rows are not independent, runtime/stages/chunks.py)
    batch_chunks: int = 1
    chunked_working_sets: dict[int, int] = dataclasses.field(default_factory=dict)
    # the model's kinds on the support matrix's model axis (hetjax/support.py): what the
    # planner offers it (batch chunks, swapped blocks) follows the matrix's rows
    model_kinds: frozenset[str] = frozenset()
    page_elems: int = 0  # elements a page of the slabs (0: not known)
    # Tensor parallelism (distributed.tensor_parallel): the devices of a model group.
    # A device computes with its block's dense pages and 1/tensor of its split weights
    # (block_params: the grouped layout's compute_size; stored and gathered as that
    # layout stores and gathers them), its FLOPs 1/tensor of its data group's rows',
    # and holds the boundaries of its data group's rows (tensor x a device's share)
    tensor: int = 1
    # Where a block's compute needs the mesh (tensor and expert parallelism): what one
    # kept block's vjp and one swapped block's residuals hold on a device, per level, as
    # XLA lays them out over it (measured by the tracer on this machine's devices with
    # the runtime's functions, stages.StageFunctions.held_bytes; memory.Sizes.held_kept).
    # Empty: ``kept`` and what it derives (a kept block's residuals whole over the model
    # axis: not below what a device holds)
    held_kept: dict[str, int] = dataclasses.field(default_factory=dict)
    held_swapped: dict[str, int] = dataclasses.field(default_factory=dict)
    # Megatron's all-reduces of a block (the mean over every block) per micro-batch under
    # tensor parallelism, in activations: (forward, backward) (:func:`all_reduces`)
    all_reduces: tuple[float, float] = (2.0, 2.0)

    def working_set_in(self, chunks: int) -> int:
        """The working set with the micro-batch in ``chunks`` chunks of rows."""
        if chunks == self.batch_chunks:
            return self.working_set
        return self.chunked_working_sets[chunks]

    @property
    def kept_block(self) -> int:
        """One block's in-block activations, every one (``offload.keep_level=all``)."""
        return self.kept["all"]

    @property
    def block_groups(self) -> tuple[tuple[str, int, int], ...]:
        return self.groups or (("block", self.num_layers, self.block_params),)

    @property
    def params(self) -> int:
        """Params stored (padded slabs; every expert)."""
        if self.stored_block_params:
            blocks = self.num_layers * self.stored_block_params
        else:
            blocks = sum(layers * size for _, layers, size in self.block_groups)
        return self.embed_params + blocks + self.head_params

    @property
    def stored_block(self) -> float:
        """Params of a block slab the devices store (ZeRO-3: 1/devices each); of several
        stage groups' blocks, the mean over every block (what L streamed blocks move is
        L times it)."""
        if self.stored_block_params or not self.groups:
            return self.stored_block_params or self.block_params
        return (self.params - self.embed_params - self.head_params) / self.num_layers

    def gathered_block(self, devices: int) -> float:
        """Params one block's all-gather brings a device from the other ``devices``."""
        if self.gathered_block_params or not self.groups:
            return self.gathered_block_params or self.block_params * (devices - 1) // devices
        return self.stored_block * (devices - 1) / devices

    def scattered_block(self, devices: int) -> float:
        """Params of one block's gradient a device sends in its reduce-scatters (of
        several stage groups' blocks, the mean over every block)."""
        if self.tensor > 1:
            return self.scattered_block_params
        return self.gathered_block(devices)

    @property
    def embed_grad_sends(self) -> int:
        """Times a micro-batch's backward hands the embedding's gradient on
        (:func:`embed_grad_sends`)."""
        return embed_grad_sends(max(1, len(self.groups)))

    def scattered_rest(self, devices: int) -> float:
        """Params of the embedding's and the head's gradients a device sends in their
        reduce-scatters (the embedding's :attr:`embed_grad_sends` times)."""
        if self.tensor > 1:
            return self.scattered_rest_params
        rest = self.params - self.num_layers * self.stored_block
        rest += (self.embed_grad_sends - 1) * self.embed_params
        return rest * (devices - 1) / devices

    @property
    def expert_step_share(self) -> float:
        """The expected share of a routed block's experts that get a token in a step
        (in any of its micro-batches): what deferred expert updates touch."""
        return 1 - (1 - self.expert_fetch_fraction) ** self.micro_batches

    @property
    def state_bytes_per_param(self) -> float:
        """Bytes of optimizer state (every kind, the master's among them) a parameter."""
        return self.state_format.bytes_per_param

    def stage_times(self, hw: Hardware) -> dict[str, float]:
        """Seconds per micro-batch of each stage function: measured, or FLOPs over the
        profile's FLOP/s (backward = 2 x forward; a streamed block recomputes its forward
        first, Fuyou's equation 8; a kept block the part its keep level did not keep:
        its FLOPs, and writing once the bytes of the activations it recomputes).
        ``kept_key(level)`` names a kept block's backward."""
        if self.measured is not None:
            return self.measured
        f, bw = hw.device_flops, hw.device_memory_bw
        block, head = self.block_fwd_flops / f, self.head_fwd_flops / f
        scores = self.attention_bwd_flops / f
        times = {
            "embed_fwd": 0.0,
            "block_fwd": block,
            "block_bwd": 3 * block + scores,
            "head": 3 * head,
            "embed_bwd": 0.0,
        }
        for level, flops in self.recompute_flops.items():
            recomputed = self.kept["all"] - self.kept[level]
            times[kept_key(level)] = (
                2 * block + scores + flops / f + (recomputed / bw if bw else 0.0)
            )
        return times

    @classmethod
    def from_config(
        cls,
        config: Config,
        sizes=None,
        devices: int = 1,
        backend: str | None = None,
        expert_fraction: float | None = None,
        tensor: int = 1,
    ) -> Workload:
        """From abstract shapes only (``jax.eval_shape``): nothing is allocated.
        ``sizes``: a measured :class:`~hetjax.runtime.stages.measure.StageMemory`, else estimated.
        ``devices``: data-parallel devices sharing the batch (per-device sizes), of which
        ``distributed.expert_parallel`` split a mixture of experts' experts.
        ``backend``: the XLA backend the stage functions would compile for ("cpu",
        "gpu", ...; default this process's), which sizes the estimated working set
        (:func:`estimate_working_set`). ``expert_fraction``: the share of a routed
        block's experts a run measured copying (:func:`measured_expert_fraction`), else
        uniform routing's expectation (:func:`expected_expert_fraction`). ``tensor``:
        of the ``devices``, those a block's compute splits over (a model group, sharing
        its rows; ``distributed.tensor_parallel``): the slabs are laid out as the
        runtime lays them out then (``stage_layouts(..., tensor_parallel=tensor)``).
        Estimated ones are kept by their arguments: the same object for the same config,
        split and backend (the planner asks for each profile's splits, and tracing the
        model's shapes is most of a small plan's time)."""
        backend = backend or jax.default_backend()
        if sizes is not None:
            return cls._from_config(config, sizes, devices, backend, expert_fraction, tensor)
        # (the attention too: model.attention=auto follows this process's probe of cuDNN)
        attention_impl = block_attention(config.model, backend)
        key = (config, devices, backend, expert_fraction, tensor, attention_impl)
        make = lambda: cls._from_config(config, None, devices, backend, expert_fraction, tensor)
        return keep(_ESTIMATED, key, make)

    @classmethod
    def _from_config(
        cls, config: Config, sizes, devices: int, backend: str, expert_fraction, tensor: int
    ) -> Workload:
        m, t = config.model, config.train
        model = build_model(m)
        G = config.distributed.expert_parallel
        if devices % G:
            raise ConfigError(
                f"config key 'distributed.expert_parallel' ({G}) must divide the device "
                f"count ({devices}{' of the hardware profile' if devices > 1 else ''}); "
                "plan for a machine with a multiple of it, or lower it"
            )
        # The slabs as the runtime lays them out (whole pages of fp32 elements, fitted
        # to the largest block, a multiple of the devices': ZeRO-3 shards; the experts in
        # groups)
        layouts = stage_layouts(model, config.memory.page_size, devices, G, tensor_parallel=tensor)
        z = _Shape.of(config, model, layouts, devices, G, tensor, backend)
        L, T, D, c = z.L, z.T, z.D, z.c
        memory = _memory_terms(config, model, layouts, z, sizes, devices)
        routed_experts = _routed_experts(config, model, layouts, devices, G, tensor)
        if expert_fraction is None:
            fraction = expected_expert_fraction(m.num_experts, m.experts_per_token, z.tokens)
            source = f"uniform routing of {z.tokens} tokens"
        else:
            fraction, source = expert_fraction, "measured by the last run in the workdir"
        # the block's slab in groups (experts, or slices of its split weights), one stage
        # group (several keep their padded slabs: Workload.stored_block)
        grouped = (G > 1 or tensor > 1) and len(model.groups) == 1
        shape = f"{L} x {D}" if len(model.groups) == 1 else (
            " + ".join(f"{g.num_layers} {g.name}" for g in model.groups) + f" x {D}"
        )  # fmt: skip
        return cls(
            name=f"{m.family} {shape}, {_count(model.param_count())} params",
            page_elems=layouts["embed"].page_elems,
            num_layers=L,
            embed_params=layouts["embed"].padded_size,
            block_params=z.block,
            head_params=layouts["head"].padded_size,
            compute_bytes=c,
            block_grad_bytes=block_grad_dtype(config).itemsize,
            state_format=state_format(config.optimizer),
            micro_batches=t.grad_accum,
            tokens_per_step=t.batch_size * T,
            flops_per_step=row_flops(model, T, z.T_dec) * t.batch_size,
            **memory,
            **_flop_terms(model, m, z, memory["kept"]),
            grad_policy=grad_policy(config),
            groups=(
                tuple((g.name, g.num_layers, layouts[g.name].padded_size) for g in model.groups)
                if len(model.groups) > 1
                else ()
            ),
            stored_block_params=layouts[z.largest].padded_size if grouped else 0,
            gathered_block_params=layouts[z.largest].gathered_size if grouped else 0,
            **_scattered_terms(model, layouts, devices, G, tensor, L),
            # a block's forward sends and gets back its (token, expert) rows, at the
            # capacity that drops none (models/llama.py: exchange_with_experts): its data
            # group's rows (under tensor parallelism each model device sends them all)
            exchange_bytes=2 * G * z.group_rows * T * m.experts_per_token * D * c * (G - 1) // G,
            routed_expert_params=routed_experts,
            expert_fetch_fraction=fraction if routed_experts else 1.0,
            expert_fetch_source=source if routed_experts else "",
            deferred_expert_updates=bool(routed_experts) and deferrable(config),
            batch_chunks=config.offload.batch_chunks,
            tensor=tensor,
            model_kinds=z.kinds,
            # (an expert-parallel MoE's experts compute on the exchange's G x k rows a token)
            all_reduces=all_reduces(z.attentions, G * m.experts_per_token if m.num_experts else 0),
        )


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What :meth:`Workload._from_config`'s terms share: a block's sizes as the runtime
    lays it out, a device's rows and the attention's."""

    L: int
    T: int
    D: int
    T_dec: int  # a decoder's rows (span corruption: fewer)
    c: int  # bytes of the compute dtype
    b: int  # a device's share of a micro-batch's rows (what the tracer times)
    G: int  # expert groups
    tensor: int
    group_rows: int  # a data group's rows (a model group's devices share them)
    flop_rows: float  # the rows' worth of FLOPs a device computes
    attentions: float  # attention layers per block, averaged over every block
    impl: str  # the blocks' attention
    backend: str  # the backend planned for
    used: dict  # the block params a device computes with, each group's
    largest: str  # the group of the largest block
    block: int  # its compute size (a device's experts only)
    block_used: int
    embed_count: int  # the embedding's params
    kinds: frozenset  # the support matrix's model kinds
    chunk_counts: tuple  # the chunk counts the planner may choose

    @property
    def tokens(self) -> int:
        return self.b * self.T

    @classmethod
    def of(cls, config, model, layouts, devices: int, G: int, tensor: int, backend) -> _Shape:
        m, t = config.model, config.train
        shapes = param_shapes(model, m)
        L = m.num_blocks
        # the block params a device computes with (a MoE's: its E/G experts), each group's
        used = {g.name: _count_params(shapes[g.key]) // g.num_layers for g in model.groups}
        if G > 1:  # (expert parallelism: a llama's one group of blocks)
            experts = split_experts(shapes["blocks"], model.expert_params)[1]
            used["block"] -= _count_params(experts) // L * (G - 1) // G
        for name, layout in layouts.items():  # tensor parallelism: the dense and a slice
            if isinstance(layout, GroupedSlabLayout) and name in used:
                used[name] = layout.dense.size + sum(p.layout.size for p in layout.parts)
        largest = max(model.groups, key=lambda g: layouts[g.name].compute_size).name
        # a device's share of a micro-batch's rows: what its FLOPs are (a model group
        # splits its data group's rows' compute tensor ways), and what the tracer times
        b = max(1, t.micro_batch_size // devices)
        group_rows = max(1, t.micro_batch_size // (devices // tensor))
        # chunk counts the planner may choose: divisors of a device's rows, for blocks
        # whose rows are independent (the support matrix's model axis: the config's
        # kinds and the built model's, as config validation and the runtime read them)
        kinds = support.model_kinds(m) | support.model_kinds_of(model)
        separable = support.supports_model("batch_chunks", kinds) is None
        # (not under tensor parallelism: no chunked working set is estimated there)
        separable = separable and tensor == 1
        return cls(
            L=L, T=t.seq_len, D=m.d_model, T_dec=decoder_length(config.data, t.seq_len),
            c=2 if m.compute_dtype in ("bfloat16", "float16") else 4, b=b, G=G, tensor=tensor,
            group_rows=group_rows, flop_rows=group_rows / tensor if tensor > 1 else b,
            # (a T5 decoder block has two attentions: self and cross)
            attentions=model.attention_layers() / L, impl=block_attention(m, backend),
            backend=backend,
            used=used, largest=largest, block=layouts[largest].compute_size,
            block_used=used[largest], embed_count=_count_params(shapes["embed"]), kinds=kinds,
            chunk_counts=tuple(n for n in CHUNK_COUNTS if b % n == 0) if separable else (),
        )  # fmt: skip


def _count_params(tree) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def _memory_terms(config, model, layouts, z: _Shape, sizes, devices: int) -> dict:
    """The workload's device-memory fields (``boundary``, ``working_set``, ``kept``,
    ``context``, ``chunked_working_sets``): estimated from abstract shapes, or from the
    tracer's measured ``sizes``."""
    m = config.model
    n_chunks = config.offload.batch_chunks

    # Expert parallelism adds the exchange's fixed-capacity rows: G x a device's
    # (token, expert) pairs, through the send and receive buffers, their sorted copy
    # and result (D wide) and the experts' gate, up and activation (F wide); an
    # estimate from the buffers' shapes (not fitted), the runtime measures.
    def estimate(chunks: int) -> float:
        at = math.ceil(z.attentions)
        return estimate_working_set(
            m, z.b, z.T, z.block_used, z.embed_count, z.backend, at, chunks
        ) + (
            z.G * z.tokens * m.experts_per_token * (4 * z.D + 3 * m.ff_dim) * z.c if z.G > 1 else 0
        )

    if sizes is None:
        # The residuals of one block's vjp at each keep level, from abstract shapes
        # (its params unflattened, in the compute dtype): the largest group's at
        # each level.
        kept: dict[str, int] = {}
        residuals_of = vjp_kept(model, m, z.b, z.T, block_attention(m, jax.default_backend()))
        for group, residuals in zip(model.groups, residuals_of, strict=True):
            for level, n in residuals.items():
                # Below level all the vjp holds the block's param pages, padding
                # included (at all, the unflattened weights; under ZeRO-3 the
                # gathered pages at every level).
                pad = layouts[group.name].compute_size - z.used[group.name]
                n += 0 if level == "all" and devices == 1 else pad * z.c
                kept[level] = max(kept.get(level, 0), n)
        working = estimate(n_chunks)
        boundary = z.group_rows * z.T * z.D * z.c
        context = context_bytes(model, z.b, z.T)
    else:
        kept, working, boundary = sizes.kept, sizes.working_set, sizes.boundary
        if sizes.grad_shards == 1:  # measured at a device's rows: the data group's
            boundary = boundary * z.group_rows // z.b
        context = sizes.context
        if devices > 1 and sizes.grad_shards == 1:
            # measured on one device, whose block takes its params leaf by leaf: under
            # ZeRO-3 a kept block's vjp holds the gathered pages, padding included
            pad = (z.block - z.block_used) * z.c
            kept = {level: n + pad for level, n in kept.items()}
    # The other chunk counts' working sets: estimated; scaled to the measured one
    # where it was measured (the estimate's ratio between chunk counts)
    ratio = working / estimate(n_chunks) if sizes is not None else 1.0
    chunked = {n: int(estimate(n) * ratio) for n in z.chunk_counts if n != n_chunks}
    if devices > 1 and (sizes is None or sizes.grad_shards == 1):
        # estimated, or measured on one device (the tracer): ZeRO-3's reduce-scatter
        # holds the block's whole gradient as a temporary of its backward
        grad_bytes = block_grad_dtype(config).itemsize
        scatter = _scatter_bytes(layouts[z.largest], grad_bytes, devices)
        working += scatter
        chunked = {n: ws + scatter for n, ws in chunked.items()}
    return dict(
        boundary=boundary, working_set=int(working), kept=dict(kept), context=context,
        chunked_working_sets=chunked,
    )  # fmt: skip


def _flop_terms(model, m, z: _Shape, kept: dict) -> dict:
    """The workload's FLOP fields of a device's rows. What a kept block's backward
    recomputes at level matmuls (its other FLOPs are elementwise: their cost is the
    bytes, see stage_times): the reference attention's scores; the fused attention's
    forward (its softmax statistics are not kept); nothing of the blockwise one's, whose
    output and logsumexp are kept. The blockwise and fused backwards recompute the
    scores at every level."""
    T, D, tokens = z.T, z.D, z.tokens
    attention_matmuls = {"reference": 2, "fused": 4}.get(z.impl, 0) * tokens * T * D * z.attentions
    recompute = {"matmuls": attention_matmuls, "probs": 0.0, "all": 0.0}
    return dict(
        recompute_flops={level: recompute[level] for level in kept},
        # forward: a third of forward + backward
        block_fwd_flops=z.flop_rows * model.block_flops_per_row(T, z.T_dec) / 3 / z.L,
        head_fwd_flops=z.flop_rows * z.T_dec * 2 * m.vocab_size * D,
        attention_bwd_flops=(
            2 * tokens * T * D * z.attentions if z.impl in ("blockwise", "fused") else 0.0
        ),
    )


def _scattered_terms(model, layouts, devices: int, G: int, tensor: int, L: int) -> dict:
    """Under tensor parallelism, the elements a block's (averaged over every block) and
    the embedding's and head's gradients reduce-scatter over the model axis."""
    if tensor == 1:
        return dict(scattered_block_params=0, scattered_rest_params=0)
    mesh = {DATA_AXIS: devices // (G * tensor), EXPERT_AXIS: G, MODEL_AXIS: tensor}
    return dict(
        scattered_block_params=sum(
            g.num_layers * scattered_elements(layouts[g.name], mesh) for g in model.groups
        ) // L,
        scattered_rest_params=(
            embed_grad_sends(len(model.groups)) * scattered_elements(layouts["embed"], mesh)
            + scattered_elements(layouts["head"], mesh)
        ),
    )  # fmt: skip


def _routed_experts(config, model, layouts, devices: int, G: int, tensor: int) -> int:
    """The params of a block's experts that expert-aware streaming copies only when
    routed to (averaged over every block), where the support matrix has it (ZeRO-3
    gathers whole pages: hetjax/support.py); 0 where it does not stream so."""
    routed = model.expert_routing and config.offload.expert_fetch == "routed"
    parallel = support.parallelism_of(devices // (G * tensor), G, tensor)
    if not routed or support.supports("routed_experts", parallel) is not None:
        return 0
    # the leaves the runtime routes (routed.py), per block
    expert_sizes = lambda B: sum(B.leaves[k].size for k in expert_leaves(B, model))
    L = config.model.num_blocks
    return sum(g.num_layers * expert_sizes(layouts[g.name]) for g in model.groups) // L


def _scatter_bytes(layout, grad_bytes: int, devices: int) -> int:
    """The ZeRO-3 backward's reduce-scatter temporaries of a block of ``layout``
    (:func:`~hetjax.memory.zero3_scatter_bytes`): the whole slab over ``devices``; a
    tensor-parallel block's dense pages over every device and its slice over the data
    axis only (none with one data group; an expert x tensor block's slice of its expert
    group likewise). Within 1.00-1.15 of XLA:CPU's at data x
    tensor 1 x 2 and 2 x 2 (tests/test_memory_model.py)."""
    parts = layout.parts if isinstance(layout, GroupedSlabLayout) else ()
    if not any(MODEL_AXIS in axes_of(part.grouping.axis) for part in parts):
        return zero3_scatter_bytes(layout.compute_size, grad_bytes, devices)
    pe = layout.page_elems
    dense = zero3_scatter_bytes(layout.dense.num_pages * pe, grad_bytes, devices)
    return dense + sum(  # each part's group over its shares (an attention slice's too)
        zero3_scatter_bytes(part.layout.num_pages * pe, grad_bytes, part.shares)
        for part in parts
        if part.shares > 1
    )


def all_reduces(attentions: float, experts_per_token: int = 0) -> tuple[float, float]:
    """Megatron's all-reduces of one block per micro-batch, in ``(b, T, D)``
    activations, as ``(forward, backward)`` (Shoeybi et al. 2019, fig. 4): each of its
    ``attentions`` attention layers (a T5 decoder block's two) and its MLP all-reduce
    their outputs in forward and their inputs' gradients in backward; a
    cross-attention's keys and values come from its context (the encoder's output),
    whose gradient is all-reduced too; a mixture of experts' MLP (``experts_per_token``
    k > 0) does so on each token's k expert rows, k activations. A block that
    recomputes in backward runs its forward's again. GPT's and Llama's block: 2, 2."""
    mlp = experts_per_token or 1
    return attentions + mlp, attentions + mlp + (attentions - 1)


def expected_expert_fraction(num_experts: int, per_token: int, tokens: int) -> float:
    """The expected share of E experts that get at least one of ``tokens`` tokens, each
    routed to k distinct experts uniformly: 1 - (1 - k/E)^tokens. Near 1 once tokens are
    many times E/k; a skewed router leaves more experts out."""
    if not num_experts:
        return 1.0
    return 1.0 - (1.0 - per_token / num_experts) ** tokens


def measured_expert_fraction(workdir) -> float | None:
    """The share of the routed blocks' experts the run in ``workdir`` copied per block
    copy (its metrics' ``experts_fetched_fraction``, the median over its steps), or None
    where no run measured one."""
    import json
    import statistics
    from pathlib import Path

    path = Path(workdir) / "metrics.jsonl" if workdir else None
    if path is None or not path.is_file():
        return None
    values = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line a crash cut short
            continue
        if "experts_fetched_fraction" in record:
            values.append(float(record["experts_fetched_fraction"]))
    return statistics.median(values) if values else None


def _count(params: int) -> str:
    """A parameter count: ``13.4B``, ``1.24T``."""
    return f"{params / 1e12:.3g}T" if params >= 1e12 else f"{params / 1e9:.3g}B"


# Workload.from_config's estimated workloads by their arguments (config, devices, backend,
# expert fraction, tensor degree) and the attention the blocks run.
_ESTIMATED: dict[tuple, Workload] = {}

# memory_sizes' results by (id(workload), devices, chunks), with the workload they came from: the
# planner asks for the same ones for every candidate, and a Sizes keeps what the memory
# model derives from it (its device caches).
_SIZES: dict[tuple[int, int, int], tuple[Workload, Sizes]] = {}


def memory_sizes(w: Workload, devices: int = 1, chunks: int | None = None) -> Sizes:
    """The workload's sizes as the memory model takes them, on ``devices`` data-parallel
    devices (ZeRO-3: each process holds 1/devices of every stage's pages; the workload's
    slabs are whole pages of a multiple of ``devices``), with the micro-batch in
    ``chunks`` chunks of rows (``offload.batch_chunks``; default the workload's). The
    same object for the same workload."""
    chunks = chunks or w.batch_chunks
    cached = _SIZES.get((id(w), devices, chunks))
    if cached is not None and cached[0] is w:
        return cached[1]
    if len(_SIZES) > 64:
        _SIZES.clear()
    sizes = _memory_sizes(w, devices, chunks)
    _SIZES[id(w), devices, chunks] = (w, sizes)
    return sizes


def _memory_sizes(w: Workload, devices: int, chunks: int) -> Sizes:
    return Sizes(
        num_layers=w.num_layers,
        embed=w.embed_params,
        block=w.block_params,
        head=w.head_params,
        own_embed=w.embed_params // devices,
        own_block=(w.stored_block_params or max(n for _, _, n in w.block_groups)) // devices,
        own_head=w.head_params // devices,
        compute_bytes=w.compute_bytes,
        block_grad_bytes=w.block_grad_bytes,
        state_format=w.state_format,
        boundary=w.boundary,
        working_set=w.working_set_in(chunks),
        kept=w.kept,
        grad_policy=w.grad_policy,
        groups=tuple((name, n, size, size // devices) for name, n, size in w.groups),
        context=w.context,
        held_kept=w.held_kept,
        held_swapped=w.held_swapped,
        grad_shards=devices,
        page_elems=w.page_elems,
    )
