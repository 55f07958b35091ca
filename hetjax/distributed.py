"""Processes of a multi-host run: ``jax.distributed`` start-up, process 0. (The device
mesh and its axes: ``parallel/rules.py``.)

Every process runs the same ``python -m hetjax.launch`` command; what differs is in the
environment (or the ``distributed.*`` config keys, which win):

    HETJAX_COORDINATOR    host:port of process 0's coordination service
    HETJAX_NUM_PROCESSES  how many processes take part
    HETJAX_PROCESS_ID     this process, 0 .. n-1

Under SLURM (``srun``) they default to ``SLURM_NTASKS``, ``SLURM_PROCID`` and the first
host of ``SLURM_STEP_NODELIST`` (port ``HETJAX_COORDINATOR_PORT``, default 12355). The
launch scripts in ``launch/`` set them for local processes, SLURM and ssh.

On CPU the processes' collectives run over gloo (TCP). Checkpoints are written by
process 0 (orbax) into ``checkpoint.dir``, which every process must see.

Failure is bounded by ``distributed.timeout_s``: a peer that never arrives stops
start-up with an error naming the coordinator; a peer that dies later stops sending
heartbeats, and JAX's coordination service terminates the survivors ("another task
died") after that many seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
import time

from hetjax.config import Config, ConfigError, DistributedConfig
from hetjax.errors import UserError

DEFAULT_PORT = 12355


class DistributedError(UserError, RuntimeError):
    """The processes of a run could not be brought together; the message says why."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str  # host:port ("" for a single process)
    num_processes: int
    process_id: int


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,7],gpu1`` -> ``node03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise DistributedError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def process_group(cfg: DistributedConfig, env: dict[str, str] | None = None) -> ProcessGroup:
    """This process's place in the run: the config keys, else ``HETJAX_*``, else SLURM's
    variables, else a single process."""
    env = os.environ if env is None else env
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    def pick(value, unset, name: str, slurm_name: str | None, default):
        if value != unset:
            return value
        if name in env:
            return env[name]
        if slurm and slurm_name and slurm_name in env:
            return env[slurm_name]
        return default

    try:
        n = int(pick(cfg.num_processes, 0, "HETJAX_NUM_PROCESSES", "SLURM_NTASKS", 1))
        pid = int(pick(cfg.process_id, -1, "HETJAX_PROCESS_ID", "SLURM_PROCID", 0))
    except ValueError as e:
        raise ConfigError(
            f"HETJAX_NUM_PROCESSES / HETJAX_PROCESS_ID must be integers: {e}"
        ) from None
    if n < 1 or not 0 <= pid < n:
        raise ConfigError(
            f"process id {pid} of {n} processes: need num_processes >= 1 and "
            "0 <= process_id < num_processes (distributed.* keys or HETJAX_* variables)"
        )
    coordinator = pick(cfg.coordinator, "", "HETJAX_COORDINATOR", None, "")
    if not coordinator and slurm and n > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        if nodes:
            port = env.get("HETJAX_COORDINATOR_PORT", str(DEFAULT_PORT))
            coordinator = f"{first_slurm_host(nodes)}:{port}"
    if n > 1 and not coordinator:
        raise ConfigError(
            f"{n} processes need a coordinator: set distributed.coordinator=host:port (or "
            "HETJAX_COORDINATOR) to process 0's address and a free port"
        )
    return ProcessGroup(coordinator, n, pid)


def initialize(config: Config) -> ProcessGroup:
    """Starts ``jax.distributed`` when the run has more than one process; returns the
    group. Waits at most ``distributed.timeout_s`` for the others, then stops with an
    error (never hangs). Call before anything else uses JAX."""
    cfg = config.distributed
    group = process_group(cfg)
    if group.num_processes == 1:
        return group
    if not cfg.sharded:
        raise ConfigError(
            f"{group.num_processes} processes train one model only with data "
            "parallelism: set distributed.data_parallel=0 (every device of every process)"
        )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host, port = group.coordinator.rsplit(":", 1)
    timeout = cfg.timeout_s
    say = f"hetjax: process {group.process_id} of {group.num_processes}"
    print(f"{say}: joining coordinator {group.coordinator} (timeout {timeout} s)", file=sys.stderr)
    if group.process_id != 0:
        _wait_reachable(host, int(port), timeout, group)
    # jax.distributed aborts the process (no exception) when its own timeout passes, with
    # a message about dead tasks; this watchdog fires first and says what happened.
    joined = threading.Event()

    def watchdog():
        if not joined.wait(timeout):
            print(
                f"{say}: error: not every process joined coordinator {group.coordinator} "
                f"within distributed.timeout_s={timeout} s. Start all {group.num_processes} "
                "processes (ids 0..n-1, the same coordinator and num_processes) or raise "
                "the timeout",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="hetjax-join-watchdog").start()
    jax.distributed.initialize(
        group.coordinator,
        group.num_processes,
        group.process_id,
        initialization_timeout=timeout + 30,
        heartbeat_timeout_seconds=timeout,
    )
    joined.set()
    print(
        f"{say}: joined; {jax.device_count()} devices in all, {jax.local_device_count()} here. "
        f"If a process dies the others stop within {timeout} s",
        file=sys.stderr,
    )
    return group


def _wait_reachable(host: str, port: int, timeout: float, group: ProcessGroup) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {group.process_id}: coordinator {group.coordinator} unreachable "
                    f"for distributed.timeout_s={int(timeout)} s ({e}). Is process 0 running, "
                    "and is the address one this host can reach?"
                ) from None
            time.sleep(0.5)


def is_main_process() -> bool:
    """Process 0 writes metrics, logs and summary files; the others stay quiet."""
    import jax

    return jax.process_index() == 0


def any_process(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true if it is true on any process: one tiny all-gather with several
    processes (every process must call it at the same point), nothing with one. The
    training loop combines its stop and checkpoint-due flags with it between steps, so
    every process decides alike (the gradient norm already costs one such call a step)."""
    import jax

    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    import numpy as np
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(np.asarray(flags, np.int32))  # (P, flags)
    return tuple(bool(f) for f in np.asarray(every).reshape(-1, len(flags)).any(axis=0))
