"""The ``offload`` and ``memory`` config sections: where the training state lives, and
the budgets and layout it lives in (re-exported by ``hetjax/config.py``, whose
``Config`` holds them)."""

from __future__ import annotations

import dataclasses

from hetjax.config_values import ConfigError, _check, _choice, parse_bytes

OFFLOAD_MODES = ("auto", "none", "stream")
# offload.keep_level, highest swap benefit factor first (each keeps what the one before
# it keeps, and more): see hetjax/runtime/stages/remat.py.
KEEP_LEVELS = ("matmuls", "probs", "all")
# offload.swap_level: the levels that leave the params out of what moves (``all`` holds
# weight copies made in forward, which a swap would move for nothing)
SWAP_LEVELS = KEEP_LEVELS[:2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where the training state lives.

    ``mode``: ``none`` keeps everything on the device with one jitted train step (the
    reference every other mode is tested against); ``stream`` keeps params in host memory
    and streams one stage at a time through a device window (hetjax/runtime/streaming.py);
    ``auto`` (the default) picks ``none`` when the state fits the device, else measures
    the machine and trains with the planner's placement (hetjax/planning/search.py).

    The fields below that place state are read into one ``hetjax.placement.Placement``
    (the planner's candidates and the runtime take that); what works under data or
    expert parallelism is ``hetjax.support``'s matrix.

    In stream mode ``optimizer`` places the fp32 master params and optimizer state:
    ``host`` (RAM), ``nvme`` (TensorStore arrays under ``memory.nvme_path``, cached in
    RAM up to ``memory.host_budget``) or ``device``; ``params`` places the compute-dtype
    params the forward reads: ``host`` or ``nvme`` (for when RAM cannot hold them);
    ``activations`` places the block-boundary activations: ``device``, ``host``, or
    ``nvme`` (written to a TensorStore array under ``memory.nvme_path`` and read back
    ahead of backward, with a few in RAM; hetjax/storage/swap.py).

    ``keep_blocks``: the last N blocks keep in-block activations on the device from
    forward to backward instead of recomputing them from their boundary activation;
    ``keep_level`` says which (hetjax/runtime/stages/remat.py): ``all`` of them, or only
    those with the best recompute time saved per byte: ``matmuls`` (the matmul outputs; backward
    recomputes the elementwise ops, and the attention forward where it is not the
    blockwise one) or ``probs`` (those and the attention probabilities; backward
    recomputes the elementwise ops; only blocks that tag them, as the zoo's reference
    attention does, ``model.attention=reference``).

    ``swap_blocks``: the N blocks before the kept ones (or the last N, with none kept)
    move the in-block activations of ``swap_level`` (``matmuls`` or ``probs``, as for
    ``keep_level``) and their input to host memory (``pinned_host``) as forward makes
    them, and back to the device ahead of their backward, which recomputes only what
    the level did not save (Fuyou's activation swapping, section 4.4). Their params are
    fetched again for backward, as for blocks that recompute. ``swap_tier``: ``host``
    keeps them in host RAM, ``nvme`` writes them on through a few host buffers to a
    TensorStore array under ``memory.nvme_path`` and reads them back ahead of backward
    (as ``offload.activations=nvme`` does boundaries).

    ``optimizer_device_stages``: with ``optimizer`` host or nvme, the first N stages in
    forward order (embed, block 0, block 1, ..., head last) keep their fp32 master and
    optimizer state on the device instead, are updated there by the same optax update,
    and stay resident there (Angel-PTM's GPU cache of optimizer state). Those are the
    stages backward reaches *last*: on the host their updates would be the optimizer's
    tail that every step waits for after backward; on the device they run next to the
    backward that produced their gradient, which never leaves the device, and their
    params are already where the forward reads them. 0: none (``offload.mode=auto``
    lets the planner choose).

    ``expert_fetch``: how a streamed mixture-of-experts block (Mixtral-style Llama, T5 Switch; one
    device) fetches its experts. ``routed``: the block's attention and router run first,
    the host reads which experts got tokens, and only those are copied to the device,
    for forward and again for backward (``hetjax/runtime/experts/routed.py``); equal to
    ``all``, which copies every expert with the rest of the block. ``offload.mode=auto``
    routes only where the planner predicts a gain (``planning/cost.py``). With data or
    expert parallelism a device takes whole pages of a block, so the experts are copied
    whole, and the run says so at start-up (``hetjax/support.py``).

    ``expert_updates``: with routed experts and the optimizer state on NVMe, ``deferred``
    leaves the state of experts without a token in a step on disk and catches their
    missed updates up, bit for bit, before their next use (``hetjax/optimizer/
    deferred.py``); ``all`` updates every expert every step. Equal either way.

    ``batch_chunks``: the blocks that recompute and the head run each micro-batch in
    this many equal chunks of its rows, one after the other with the stage's params on
    the device (``hetjax/runtime/stages/chunks.py``): the device holds one chunk's temporaries
    (a block's MLP activations, the head's logits), while params are still streamed
    once a micro-batch (``train.grad_accum`` streams them once per micro-batch). The
    block gradients are summed over the chunks in place, in
    ``memory.block_grad_dtype``. For blocks whose rows are independent (no mixture of
    experts, one stage group); not with kept or swapped blocks. ``offload.mode=auto``
    chunks only where the device cannot hold a whole micro-batch's working set.
    """

    mode: str = "auto"
    params: str = "host"  # stream: where the compute-dtype param slabs live
    optimizer: str = "host"  # stream: where fp32 master params and optimizer state live
    activations: str = "device"  # stream: where block-boundary activations live
    prefetch_depth: int = 2  # stream: stages copied ahead of the one computing
    # stream: the last N blocks keep their in-block activations on the device from
    # forward to backward instead of recomputing them (more memory, less compute)
    keep_blocks: int = 0
    keep_level: str = "all"  # stream: which in-block activations kept blocks keep
    # stream: the N blocks before the kept ones move the in-block activations of
    # swap_level to host memory in forward and back for backward (Fuyou's swapping)
    swap_blocks: int = 0
    swap_level: str = "matmuls"  # stream: which in-block activations swapped blocks move
    swap_tier: str = "host"  # stream: where they go: host RAM, or through it to NVMe
    # stream, optimizer host or nvme: the first N stages (embed, block 0, ...) keep their
    # optimizer state on the device, are updated there and stay resident there
    optimizer_device_stages: int = 0
    # stream, a MoE block: copy only the experts its tokens were routed to, or all
    expert_fetch: str = "routed"
    # routed experts with state on NVMe: the updates of the experts without a token wait,
    # caught up before their next use (deferred), or happen every step (all)
    expert_updates: str = "deferred"
    # stream: recomputed blocks and the head run each micro-batch in N chunks of rows
    batch_chunks: int = 1

    def __post_init__(self):
        _choice("offload", "mode", self.mode, OFFLOAD_MODES)
        _choice("offload", "params", self.params, ("host", "nvme"))
        _choice("offload", "optimizer", self.optimizer, ("device", "host", "nvme"))
        _choice("offload", "activations", self.activations, ("device", "host", "nvme"))
        if self.activations == "nvme" and self.mode != "stream":
            raise ConfigError(
                "config key 'offload.activations' is 'nvme', which only the streaming "
                f"runtime writes, but offload.mode is {self.mode!r}; set offload.mode=stream"
                + (
                    " (with offload.mode=auto the planner chooses it)"
                    if self.mode == "auto"
                    else ""
                )
            )
        _check(
            self.prefetch_depth >= 0,
            "offload.prefetch_depth",
            "must be >= 0",
            self.prefetch_depth,
        )
        _check(self.keep_blocks >= 0, "offload.keep_blocks", "must be >= 0", self.keep_blocks)
        _choice("offload", "keep_level", self.keep_level, KEEP_LEVELS)
        _check(self.swap_blocks >= 0, "offload.swap_blocks", "must be >= 0", self.swap_blocks)
        _choice("offload", "swap_level", self.swap_level, SWAP_LEVELS)
        _choice("offload", "swap_tier", self.swap_tier, ("host", "nvme"))
        _choice("offload", "expert_fetch", self.expert_fetch, ("routed", "all"))
        _choice("offload", "expert_updates", self.expert_updates, ("deferred", "all"))
        if self.mode == "stream" and self.keep_level != "all" and not self.keep_blocks:
            raise ConfigError(
                f"config key 'offload.keep_level' is {self.keep_level!r}, which applies to "
                "the blocks that keep their in-block activations, but offload.keep_blocks "
                "is 0; set offload.keep_blocks to how many blocks keep them"
            )
        _check(self.batch_chunks >= 1, "offload.batch_chunks", "must be >= 1", self.batch_chunks)
        if self.batch_chunks > 1 and self.mode != "stream":
            raise ConfigError(
                f"config key 'offload.batch_chunks' ({self.batch_chunks}) splits the "
                f"streaming runtime's stages, but offload.mode is {self.mode!r}: "
                + (
                    "with offload.mode=auto the planner chooses it; leave it 1, or set "
                    "offload.mode=stream to choose it yourself"
                    if self.mode == "auto"
                    else "leave it 1 (train.grad_accum splits the batch of one jitted step)"
                )
            )
        if self.batch_chunks > 1 and (self.keep_blocks or self.swap_blocks):
            key = "keep_blocks" if self.keep_blocks else "swap_blocks"
            raise ConfigError(
                f"config key 'offload.batch_chunks' ({self.batch_chunks}): blocks that keep "
                f"or swap their activations run whole micro-batches, but offload.{key} is "
                f"{getattr(self, key)}; leave one of them at its default"
            )
        _check(
            self.optimizer_device_stages >= 0,
            "offload.optimizer_device_stages",
            "must be >= 0",
            self.optimizer_device_stages,
        )
        if self.optimizer_device_stages and self.mode != "stream":
            raise ConfigError(
                f"config key 'offload.optimizer_device_stages' "
                f"({self.optimizer_device_stages}) caches optimizer state of the streaming "
                f"runtime on the device, but offload.mode is {self.mode!r}: "
                + (
                    "offload.mode=none keeps all optimizer state on the device already; leave it 0"
                    if self.mode == "none"
                    else "with offload.mode=auto the planner chooses it; leave it 0, or "
                    "set offload.mode=stream to choose it yourself"
                )
            )
        if self.optimizer_device_stages and self.optimizer == "device":
            raise ConfigError(
                f"config key 'offload.optimizer_device_stages' "
                f"({self.optimizer_device_stages}) caches some stages' optimizer state on "
                "the device, but offload.optimizer=device keeps every stage's there "
                "already; leave it 0, or set offload.optimizer=host or nvme"
            )


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Memory budgets and layout. Byte sizes accept ints or strings like '512MiB'."""

    page_size: int | str = "4MiB"
    device_budget: int | str = 0  # device bytes the streaming runtime may hold; 0: no limit
    # host RAM the streaming runtime's process may hold (param slabs, gradient buffers,
    # optimizer state or its cache), for every device it drives (the planner gives a
    # profile's devices an equal share: one process a machine); 0: no limit, and with
    # offload.optimizer=nvme no state cache
    host_budget: int | str = 0
    # offload.*=nvme: directory on a local SSD, or several, comma-separated (one per
    # drive: pages stripe over them, hetjax/storage/stripes.py); "": <workdir>/nvme
    nvme_path: str = ""
    # copies of the NVMe state and params: 2, the committed one and the one a step
    # writes; 1, written in place (where no written update can be dropped); 0: auto, 1
    # where that holds (hetjax/nvme_copies.py)
    nvme_copies: int = 0
    # each drive's rated endurance in terabytes written (TBW; 0: unknown), and the
    # fraction of that a run of train.steps may consume (0: no limit; needs nvme_tbw)
    nvme_tbw: float = 0.0
    nvme_wear_budget: float = 0.0
    # of each accelerator's memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION, set by
    # the launcher before JAX starts; JAX alone takes 0.75); the planner plans within it
    device_fraction: float = 0.9

    def __post_init__(self):
        _check(
            0 < self.device_fraction <= 1,
            "memory.device_fraction",
            "must be in (0, 1]",
            self.device_fraction,
        )
        page = parse_bytes(self.page_size, "memory.page_size")
        _check(
            page >= 4096 and page % 4096 == 0,
            "memory.page_size",
            "must be a positive multiple of 4 KiB",
            self.page_size,
        )
        object.__setattr__(self, "page_size", page)
        budget = parse_bytes(self.device_budget, "memory.device_budget")
        _check(budget >= 0, "memory.device_budget", "must be >= 0 (0: no limit)", budget)
        object.__setattr__(self, "device_budget", budget)
        host = parse_bytes(self.host_budget, "memory.host_budget")
        _check(host >= 0, "memory.host_budget", "must be >= 0 (0: no limit)", host)
        object.__setattr__(self, "host_budget", host)
        _check(
            self.nvme_copies in (0, 1, 2),
            "memory.nvme_copies",
            "must be 0 (auto), 1 or 2",
            self.nvme_copies,
        )
        dirs = self.nvme_paths
        _check(
            all(dirs) and len(set(dirs)) == len(dirs),
            "memory.nvme_path",
            "must name distinct, non-empty directories (comma-separated)",
            self.nvme_path,
        )
        _check(self.nvme_tbw >= 0, "memory.nvme_tbw", "must be >= 0 (0: unknown)", self.nvme_tbw)
        _check(
            0 <= self.nvme_wear_budget <= 1,
            "memory.nvme_wear_budget",
            "must be in [0, 1] (a fraction of the drives' life; 0: no limit)",
            self.nvme_wear_budget,
        )
        if self.nvme_wear_budget and not self.nvme_tbw:
            raise ConfigError(
                f"config key 'memory.nvme_wear_budget' ({self.nvme_wear_budget}) is a fraction "
                "of the drives' rated endurance, but memory.nvme_tbw is 0 (unknown); set "
                "memory.nvme_tbw to each drive's rated terabytes written"
            )

    @property
    def nvme_paths(self) -> list[str]:
        """The NVMe directories, one per drive (empty: none given)."""
        return [p.strip() for p in self.nvme_path.split(",")] if self.nvme_path else []
