"""gpucheck's sections of the data path: environment, placement, bandwidth, overlap."""

from __future__ import annotations

import time

from hetjax.gpucheck.common import (
    DUPLEX_GAIN,
    MIN_PINNED_GBS,
    NUMPY_VS_CROSS_CLIENT,
    OVERLAP_SLOWDOWN,
    PAGES_VS_SLAB,
    GiB,
    MiB,
    Report,
    Run,
    _gbs,
)

# the planner's measurements' timer and free-RAM reading (importing them starts no JAX)
from hetjax.planning.hardware import _best_time


def environment(report: Report, run: Run) -> None:
    from importlib.metadata import version

    import jax

    from hetjax import xla_env
    from hetjax.optimizer import native

    packages = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore")
    versions = {name: version(name) for name in packages}
    report.check("versions", True, " ".join(f"{k} {v}" for k, v in versions.items()), **versions)
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    report.check(
        "device",
        accelerator,
        f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s)",
        platform=device.platform,
        kind=device.device_kind,
    )
    kinds = sorted(m.kind for m in device.addressable_memories())
    report.check("memory_kinds", {"device", "pinned_host"} <= set(kinds), ", ".join(kinds))
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    report.check(
        "bytes_limit",
        limit > 0 if accelerator else None,
        f"{limit / GiB:.1f} GiB allocatable ({xla_env.mem_fraction_setting()}, pinned limit "
        f"{xla_env.pinned_limit() / GiB:.0f} GiB)",
        bytes_limit=limit,
    )
    _attention(report, run)
    if native._compiler() is None:  # the kernel is optional: optax runs instead
        report.check("native_kernel", None, "no C++ compiler (g++, c++, clang++ or CXX): optax")
        return
    try:
        lib = native.load()
        report.check("native_kernel", True, f"built: {lib._name}")
    except native.NativeKernelError as e:
        report.check("native_kernel", False, f"{e} (optax runs instead, slower)")


def _attention(report: Report, run: Run) -> None:
    """Which attention ``model.attention=auto`` runs here in bf16 at the mfu section's
    head width and sequence: cuDNN's fused kernel where its probe (forward and
    backward) passes, else the blockwise attention (a FAIL: cuDNN is part of a CUDA
    jaxlib, and the runs go on slower without it)."""
    import jax

    from hetjax.gpucheck.common import MFU_SHAPES
    from models import attention

    s = MFU_SHAPES[run.quick]
    head, backend = s["d"] // s["heads"], jax.default_backend()
    if not attention.fused_supported(backend, "bfloat16", head):
        report.check("attention", None, f"{backend}: auto runs the blockwise attention (no cuDNN)")
        return
    ok = attention.probe_fused("bfloat16", head, s["seq"], (s["heads"], 1))
    why = attention.PROBED[("bfloat16", head)]
    report.check(
        "attention",
        ok,
        f"bf16, head width {head}, {s['seq']} positions: auto runs "
        + ("cuDNN's fused attention" if ok else f"the blockwise attention; cuDNN: {why}"),
        attention="fused" if ok else "blockwise",
    )


def placement(report: Report, run: Run) -> None:
    import jax
    import numpy as np

    from hetjax.parallel.single import Shardings

    place = Shardings.single_device()
    x = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)
    for dtype in ("float32", "bfloat16"):
        a = x.astype(dtype)
        on_device = jax.device_put(a, place.device)
        hops = {
            "pinned_host": jax.device_put(jax.device_put(on_device, place.host), place.device),
            "host optimizer": jax.device_put(
                jax.device_put(on_device, place.optimizer), place.device
            ),
        }
        for via, back in hops.items():
            same = np.array_equal(np.asarray(back), a)
            report.check(
                f"round_trip_{dtype}_{via.replace(' ', '_')}",
                same,
                f"device -> {via} -> device, {a.nbytes >> 20} MiB {dtype}: "
                + ("bit-exact" if same else "values differ"),
            )
    # The host optimizer reads gradients in pinned_host through numpy views: a copy
    # there would double the host's memory traffic.
    pinned = jax.block_until_ready(jax.device_put(x, place.host))
    view = np.asarray(pinned)
    buffer = pinned.addressable_data(0).unsafe_buffer_pointer()
    shared = view.ctypes.data == buffer
    found = "a view of its buffer" if shared else f"a copy ({view.ctypes.data:#x} vs {buffer:#x})"
    report.check(
        "zero_copy_view", shared, f"np.asarray of a {x.nbytes >> 20} MiB pinned_host array: {found}"
    )


def runtime_copies(d_model: int = 4096, heads: int = 32) -> dict[str, list[int]]:
    """The bytes of each copy the streaming runtime makes for one block of a bf16 GPT of
    width ``d_model`` (by default the mfu section's, d 4096): ``h2d``, its params to the
    device leaf by leaf (``pages.LeafBuffers``), and ``d2h``, its gradient to the host
    page by page (``memory.page_size``'s pages, in ``memory.block_grad_dtype``). From
    the layouts the runtime makes (abstract shapes: nothing allocated)."""
    import numpy as np

    from hetjax.config import Config
    from hetjax.memory import block_grad_dtype
    from hetjax.parallel.layouts import stage_layouts
    from models import build_model

    config = Config().replace(
        model=dict(d_model=d_model, num_heads=heads, num_layers=1, compute_dtype="bfloat16"),
    )
    model = build_model(config.model)
    layout = stage_layouts(model, config.memory.page_size, leaf_buffers=True)["block"]
    grad = np.dtype(block_grad_dtype(config)).itemsize
    param = np.dtype(config.model.compute_dtype).itemsize
    return {
        "h2d": [leaf.size * param for leaf in layout.leaves],
        "d2h": [layout.page_elems * grad] * (layout.padded_size // layout.page_elems),
    }


def _sized(sizes: list[int]) -> list:
    import numpy as np

    return [np.ones(n // 2, np.uint16) for n in sizes]  # 2-byte elements, as bf16


def bandwidth(report: Report, run: Run) -> None:
    """Host <-> device rates at the sizes the runtime moves (:func:`runtime_copies`: a
    d4096 block's params as leaves, its gradient as ~2 MiB pages) against one slab of
    the same bytes; --quick: a d2048 block (a quarter of the bytes)."""
    copies = runtime_copies(*((2048, 16) if run.quick else (4096, 32)))
    _check_rates(report, _rates(copies), copies)


def _rates(copies: dict) -> dict:
    """GB/s of each way of copying ``copies``' bytes (:func:`bandwidth`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.parallel.single import Shardings

    place = Shardings.single_device()
    nbytes = sum(copies["d2h"])
    slab = np.ones(nbytes // 4, np.float32)
    leaves, pages = _sized(copies["h2d"]), _sized(copies["d2h"])
    put = lambda a, s: jax.block_until_ready(jax.device_put(a, s))
    pinned_slab, pinned_leaves = put(slab, place.host), put(leaves, place.host)
    dev_slab, dev_pages = put(slab, place.device), put(pages, place.device)
    on_cpu_client = put(slab, place.optimizer)
    sum_leaves = sum(copies["h2d"])
    rate = {
        "h2d_slab": _gbs(nbytes, _best_time(lambda: put(pinned_slab, place.device))),
        "h2d_pages": _gbs(sum_leaves, _best_time(lambda: put(pinned_leaves, place.device))),
        "d2h_slab": _gbs(nbytes, _best_time(lambda: put(dev_slab, place.host))),
        "d2h_pages": _gbs(nbytes, _best_time(lambda: put(dev_pages, place.host))),
        "h2d_pageable": _gbs(nbytes, _best_time(lambda: put(slab, place.device))),
        # a fresh array each time: an array caches its numpy value (the device-side copy
        # is ~1% of the transfer at HBM speed)
        "d2h_pageable": _gbs(nbytes, _best_time(lambda: np.asarray(jnp.copy(dev_slab)))),
    }

    def both():
        up = jax.device_put(pinned_slab, place.device)
        down = jax.device_put(dev_slab, place.host)
        jax.block_until_ready((up, down))

    rate["duplex"] = _gbs(2 * nbytes, _best_time(both))
    # The host optimizer's refreshed params -> the device's pinned_host memory: straight
    # across JAX clients (XLA goes through a Literal) vs through a numpy view.
    rate["publish_cross_client"] = _gbs(nbytes, _best_time(lambda: put(on_cpu_client, place.host)))
    rate["publish_via_numpy"] = _gbs(
        nbytes, _best_time(lambda: put(np.asarray(on_cpu_client), place.host))
    )
    return rate


def _check_rates(report: Report, rate: dict, copies: dict) -> None:
    """The checks of :func:`bandwidth` on the measured ``rate``s."""
    nbytes = sum(copies["d2h"])
    leaves, pages = copies["h2d"], copies["d2h"]
    size = f"{nbytes >> 20} MiB"
    described = {
        "h2d": f"a block's params as its {len(leaves)} leaves ({max(copies['h2d']) >> 20} "
        "MiB the largest)",
        "d2h": f"a block's gradient as {len(pages)} pages of {copies['d2h'][0] / MiB:.1f} MiB",
    }
    for way in ("h2d", "d2h"):
        r = rate[f"{way}_slab"]
        report.check(
            f"{way}_pinned",
            r >= MIN_PINNED_GBS,
            f"{r:.1f} GB/s from a pinned {size} slab (floor {MIN_PINNED_GBS:g})",
            gbs=r,
        )
        ratio = rate[f"{way}_pages"] / r
        report.check(
            f"{way}_pages",
            ratio >= PAGES_VS_SLAB,
            f"{rate[f'{way}_pages']:.1f} GB/s as the runtime moves them, "
            f"{described[way]}: {ratio:.2f}x the slab (floor {PAGES_VS_SLAB:g})",
            gbs=rate[f"{way}_pages"],
            sizes=sorted(set(copies[way])),
        )
        pageable = rate[f"{way}_pageable"]
        report.check(
            f"{way}_pageable",
            r >= pageable,
            f"pageable {pageable:.1f} GB/s vs pinned {r:.1f}: pinned must not be slower",
            gbs=pageable,
        )
    single = max(rate["h2d_slab"], rate["d2h_slab"])
    report.check(
        "duplex",
        rate["duplex"] >= DUPLEX_GAIN * single,
        f"{rate['duplex']:.1f} GB/s both ways at once, {rate['duplex'] / single:.2f}x one way "
        f"(floor {DUPLEX_GAIN:g}x)",
        gbs=rate["duplex"],
    )
    cross, numpy_path = rate["publish_cross_client"], rate["publish_via_numpy"]
    report.check(
        "publish",
        numpy_path >= NUMPY_VS_CROSS_CLIENT * cross,
        f"host optimizer -> pinned_host through numpy (the runtime's path) {numpy_path:.1f} "
        f"GB/s vs across clients {cross:.1f} GB/s, {numpy_path / cross:.2f}x (floor "
        f"{NUMPY_VS_CROSS_CLIENT:g}x)",
        cross_client_gbs=cross,
        numpy_gbs=numpy_path,
    )


def overlap(report: Report, run: Run) -> None:
    """A matmul chain's completion alone vs with copies both ways dispatched beside it,
    the copies sized to take about as long as the chain alone: on a GPU the copy
    engines move them while the SMs compute, so the chain finishes about as soon."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hetjax.parallel.single import Shardings

    place = Shardings.single_device()
    cpu = jax.devices()[0].platform == "cpu"  # the code path only: a CPU has no copy engines
    n, depth = (256, 4) if cpu else (2048, 16) if run.quick else (4096, 16)
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16) * 0.01, place.device)

    @jax.jit
    def chain(x):
        for _ in range(depth):
            x = jnp.tanh(x @ x)
        return x

    repeats = 8
    alone = _best_time(lambda: jax.block_until_ready([chain(a) for _ in range(repeats)]))

    def buffers(nbytes):
        elems = nbytes // 4
        return (
            jax.block_until_ready(jax.device_put(np.ones(elems, np.float32), place.host)),
            jax.block_until_ready(jax.device_put(np.ones(elems, np.float32), place.device)),
        )

    def copies(host, dev):
        return [jax.device_put(host, place.device), jax.device_put(dev, place.host)]

    probe = 16 * MiB if cpu else 256 * MiB
    probes = buffers(probe)
    seconds_per_byte = _best_time(lambda: jax.block_until_ready(copies(*probes))) / probe
    cap = 256 * MiB if cpu else (1 * GiB if run.quick else 4 * GiB)
    nbytes = int(min(cap, max(16 * MiB, alone / seconds_per_byte))) // MiB * MiB
    host, dev = buffers(nbytes)
    copy_time = _best_time(lambda: jax.block_until_ready(copies(host, dev)))

    def chain_under_copies() -> float:
        t0 = time.perf_counter()
        # the chain first: a copy whose dispatch waited for its transfer would delay it
        out = [chain(a) for _ in range(repeats)]
        moving = copies(host, dev)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        jax.block_until_ready(moving)  # not timed: the chain's completion only
        return seconds

    chain_under_copies()  # warm-up
    busy = min(chain_under_copies() for _ in range(3))
    slowdown = busy / alone
    report.check(
        "compute_under_copies",
        slowdown <= OVERLAP_SLOWDOWN,
        f"matmul chain done in {alone * 1e3:.1f} ms alone, {busy * 1e3:.1f} ms with "
        f"{nbytes >> 20} MiB copied each way beside it ({copy_time * 1e3:.1f} ms alone): "
        f"{slowdown:.2f}x (ceiling {OVERLAP_SLOWDOWN:g}x)",
        alone_s=alone,
        with_copies_s=busy,
        copies_s=copy_time,
        copy_bytes=nbytes,
    )


# The bf16 fast path's equivalence, streamed vs in memory, NVMe tier (in the default run
# too): run by node id, beside the selection (--quick selects one file only).
