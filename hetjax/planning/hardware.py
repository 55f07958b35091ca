"""Hardware profiles the planner (``hetjax/planning/search.py``) plans against.

A profile is what the planner needs to know about a machine: per accelerator its memory,
the FLOP/s a transformer block achieves in the compute dtype and the host<->device
bandwidth each way; per machine its RAM, NVMe bandwidth and capacity, and how fast the
host optimizer updates parameters. Named profiles describe the machines of the papers
hetjax is measured against (their sources are in :data:`PROFILES`); ``local`` is measured
on the spot by :func:`measure_local` (a second or two, cached per process).

Figures are bytes, bytes/s and FLOP/s. Where a paper does not state a figure the profile
says which assumption stands in for it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from hetjax.config_values import ConfigError

GB = 1e9
GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    description: str
    source: str
    num_devices: int  # accelerators per machine
    device_memory: int  # bytes per accelerator
    device_flops: float  # FLOP/s a transformer block achieves, per accelerator
    host_memory: int  # bytes of RAM per machine
    h2d_bw: float  # host -> device bytes/s, per accelerator
    d2h_bw: float  # device -> host bytes/s, per accelerator
    nvme_read_bw: float  # bytes/s, all SSDs of the machine together
    nvme_write_bw: float
    nvme_capacity: int  # bytes free for hetjax's state
    optimizer_params_per_s: float  # host optimizer (AdamW) updates per second, per machine
    interconnect_bw: float = 0.0  # device <-> device bytes/s per accelerator (collectives)
    device_memory_bw: float = 0.0  # bytes/s of the accelerator's memory (device optimizer)
    # True on the CPU backend: "device" compute, copies and the host optimizer run on the
    # same cores, so their times add instead of overlapping.
    shared_cores: bool = False
    # True on the CPU backend: the "device" memory is host RAM, the same bytes as
    # ``host_memory``: the device and host budgets share them (``search.budgets``).
    shared_memory: bool = False
    # ``device_memory`` is the physical memory (a named profile), or what this process's
    # allocator has free, measured (``local``): the pool the fraction already applies to
    measured_pool: bool = False

    def device_pool(self, fraction: float) -> int:
        """Bytes per accelerator that JAX's allocator may take: ``fraction``
        (``memory.device_fraction``, XLA_PYTHON_CLIENT_MEM_FRACTION) of the physical
        memory, or the pool measured here as it is."""
        return self.device_memory if self.measured_pool else int(fraction * self.device_memory)

    def describe(self) -> str:
        nvme = (
            f"NVMe {self.nvme_read_bw / GB:.1f}/{self.nvme_write_bw / GB:.1f} GB/s read/write, "
            f"{self.nvme_capacity / GB:,.0f} GB"
            if self.nvme_capacity
            else "no NVMe"
        )
        return (
            f"{self.name}: {self.description}; {self.num_devices} x "
            f"{self.device_memory / GiB:.0f} GiB at {self.device_flops / 1e12:.3g} TFLOP/s, "
            f"host {self.host_memory / GiB:,.0f} GiB, PCIe {self.h2d_bw / GB:.1f}/"
            f"{self.d2h_bw / GB:.1f} GB/s, {nvme}, optimizer "
            f"{self.optimizer_params_per_s / 1e9:.2f} G params/s"
        )


# Fuyou's server (Fuyou, table 3): one A100-80GB or RTX 4090, Xeon Gold 5320, 768 GB
# DDR4-3200, 12 x Intel P5510 3.84 TB, PCIe 4. Block FLOP/s: Fuyou states its 172 TFLOPS
# (A100) and 87 TFLOPS (4090) on 175B are 86% and 53% of the peak it measured on one
# transformer block, so 200 and 164 TFLOP/s. SSDs: Intel's P5510 datasheet, 6.5 GB/s
# sequential read and 3.4 GB/s write each. PCIe 4 x16: 25 GB/s each way in practice.
# Optimizer: assumed half of the 8-channel DDR4-3200 bandwidth (204.8 GB/s) at 28 bytes
# per AdamW parameter.
_FUYOU = dict(
    host_memory=768 * GB,
    h2d_bw=25 * GB,
    d2h_bw=25 * GB,
    nvme_read_bw=12 * 6.5 * GB,
    nvme_write_bw=12 * 3.4 * GB,
    nvme_capacity=int(12 * 3.84e12),
    optimizer_params_per_s=204.8 * GB / 2 / 28,
)

# The H100 machine this project is sometimes lent: 80 GB HBM3 (81,559 MiB, as
# nvidia-smi reports an H100 80GB), 128 GB RAM, 64 GB disk, 16 CPU cores. Assumed:
# 60% of the 989 TFLOP/s bf16 dense peak on a block,
# PCIe 5 at 50 GB/s, the disk at 2 GB/s, the optimizer at 1.3 G params/s (the
# DeepSpeed CPU Adam rate measured on 2 cores here, scaled by nothing: conservative).
_H100 = Hardware(
    name="h100",
    description="one H100-80GB, 128 GB RAM, 64 GB disk",
    source="the device tool's machine (/work/.library/device/README.md); assumptions "
    "in hetjax/planning/hardware.py",
    num_devices=1,
    device_memory=81_559 << 20,
    device_flops=0.6 * 989e12,
    host_memory=128 * GB,
    h2d_bw=50 * GB,
    d2h_bw=50 * GB,
    nvme_read_bw=2 * GB,
    nvme_write_bw=2 * GB,
    nvme_capacity=64 * GB,
    optimizer_params_per_s=1.3e9,
    device_memory_bw=3.35e12,  # H100 SXM HBM3: 3.35 TB/s
)

PROFILES: dict[str, Hardware] = {
    "a100-80g": Hardware(
        name="a100-80g",
        description="Fuyou's server with one A100-80GB",
        source="Fuyou (Liao et al. 2024) table 3 and section 5; Intel P5510 datasheet",
        num_devices=1,
        device_memory=80 * GiB,
        device_flops=200e12,
        device_memory_bw=2.0e12,  # A100-80GB HBM2e: 2,039 GB/s
        **_FUYOU,
    ),
    "rtx4090": Hardware(
        name="rtx4090",
        description="Fuyou's server with one RTX 4090 24GB",
        source="Fuyou (Liao et al. 2024) table 3 and section 5; Intel P5510 datasheet",
        num_devices=1,
        device_memory=24 * GiB,
        device_flops=164e12,
        device_memory_bw=1.0e12,  # RTX 4090 GDDR6X: 1,008 GB/s
        **_FUYOU,
    ),
    # Angel-PTM section 6.1: 8 x A100-40GB per server with NVLink-3 (300 GB/s each way
    # per GPU), 1 TB RAM, PCIe 32 GB/s, SSD peak 3.5 GB/s. Block FLOP/s assumed as on
    # Fuyou's A100 (200). Optimizer as Fuyou's server (same DDR4 class).
    "angel-a100-40g": Hardware(
        name="angel-a100-40g",
        description="Angel-PTM's server, 8 x A100-40GB, 1 TB RAM",
        source="Angel-PTM (Nie et al. 2023) section 6.1 and table 3",
        num_devices=8,
        device_memory=40 * GiB,
        device_flops=200e12,
        host_memory=1000 * GB,
        h2d_bw=32 * GB,
        d2h_bw=32 * GB,
        nvme_read_bw=3.5 * GB,
        nvme_write_bw=3.5 * GB,
        nvme_capacity=int(7.68e12),  # capacity not stated: assumed 2 x 3.84 TB
        optimizer_params_per_s=204.8 * GB / 2 / 28,
        interconnect_bw=300 * GB,
        device_memory_bw=1.55e12,  # A100-40GB HBM2: 1,555 GB/s
    ),
    # PatrickStar section 9: 8 x V100-32GB, a 12-core CPU, 240 GB RAM, no SSD tier.
    # V100 fp16 tensor-core peak 125 TFLOP/s, assumed 70% on a block; PCIe 3 x16
    # 12 GB/s; NVLink-2 150 GB/s each way. Optimizer: 12 cores of DDR4 (assumed 6 channels
    # of DDR4-2666, 128 GB/s, half of it) at 28 bytes/param.
    "patrickstar-v100": Hardware(
        name="patrickstar-v100",
        description="PatrickStar's node, 8 x V100-32GB, 240 GB RAM",
        source="PatrickStar (Fang et al. 2022) section 9.1",
        num_devices=8,
        device_memory=32 * GiB,
        device_flops=0.7 * 125e12,
        host_memory=240 * GB,
        h2d_bw=12 * GB,
        d2h_bw=12 * GB,
        nvme_read_bw=0.0,
        nvme_write_bw=0.0,
        nvme_capacity=0,
        optimizer_params_per_s=128 * GB / 2 / 28,
        interconnect_bw=150 * GB,
        device_memory_bw=0.9e12,  # V100 HBM2: 900 GB/s
    ),
    "h100": _H100,
    # The H200 the device tool lends (issue #59): 141 GB HBM3e (143,771 MiB as nvidia-smi
    # reports an H200; the tool says "about 139 GiB"), the H100's machine otherwise (128
    # GB RAM, 64 GB disk, 16 cores, PCIe 5), the h100's assumptions (60% of the same 989
    # TFLOP/s bf16 dense peak: same SMs); its HBM3e moves 4.8 TB/s.
    "h200": dataclasses.replace(
        _H100,
        name="h200",
        description="one H200-141GB, 128 GB RAM, 64 GB disk",
        device_memory=143_771 << 20,
        device_memory_bw=4.8e12,  # H200 HBM3e: 4.8 TB/s
    ),
    # NVIDIA GH200 Grace Hopper (the 96 GB HBM3 part): a Hopper GPU (the H100's 989
    # TFLOP/s bf16 dense peak, 4 TB/s HBM3) joined to a 72-core Arm Grace CPU with 480 GB
    # LPDDR5X by NVLink-C2C, 900 GB/s both ways together (450 each way), NVIDIA's
    # datasheet. Assumed: 60% of the peak on a block, half the C2C's nominal rate each
    # way, one 4 GB/s NVMe drive with 1 TB free, and the optimizer at 4x the h100
    # machine's 16 cores' rate (72 cores, LPDDR5X at 500 GB/s). Not yet measured.
    "gh200": Hardware(
        name="gh200",
        description="one GH200 (96 GB HBM3, 72-core Grace, 480 GB LPDDR5X)",
        source="NVIDIA's GH200 datasheet; assumptions in hetjax/planning/hardware.py",
        num_devices=1,
        device_memory=96 * GB,
        device_flops=0.6 * 989e12,
        host_memory=480 * GB,
        h2d_bw=225 * GB,
        d2h_bw=225 * GB,
        nvme_read_bw=4 * GB,
        nvme_write_bw=4 * GB,
        nvme_capacity=1000 * GB,
        optimizer_params_per_s=4 * 1.3e9,
        device_memory_bw=4.0e12,  # Hopper HBM3 (96 GB): 4 TB/s
    ),
}

NAMES = (*PROFILES, "local")


class HardwareError(ConfigError):
    """An unknown profile, or a device that does not say how much memory it has."""


def get_profile(name: str, nvme_path: str | Path | None = None, dtype: str = "float32"):
    """The named profile, or ``local`` measured here (``nvme_path``: where NVMe state
    would go, measured for bandwidth and free space; ``dtype``: the compute dtype)."""
    if name == "local":
        return measure_local(str(nvme_path or ""), dtype)
    if name not in PROFILES:
        raise HardwareError(
            f"unknown hardware profile {name!r}; known: {', '.join(NAMES)} (local measures "
            "this machine)"
        )
    return PROFILES[name]


# -- measuring this machine --------------------------------------------------------------


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _best_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up (compile, first touch)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(dtype: str = "float32") -> float:
    """FLOP/s of a square matmul on the default device in ``dtype``."""
    import jax
    import jax.numpy as jnp

    n = 1024 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _best_time(lambda: f(a).block_until_ready())


def measure_transfer(nbytes: int = 64 << 20, page: int = 4 << 20) -> tuple[float, float]:
    """Host (``pinned_host``) -> device and device -> host bytes/s of a list of pages in
    one ``device_put``, the way the streaming runtime moves slabs."""
    import jax

    from hetjax.parallel.single import Shardings

    place = Shardings.single_device()
    pages = [np.ones(page // 4, np.float32) for _ in range(nbytes // page)]
    host = jax.block_until_ready(jax.device_put(pages, place.host))
    dev = jax.block_until_ready(jax.device_put(pages, place.device))
    h2d = _best_time(lambda: jax.block_until_ready(jax.device_put(host, place.device)))
    d2h = _best_time(lambda: jax.block_until_ready(jax.device_put(dev, place.host)))
    return nbytes / h2d, nbytes / d2h


def drop_page_cache(directory: Path) -> None:
    """Evicts a directory's files from the page cache (clean pages; no root needed)."""
    for f in Path(directory).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _fsync_files(directory: Path) -> None:
    """Waits until a directory's files are on disk (theirs alone: ``os.sync`` would
    wait for every other process's dirty pages too)."""
    for f in Path(directory).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def measure_nvme(directory: Path, nbytes: int = 64 << 20, page: int = 4 << 20, repeats: int = 3):
    """Write (until on disk) and cold-read bytes/s of whole pages through TensorStore
    (:class:`hetjax.storage.nvme.PageStore`) in ``directory``, the best of ``repeats``
    (a drive's rate, not another process's moment on it: single probes here varied by
    +-25%, docs/results/2026-11-27.md); the files are removed after."""
    from hetjax.storage.nvme import PageStore

    elems, pages = page // 4, nbytes // page
    work = Path(tempfile.mkdtemp(prefix=".hetjax-probe-", dir=directory))
    read = write = 0.0
    try:
        store = PageStore(work / "ts", ["probe"], pages, elems)
        data = np.random.default_rng(0).random(pages * elems, dtype=np.float32)
        store.write("probe", 0, data[: 2 * elems]).result()  # thread pools, first files
        _fsync_files(work)
        for _ in range(repeats):
            t0 = time.perf_counter()
            pending = [
                store.write("probe", p, data[p * elems : (p + 1) * elems]) for p in range(pages)
            ]
            for f in pending:
                f.result()
            _fsync_files(work)
            write = max(write, nbytes / (time.perf_counter() - t0))
            drop_page_cache(work / "ts")  # a cold read
            t0 = time.perf_counter()
            for r in [store.read("probe", p, 1) for p in range(pages)]:
                r.result()
            read = max(read, nbytes / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return read, write


def slab_optimizer(n: int, compute_dtype: str, page_elems: int = 1 << 20, kernel: str = "auto"):
    """The host optimizer (AdamW, default config, ``optimizer.host_kernel=kernel``) over
    one ``n``-element slab ``"s"``, all of it weight-decayed, state in host RAM: what the
    optimizer benchmarks update."""
    import jax

    from hetjax.config import OptimizerConfig
    from hetjax.optimizer.slab import SlabOptimizer
    from hetjax.parallel.single import Shardings
    from hetjax.storage.pages import Leaf, SlabLayout

    layout = SlabLayout(
        leaves=(Leaf(("w",), (n,), 0, n),),
        treedef=jax.tree.structure(0),
        tree_order=(0,),
        num_decay=n,
        size=n,
        page_elems=page_elems,
    )
    return SlabOptimizer(
        OptimizerConfig(host_kernel=kernel),
        100,
        {"s": layout},
        Shardings.single_device().optimizer,
        compute_dtype,
    )


def measure_optimizer(n: int = 1 << 22, compute_dtype: str = "float32") -> float:
    """AdamW updates per second of the host optimizer (:class:`SlabOptimizer`, as the
    update loop runs it: new state into the copy before last, the gradient an
    aligned slab as the streaming runtime hands it over) on one ``n``-element slab in RAM,
    refreshing ``compute_dtype`` params; best of a few."""
    import jax

    from hetjax.storage.pages import aligned_concatenate

    opt = slab_optimizer(n, compute_dtype)
    size = opt.layouts["s"].padded_size
    state = opt.init("s", np.ones(size, np.float32))
    spare = opt.init("s", np.ones(size, np.float32))[0]
    grad = aligned_concatenate([np.full(size, 1e-3, np.float32)])

    def update():  # the new state into the copy before last, as the loop does
        nonlocal state, spare
        slabs, scalars, pages = opt.update("s", *state, grad, (0.0, 0.0), spare=spare)
        jax.block_until_ready((slabs, pages))
        state, spare = (slabs, scalars), state[0]

    return size / _best_time(update, repeats=5)


def device_capacity(device=None) -> int:
    """Free bytes of ``device`` (default: the first): what its allocator's pool has
    left. On the CPU backend "device" memory is host RAM, so what RAM is free. An
    accelerator that does not report its pool (``memory_stats()`` without
    ``bytes_limit``) is an error, never taken for host RAM."""
    import jax

    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return _mem_available()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise HardwareError(
            f"{device.device_kind} ({device.platform}) does not report its memory "
            "(memory_stats() has no bytes_limit): set memory.device_budget to the bytes "
            "the run may use on it"
        )
    return max(0, int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def measure_device_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of the first device's memory: a jitted copy-with-add of ``nbytes``
    (read once, written once), best of a few. What a device-side optimizer update
    streams at."""
    import jax

    x = jax.device_put(np.ones(nbytes // 4, np.float32))
    step = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(step(x))
    return 2 * nbytes / _best_time(lambda: jax.block_until_ready(step(x)), repeats=5)


def drives_bandwidth(dirs: list[Path], measure) -> tuple[float, float, int]:
    """Read and write bytes/s and capacity of the NVMe drives ``dirs`` name (one per
    drive, ``memory.nvme_path``), their pages striped over them (``storage/stripes.py``):
    each distinct device measured once (``measure(dir) -> (read, write)``) and the
    bandwidths summed (directories on one device share it); the capacity is the
    smallest free space times the directories' count (each holds 1/n of the pages)."""
    by_device: dict[int, Path] = {}
    for d in dirs:
        by_device.setdefault(os.stat(d).st_dev, d)
    measured = [measure(d) for d in by_device.values()]
    free = min(shutil.disk_usage(d).free for d in dirs) * len(dirs)
    return sum(r for r, _ in measured), sum(w for _, w in measured), free


@functools.lru_cache(maxsize=4)
def measure_local(nvme_path: str = "", dtype: str = "float32") -> Hardware:
    """This machine, measured now (a few seconds; cached for the process)."""
    import jax

    device = jax.local_devices()[0]
    cpu = device.platform == "cpu"
    host_free = _mem_available()
    try:
        device_memory = device_capacity()
    except HardwareError:  # unknown: the plan then needs memory.device_budget
        device_memory = 0
    drives = [d.strip() for d in nvme_path.split(",")] if nvme_path else []
    dirs = [Path(d) for d in drives] or [Path(tempfile.gettempdir())]
    dirs = [next((p for p in (d, *d.parents) if p.exists()), Path("/")) for d in dirs]
    try:
        nvme_read, nvme_write, nvme_free = drives_bandwidth(dirs, measure_nvme)
    except OSError:  # not writable: no NVMe tier
        nvme_read = nvme_write = 0.0
        nvme_free = 0
    h2d, d2h = measure_transfer()
    return Hardware(
        name="local",
        description=f"this machine, measured ({device.device_kind}, {os.cpu_count()} CPUs, "
        f"NVMe probe in {', '.join(map(str, dirs))})",
        source="measured by hetjax.planning.hardware.measure_local",
        num_devices=1,
        device_memory=device_memory,
        device_flops=measure_matmul_flops(dtype),
        host_memory=host_free,
        h2d_bw=h2d,
        d2h_bw=d2h,
        nvme_read_bw=nvme_read,
        nvme_write_bw=nvme_write,
        nvme_capacity=nvme_free,
        optimizer_params_per_s=measure_optimizer(compute_dtype=dtype),
        device_memory_bw=measure_device_bandwidth(64 << 20 if cpu else 1 << 30),
        shared_cores=cpu,
        shared_memory=cpu,
        measured_pool=not cpu,
    )
