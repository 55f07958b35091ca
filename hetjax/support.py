"""The support matrix: which features of a placement work under which parallelism, and
why not where they do not. The one place that decides it: ``Config`` validation refuses
what it refuses (``config.py``), the planner offers no candidate using it
(``planning/search.py``) and the runtime reads it where it decides
(``runtime/streaming.py``, ``runtime/experts/routed.py``); ``tests/test_support.py`` enumerates
the matrix and checks the three agree.

A feature refused under a parallelism is either an error at start-up that names the key
and the fix, or, for a feature a default asks for (``offload.expert_fetch=routed``), a
fallback the run takes openly: :func:`fallbacks` says it at start-up, in the log and
in the planner's output. Nothing is switched off silently.

Its second axis is the model's kind (:data:`MODEL_KINDS`): what a model's blocks do that
a feature or a parallelism may need them not to (pool statistics over the micro-batch's
rows, take a context from another stage group). The built-in families' kinds are read
off the config (:func:`model_kinds`), a custom model's off the built model
(:func:`model_kinds_of`); config validation and the runtime refuse with the same line.

Imports nothing from the project: the config imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SINGLE, DATA, EXPERT, TENSOR = "single", "data", "expert", "tensor"
TENSOR_EXPERT = "tensor_expert"
# one device; ZeRO-3 over distributed.data_parallel devices; experts split over
# distributed.expert_parallel devices (with ZeRO-3 over all of them); each block's
# compute split over distributed.tensor_parallel devices (ZeRO-3 over all of them)
# (and both at once: a data x expert x model mesh, whose MoE blocks lay out each expert
# by group and slice, parallel/layouts.py)
PARALLELISMS = (SINGLE, DATA, EXPERT, TENSOR, TENSOR_EXPERT)
SHARDED = frozenset({DATA, EXPERT, TENSOR, TENSOR_EXPERT})
_PHRASES = {
    SINGLE: "one device",
    DATA: "data parallelism (distributed.data_parallel != 1)",
    EXPERT: "expert parallelism (distributed.expert_parallel > 1)",
    TENSOR: "tensor parallelism (distributed.tensor_parallel > 1)",
    TENSOR_EXPERT: "tensor with expert parallelism (distributed.tensor_parallel > 1 and "
    "distributed.expert_parallel > 1)",
}


# The model axis. POOLED: the blocks work over the micro-batch as a whole (a mixture of
# experts: router statistics for its auxiliary loss, models/staged.py ``stats_size``,
# and the experts fetched for the rows routed to them), so a block's rows are not
# independent. CONTEXT: several stage groups
# (an encoder-decoder), whose later blocks take the earlier group's output as a context.
POOLED, CONTEXT = "pooled", "context"
MODEL_KINDS = (POOLED, CONTEXT)
_MODEL_PHRASES = {
    POOLED: "a mixture of experts, whose blocks pool statistics over the micro-batch (the "
    "router's)",
    CONTEXT: "an encoder-decoder (several stage groups, whose decoder blocks take the "
    "encoder's output as a context)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """One row of the matrix.

    ``key``: the config key that asks for it. ``reason``: why it is refused, one clause
    with ``{parallel}`` for the parallelism's phrase. ``fix``: what the error tells to
    do. ``refused``: the parallelisms it does not work under. ``fallback``: non-empty
    for a feature the defaults ask for: under a refusing parallelism the run does this
    instead, and says so (:func:`fallbacks`), instead of failing. ``unplanned``: the
    parallelisms where it works but the planner does not offer it, and ``why_unplanned``
    (:func:`planned`). ``models``: the model kinds (:data:`MODEL_KINDS`) it does not
    work for, ``model_reason`` (with ``{model}`` for the kind's phrase) and
    ``model_fix`` (:func:`model_refusal`)."""

    key: str
    reason: str
    fix: str = ""
    refused: frozenset[str] = SHARDED
    fallback: str = ""
    unplanned: frozenset[str] = frozenset()
    why_unplanned: str = ""
    models: frozenset[str] = frozenset()
    model_reason: str = ""
    model_fix: str = ""


FEATURES: dict[str, Feature] = {
    # offload.mode=none: the whole state on the device, one jitted step; on a mesh the
    # state placed by the streaming runtime's logical-axis rules (replicated under data
    # parallelism, split over the model axis under tensor parallelism, the experts over
    # the expert axis), the rows split, XLA's partitioner adding the collectives
    # (runtime/in_memory.py, tests/test_in_memory_dp.py, tests/test_in_memory_tensor.py).
    # Planned under data and tensor parallelism: a device's share of the state and its
    # rows' activations (planning/in_memory.py, checked against the runtime's shards by
    # tests/test_in_memory_plan.py), the gradients' and Megatron's all-reduces priced
    # (cost.py). Not under expert parallelism: there XLA brings the routed rows to every
    # expert's device and sums the results, an exchange whose bytes and activations
    # nothing sizes (the streaming runtime's all-to-all is another)
    "in_memory": Feature(
        key="offload.mode",
        reason="",
        refused=frozenset(),
        unplanned=frozenset({EXPERT, TENSOR_EXPERT}),
        why_unplanned="the planner does not size offload.mode=none's exchange under expert "
        "parallelism (XLA brings every routed row to each expert's device and sums the "
        "results): neither its bytes nor its activations are priced",
    ),
    # under ZeRO-3 each device holds and updates its own pages of the cached stages'
    # state, and their params, in its memory (optimizer/sharded_slab.py; the planner's
    # per-device bytes equal the runtime's: tests/test_memory_model.py)
    "device_cache": Feature(
        key="offload.optimizer_device_stages",
        reason="a device cache of optimizer state is not supported with {parallel}, where "
        "each device updates its shard on the host",
        fix="leave it 0",
        refused=frozenset(),
    ),
    # each device keeps, swaps or stores its own rows' activations (tests/test_zero.py,
    # tests/test_tensor.py, tests/test_moe.py; a model group's devices their parts of
    # them, or each the same rows); under expert parallelism a block's keep levels and
    # residual bytes are measured on one device inside the mesh its all-to-all needs
    # (stages.StageFunctions._measure). Planned under every parallelism: the planner's
    # per-device bytes of them are the runtime's, under expert and tensor parallelism
    # both measured as XLA lays them out over the mesh (StageFunctions.held_bytes),
    # checked against the runtime's ledger (tests/test_memory_model.py)
    "keep_blocks": Feature(
        key="offload.keep_blocks",
        reason="kept activations are not supported with {parallel}",
        fix="leave it 0",
        refused=frozenset(),
    ),
    # a swapped block's activations are written out per stage group's schedule, which
    # the runtime keeps for one group (runtime/loop/)
    "swap_blocks": Feature(
        key="offload.swap_blocks",
        reason="swapped activations are not supported with {parallel}",
        fix="leave it 0",
        refused=frozenset(),
        models=frozenset({CONTEXT}),
        model_reason="swapped activations are not supported for {model}",
        model_fix="leave it 0 (offload.keep_blocks keeps activations instead)",
    ),
    # the swaps to NVMe write each distinct part of a process's rows once (a model
    # group's devices hold the same rows: written once per group, storage/swap.py)
    "swap_to_nvme": Feature(
        key="offload.swap_tier",
        reason="nvme is not supported with {parallel}",
        fix="use host",
        refused=frozenset(),
    ),
    "nvme_boundaries": Feature(
        key="offload.activations",
        reason="nvme boundary activations are not supported with {parallel} yet",
        fix="use device or host",
        refused=frozenset(),
    ),
    "lockfree": Feature(
        key="optimizer.mode",
        reason="lockfree is not supported with {parallel} yet",
        fix="use optimizer.mode=sync",
        refused=frozenset(),
    ),
    # the default: one device copies the routed experts' rows (runtime/experts/routed.py);
    # under data and expert parallelism each device copies in and gathers the pages of
    # the experts some device routed to (runtime/experts/routed_zero.py; under expert
    # parallelism its group's, over the data axis); under tensor parallelism its slice
    # of them (the experts one expert group cut in slices, parallel/layouts.py); with
    # both, its expert group's slice (routed_zero.py's grouped fetcher for both, the
    # block's attention slices gathered with its dense pages)
    "routed_experts": Feature(
        key="offload.expert_fetch",
        reason="routed experts are not supported with {parallel}",
        refused=frozenset(),
        fallback="every streamed block copies all its experts, as offload.expert_fetch=all",
    ),
    # deferred expert updates need routed experts (optimizer/deferred.py); each process
    # defers its own pages wholly in experts no device routed to (under tensor
    # parallelism: in every slice; on the data x expert x model mesh: of its expert
    # group's slice)
    "deferred_updates": Feature(
        key="offload.expert_updates",
        reason="deferred expert updates are not supported with {parallel}",
        refused=frozenset(),
        fallback="every expert is updated every step, as offload.expert_updates=all",
    ),
    # chunks run a block over a micro-batch's rows a part at a time (runtime/stages/chunks.py)
    "batch_chunks": Feature(
        key="offload.batch_chunks",
        reason="batch chunks are not supported with {parallel} yet",
        fix="leave it 1",
        refused=frozenset(),
        models=frozenset({POOLED, CONTEXT}),
        model_reason="chunks need blocks whose rows are independent, and this model is {model}",
        model_fix="leave it 1 (train.grad_accum splits the batch instead)",
    ),
    # under ZeRO-3 each device holds and updates its own pages of the state
    # (optimizer/sharded_slab.py), as the planner counts (tests/test_memory_model.py)
    "optimizer_on_device": Feature(
        key="offload.optimizer",
        reason="",
        refused=frozenset(),
    ),
}


# parallelism x model: the parallelisms a model kind does not train under, and why
# (expert parallelism splits the experts of a decoder's blocks, parallel/layouts.py; a
# T5's Switch experts are not split)
_SPLIT_EXPERTS = (
    "expert parallelism splits the experts of a decoder's mixture of experts (family "
    "'llama'), and this model is {model}, whose Switch experts are not split"
)
PARALLEL_MODELS: dict[str, dict[str, str]] = {
    EXPERT: {CONTEXT: _SPLIT_EXPERTS},
    TENSOR_EXPERT: {CONTEXT: _SPLIT_EXPERTS},
}


def supports(feature: str, parallelism: str) -> str | None:
    """None when ``feature`` (a key of :data:`FEATURES`) works under ``parallelism``
    (one of :data:`PARALLELISMS`), else the one-line reason it does not."""
    f = FEATURES[feature]
    if parallelism not in PARALLELISMS:
        raise ValueError(f"unknown parallelism {parallelism!r}; one of {PARALLELISMS}")
    if parallelism not in f.refused:
        return None
    return f.reason.format(parallel=_PHRASES[parallelism])


def planned(feature: str, parallelism: str) -> str | None:
    """None when the planner may offer ``feature`` under ``parallelism``, else why not
    (it is not supported, or the planner would count it wrong: ``Feature.unplanned``)."""
    f = FEATURES[feature]
    unplanned = f.why_unplanned if parallelism in f.unplanned else None
    return supports(feature, parallelism) or unplanned


def parallelism(distributed: Any) -> str:
    """The parallelism of a ``config.distributed`` section."""
    d = distributed
    return parallelism_of(d.data_parallel, d.expert_parallel, d.tensor_parallel)


def parallelism_of(data: int, expert: int = 1, tensor: int = 1) -> str:
    """The parallelism of a data x expert x tensor split (``data`` 0: every device)."""
    if tensor > 1:
        return TENSOR_EXPERT if expert > 1 else TENSOR
    if expert > 1:
        return EXPERT
    return DATA if data != 1 else SINGLE


def asked(config: Any) -> list[str]:
    """The features of :data:`FEATURES` ``config`` asks for, in the matrix's order."""
    off, m = config.offload, config.model
    moe_routing = bool(m.num_experts)  # Llama's and T5's experts route (runtime/experts/routed.py)
    wanted = {
        "in_memory": off.mode == "none",
        "device_cache": off.optimizer_device_stages > 0,
        "keep_blocks": off.keep_blocks > 0,
        "swap_blocks": off.swap_blocks > 0,
        "swap_to_nvme": off.swap_blocks > 0 and off.swap_tier == "nvme",
        "nvme_boundaries": off.activations == "nvme",
        "lockfree": config.optimizer.mode == "lockfree",
        "routed_experts": off.mode != "none" and moe_routing and off.expert_fetch == "routed",
        "deferred_updates": off.mode != "none"
        and moe_routing
        and off.expert_fetch == "routed"
        and off.expert_updates == "deferred",
        "batch_chunks": off.batch_chunks > 1,
        "optimizer_on_device": off.mode != "none" and off.optimizer == "device",
    }
    return [name for name in FEATURES if wanted[name]]


def model_kinds(model: Any) -> frozenset[str]:
    """The kinds (:data:`MODEL_KINDS`) of a built-in family's ``config.model``; a custom
    model's are known once it is built (:func:`model_kinds_of`)."""
    kinds = set()
    if model.num_experts:  # (with or without the auxiliary loss's statistics, as before)
        kinds.add(POOLED)
    if model.encoder_decoder:
        kinds.add(CONTEXT)
    return frozenset(kinds)


def model_kinds_of(model: Any) -> frozenset[str]:
    """The kinds of a built staged model (models/staged.py): its statistics, its groups."""
    kinds = {POOLED} if model.stats_size else set()
    return frozenset(kinds | ({CONTEXT} if len(model.groups) > 1 else set()))


def supports_model(feature: str, kinds: frozenset[str]) -> str | None:
    """None when ``feature`` works for a model of ``kinds``, else the one-line reason."""
    f = FEATURES[feature]
    refused = [k for k in MODEL_KINDS if k in kinds and k in f.models]
    return f.model_reason.format(model=_MODEL_PHRASES[refused[0]]) if refused else None


def model_refusal(feature: str, kinds: frozenset[str], value: Any) -> str | None:
    """The error for asking for ``feature`` (its key set to ``value``) for a model of
    ``kinds`` that it does not work for, naming the key and the fix; or None."""
    reason = supports_model(feature, kinds)
    if reason is None:
        return None
    f = FEATURES[feature]
    return f"config key '{f.key}' ({value}): {reason}; {f.model_fix}"


def parallel_refusal(parallelism: str, kinds: frozenset[str]) -> str | None:
    """Why a model of ``kinds`` does not train under ``parallelism``, or None."""
    cells = PARALLEL_MODELS.get(parallelism, {})
    refused = [k for k in MODEL_KINDS if k in kinds and k in cells]
    return cells[refused[0]].format(model=_MODEL_PHRASES[refused[0]]) if refused else None


def refusal(config: Any, feature: str) -> str | None:
    """The error ``config`` gets for asking for ``feature`` where its parallelism does
    not support it (naming the key and the fix), or None (supported, or a fallback)."""
    f = FEATURES[feature]
    p = parallelism(config.distributed)
    reason = supports(feature, p)
    if reason is None or f.fallback:
        section, name = f.key.split(".")
        value = getattr(getattr(config, section), name)
        return model_refusal(feature, model_kinds(config.model), value)
    return f"config key '{f.key}': {reason}; {f.fix}"


def fallbacks(config: Any, parallel: str | None = None) -> list[str]:
    """What ``config`` asks for that its parallelism (or ``parallel``, a plan's) does not
    support and the run does otherwise, one line each, for the start-up log and the
    planner's output."""
    p = parallel or parallelism(config.distributed)
    lines = []
    for feature in asked(config):
        f, reason = FEATURES[feature], supports(feature, p)
        if reason is not None and f.fallback:
            lines.append(f"{f.key}: {reason}: {f.fallback}")
    return lines
