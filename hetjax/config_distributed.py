"""The ``distributed`` section of the run configuration (re-exported by ``config.py``):
how many devices, processes and which parallelisms a run uses."""

from __future__ import annotations

import dataclasses
import re

from hetjax.config_values import ConfigError, _check, _choice

REDUCE_DTYPES = ("float32", "compute")  # distributed.reduce_dtype


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Data and expert parallelism (ZeRO-3, hetjax/parallel/zero.py) and the processes of
    a multi-host run (hetjax/distributed.py).

    ``data_parallel`` devices share every stage's pages, one 1/N shard each; 1 is the
    single-device streaming runtime, 0 every device of every process. With
    ``expert_parallel`` E > 1 a mixture-of-experts model's experts are split over E
    devices (each holds model.num_experts / E of every block's experts, and tokens go to
    their experts' devices and back with all-to-alls), composed with ``data_parallel``
    over the remaining devices: data_parallel x expert_parallel devices in all
    (data_parallel 0: every device); every other param is ZeRO-3 over all of them.
    ``tensor_parallel`` M > 1 splits each block's compute over M devices (the ``model``
    axis), with either or both: a data x expert x model mesh (a MoE block's experts then
    split over expert and model, ``parallel/layouts.py``).
    ``coordinator``,
    ``num_processes`` and ``process_id`` start ``jax.distributed``: empty / 0 / -1 read
    them from the environment (``HETJAX_COORDINATOR``, ``HETJAX_NUM_PROCESSES``,
    ``HETJAX_PROCESS_ID``, else SLURM's variables); with none set the run is one process.
    """

    data_parallel: int = 1
    expert_parallel: int = 1  # devices the experts are split over (1: none)
    # devices each block's compute splits over (Megatron's split, the model axis): 1 none
    tensor_parallel: int = 1
    # the dtype block gradients are reduce-scattered in: float32, or the compute dtype
    # (bf16: half the bytes; the sum over devices is rounded to it, memory.block_grad_dtype)
    reduce_dtype: str = "float32"
    coordinator: str = ""  # host:port of process 0's coordination service
    num_processes: int = 0  # 0: from the environment, else 1
    process_id: int = -1  # -1: from the environment
    # seconds to wait for every process at start-up, and after which a silent process
    # (killed, hung) is declared dead and the others stop with an error
    timeout_s: int = 300

    def __post_init__(self):
        _check(
            self.data_parallel >= 0,
            "distributed.data_parallel",
            "must be >= 0 (0: every device, 1: no data parallelism)",
            self.data_parallel,
        )
        _check(
            self.expert_parallel >= 1,
            "distributed.expert_parallel",
            "must be >= 1 (1: no expert parallelism)",
            self.expert_parallel,
        )
        _choice("distributed", "reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        _check(
            self.tensor_parallel >= 1,
            "distributed.tensor_parallel",
            "must be >= 1 (1: no tensor parallelism)",
            self.tensor_parallel,
        )
        _check(
            self.num_processes >= 0,
            "distributed.num_processes",
            "must be >= 0 (0: from the environment)",
            self.num_processes,
        )
        _check(
            self.process_id >= -1,
            "distributed.process_id",
            "must be >= 0, or -1 (from the environment)",
            self.process_id,
        )
        if self.num_processes and self.process_id >= self.num_processes:
            raise ConfigError(
                f"config key 'distributed.process_id' ({self.process_id}) must be below "
                f"'distributed.num_processes' ({self.num_processes})"
            )
        if self.coordinator and not re.fullmatch(r"[^:\s]+:\d+", self.coordinator):
            raise ConfigError(
                "config key 'distributed.coordinator' must be 'host:port' (process 0's "
                f"address and a free port), got {self.coordinator!r}"
            )
        _check(self.timeout_s >= 1, "distributed.timeout_s", "must be >= 1", self.timeout_s)

    @property
    def sharded(self) -> bool:
        """Whether the run spreads its state over devices (ZeRO-3, experts or both)."""
        return self.data_parallel != 1 or self.expert_parallel != 1 or self.tensor_parallel != 1

    @property
    def devices(self) -> int:
        """Devices of the run's mesh: data_parallel x expert_parallel x tensor_parallel
        (0: every device)."""
        return self.data_parallel * self.expert_parallel * self.tensor_parallel
