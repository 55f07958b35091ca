"""Benchmarks: ``python -m hetjax.bench <name> [--quick] [--out FILE]``.

Each benchmark measures everything it compares in the same run, prints a table and a
ratio, and writes its results as JSON (default ``runs/bench/<name>.json``).

  overhead  streamed (``offload.mode=stream``) vs in-memory (``none``) step time on a
            compute-bound config
  slabs     moving one block's params host -> device as one page slab vs leaf by leaf
  attention a GPT-2-small block's backward with the reference attention vs the
            blockwise one at T 1024 and 2048: XLA's temporary bytes and the time
  keep      per offload.keep_level: the bytes a kept GPT block holds from forward to
            backward and its backward's time, vs keeping all and vs recomputing
  nvme      the NVMe tier and host optimizer against their limits, in one run:
            TensorStore read/write GB/s vs the raw disk (O_DIRECT), optimizer params/s
            vs the memory-bandwidth bound (28 B/param), step time vs max(compute,
            optimizer, I/O), and the DeepSpeed ZeRO-3 NVMe peer shape's s/step
  peer      the DeepSpeed comparison's shape (310.8M params) in memory, optimizer on
            NVMe, params and optimizer on NVMe, and with a 3 GiB host budget: s/step,
            peak RSS (child processes), disk bytes/step vs max(compute, disk time)
  guard     the speed guard (CI's alone leg): a mid shape (23M params) in memory and with
            params and optimizer on NVMe, offloaded / in-memory s/step against its bound
  checkpoint  checkpoints of the NVMe tier at the peer shape: none, hard-linked, copied:
            time in the step and in the background, bytes linked and written, peak RSS
  io        the TensorStore tier's read/write GB/s vs the raw sequential disk (O_DIRECT)
            (--nvme-path /a,/b: each drive probed, and their sum as the planner takes it)
  optimizer the host optimizer's params/s vs the memory-bandwidth bound (28 B/param)
  lockfree  optimizer.mode=lockfree vs sync on a tiny model: final losses, step time
  scale     the largest GPT that trains 3 steps offloaded within a 1 GiB device and 6 GiB
            host budget vs the largest that fits 1 GiB in memory (offload.mode=none)
  gpu       (GPU only) MFU offloaded vs in HBM, TFLOP/s of a model larger than HBM
  plan      the planner's predicted step time vs the measured one, tiny and small GPTs
            under a device budget that makes offload.mode=auto stream, and the tiny
            GPT data-parallel (ZeRO-3) on 2 virtual CPU devices
  soak      1,000 steps (--quick: 300) with params and optimizer on NVMe under a host
            budget, a checkpoint every 50: RSS, descriptors, threads, NVMe and checkpoint
            files every 25 steps, flat after warm-up; step time with no upward trend
  generate  hetjax generate's tokens/s in memory vs the blocks streamed from NVMe, at
            GPT-2 small's and Llama 3.2 1B's shapes
  state_dtype  convergence with the optimizer's moments in float32, bfloat16 and int8
            (optimizer.state_dtype): gpt_tiny 400 steps and GPT-2 small's shape 200
            steps, final validation losses and the loss curves in one PNG
  zero      ZeRO-3 on 1, 2, 4 devices: collective bytes per step and device vs the
            6(p-1)/p M of PatrickStar / Angel-PTM, and s/step (needs 4 devices: on CPU
            XLA_FLAGS=--xla_force_host_platform_device_count=4)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from hetjax.allocator import tune_host_allocator
from hetjax.bench.attention import bench_attention
from hetjax.bench.checkpoint import bench_checkpoint
from hetjax.bench.generate import bench_generate
from hetjax.bench.gpu import bench_gpu
from hetjax.bench.guard import bench_guard
from hetjax.bench.io import bench_io
from hetjax.bench.keep import bench_keep
from hetjax.bench.lockfree import bench_lockfree
from hetjax.bench.nvme import bench_nvme
from hetjax.bench.optimizer import bench_optimizer
from hetjax.bench.overhead import bench_overhead
from hetjax.bench.peer import bench_peer
from hetjax.bench.plan import bench_plan
from hetjax.bench.scale import bench_scale
from hetjax.bench.slabs import bench_slabs
from hetjax.bench.soak import bench_soak
from hetjax.bench.state_dtype import bench_state_dtype
from hetjax.bench.zero import bench_zero
from hetjax.gpucheck import probe_platform

BENCHMARKS = {
    "overhead": bench_overhead,
    "slabs": bench_slabs,
    "nvme": bench_nvme,
    "peer": bench_peer,
    "guard": bench_guard,
    "checkpoint": bench_checkpoint,
    "io": bench_io,
    "optimizer": bench_optimizer,
    "lockfree": bench_lockfree,
    "scale": bench_scale,
    "gpu": bench_gpu,
    "zero": bench_zero,
    "plan": bench_plan,
    "keep": bench_keep,
    "attention": bench_attention,
    "soak": bench_soak,
    "generate": bench_generate,
    "state_dtype": bench_state_dtype,
}

# Benchmarks that print their rows against the previous results file (the JSON at --out)
AGAINST_PREVIOUS = frozenset({"peer", "guard"})

# Benchmarks whose rows run in child processes that each need the device's whole memory
# pool: this process never starts JAX's backend (on a GPU it would take the pool).
CHILDREN_OWN_THE_DEVICE = frozenset({"gpu"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetjax.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="a reduced run (for tests)")
    parser.add_argument("--out", default=None, help="JSON output (default runs/bench/NAME.json)")
    parser.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="LAYERSxD",
        help="scale: start the offloaded sizes at this one (e.g. 72x1536)",
    )
    parser.add_argument(
        "--nvme-path",
        default="",
        metavar="DIRS",
        help="io: the NVMe directories, one per drive, comma-separated (memory.nvme_path): "
        "each drive probed and the bandwidths summed as the planner sums them",
    )
    parser.add_argument(
        "--state-dtype",
        default="",
        help="scale: the optimizer moments' dtype (optimizer.state_dtype; default fp32)",
    )
    args = parser.parse_args(argv)
    tuned = tune_host_allocator()  # as a training run does
    if args.name in CHILDREN_OWN_THE_DEVICE:  # asked of a child: this process stays off it
        platform = probe_platform()[0] or "unknown"
        device = platform
    else:
        platform, device = jax.devices()[0].platform, jax.devices()[0].device_kind
    print(
        f"hetjax bench {args.name}: {device} ({platform}), jax {jax.__version__}, host "
        "allocator "
        f"{'keeps freed blocks' if tuned else 'not tuned (HETJAX_MALLOC or MALLOC_* set)'}"
    )
    if args.start and args.name != "scale":
        parser.error("--from applies to the scale benchmark only")
    if args.state_dtype and args.name != "scale":
        parser.error("--state-dtype applies to the scale benchmark only")
    extra = {"start": args.start} if args.start else {}
    if args.state_dtype:
        extra["state_dtype"] = args.state_dtype
    if args.nvme_path and args.name != "io":
        parser.error("--nvme-path applies to the io benchmark only")
    if args.nvme_path:
        extra["nvme_path"] = args.nvme_path
    out = Path(args.out or f"runs/bench/{args.name}.json")
    if args.name in AGAINST_PREVIOUS:
        extra["previous"] = json.loads(out.read_text()) if out.is_file() else None
    result = BENCHMARKS[args.name](args.quick, **extra)
    result.update(
        name=args.name,
        quick=args.quick,
        platform=platform,
        host_allocator_tuned=tuned,
        date=time.strftime("%Y-%m-%d"),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
