"""The thread that dispatches device work only dispatches (issue 19, item 1): each
stage's squared gradient norm comes out of its jitted backward, the gradient's pages go
to the optimizer as they landed on the host (the native kernel reads them, bf16 or f32,
with no concatenation and no f32 copy), the host work left runs on the step's gradient
thread, backward never waits for the optimizer, and each step reports the dispatch
thread's time outside dispatch (``dispatch_outside_s``)."""

import ml_dtypes
import numpy as np
import pytest
from conftest import require

from hetjax.config import OptimizerConfig
from hetjax.optimizer import native
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.parallel.single import Shardings
from hetjax.storage.pages import GradPages, Leaf, SlabLayout, aligned_concatenate

BF16 = np.dtype(ml_dtypes.bfloat16)


def _batch(config, seed=0) -> np.ndarray:
    t = config.train
    shape = (t.grad_accum, t.micro_batch_size, t.seq_len + 1)
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.int32)


def _layout(n, page):
    # decay ends inside the second chunk, inside a page
    return SlabLayout(
        leaves=(Leaf(("w",), (n,), 0, n),),
        treedef=None,
        tree_order=(0,),
        num_decay=2 * page + 1000,
        size=n,
        page_elems=page,
    )


# host buffers (the NVMe tier's in-place update) are the native kernel's alone
KERNEL_MODES = [(k, m) for k in ("native", "optax") for m in ("fresh", "spare", "in place")]
KERNEL_MODES.append(("native", "host"))


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel, mode", KERNEL_MODES)
def test_update_from_pages_equals_update_from_a_slab(monkeypatch, kernel, grad_dtype, mode):
    """The optimizer fed a gradient as its pages (bf16 or f32, never concatenated) gives
    bit for bit what it gives fed the same gradient as one float32 slab, in every way
    the loop calls it: fresh buffers, a spare copy, in place through XLA, and (the
    NVMe tier) in place on host buffers."""
    if kernel == "native":
        require(native._compiler() is not None, "a C++ compiler: apt-get install g++")
    import hetjax.optimizer.slab

    page, n = 4096, 6 * 4096
    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 2 * page)
    cfg = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=2, host_kernel=kernel)
    host = Shardings.single_device().optimizer
    opt = SlabOptimizer(cfg, 10, {"s": _layout(n, page)}, host, "bfloat16")
    assert opt.native == (kernel == "native")
    rng = np.random.default_rng(3)
    master = rng.normal(size=n).astype(np.float32)
    grads = [rng.normal(size=n).astype(np.float32).astype(np.dtype(grad_dtype)) for _ in range(3)]

    def run(as_pages: bool):
        state = opt.init("s", master)
        if mode == "host":
            state = ({k: np.concatenate([np.asarray(c) for c in v]) for k, v in state[0].items()},)
            state += (opt.init("s", master)[1],)
        spare = opt.init("s", master)[0]
        out = []
        for step, g in enumerate(grads):
            if as_pages:  # pages of their own buffers, as they land from the device
                grad = GradPages(tuple(np.array(p) for p in g.reshape(-1, page)))
            else:
                grad = aligned_concatenate([g.astype(np.float32)])
            clip = (8.0, 2.0) if step == 1 else (8.0, 0.0)
            if mode == "host":
                slabs, scalars, pages = opt.update_host("s", *state, grad, clip)
            else:
                kwargs = {"spare": spare} if mode == "spare" else {"in_place": mode == "in place"}
                slabs, scalars, pages = opt.update("s", *state, grad, clip, **kwargs)
            spare, state = state[0], (slabs, scalars)
            out.append(np.concatenate([np.asarray(p, np.float32) for p in pages]))
        flat = {
            k: np.concatenate([np.asarray(c) for c in opt.as_chunks("s", v)])
            for k, v in slabs.items()
        }
        return flat, out

    (from_slab, pages_slab), (from_pages, pages_pages) = run(False), run(True)
    for kind in from_slab:
        np.testing.assert_array_equal(from_pages[kind], from_slab[kind], err_msg=kind)
    for a, b in zip(pages_pages, pages_slab, strict=True):
        np.testing.assert_array_equal(a, b)


def test_host_update_reads_pages_of_any_size_and_refuses_bad_ones():
    """The kernel's host entry takes the gradient as pages of one size (a flat slab is
    one page) and refuses pages that do not cover the slab or are of another dtype."""
    require(native._compiler() is not None, "a C++ compiler: apt-get install g++")
    n, page = 4 * 4096, 4096
    rng = np.random.default_rng(5)
    g = rng.normal(size=n).astype(BF16)
    coef = np.asarray([1.0, 0.1, 0.9, 0.001, 0.999, 0.1, 0.001, 1e-8, 0.0, -1e-3], np.float32)
    results = []
    for grad in ([g], list(g.reshape(-1, page)), list(g.reshape(-1, 2 * page))):
        slabs = {k: np.full(n, 0.5, np.float32) for k in ("master", "mu", "nu")}
        out = np.empty(n, BF16)
        native.host_update(slabs, grad, coef, 0.01, n // 2, out, page)
        results.append((slabs["master"], out))
    for master, out in results[1:]:
        np.testing.assert_array_equal(master, results[0][0])
        np.testing.assert_array_equal(out.view(np.uint16), results[0][1].view(np.uint16))
    slabs = {k: np.zeros(n, np.float32) for k in ("master", "mu", "nu")}
    for bad in ([g[:-page]], [g.astype(np.float16)], [g[: n // 2], g[n // 2 :].astype(np.float32)]):
        with pytest.raises(ValueError, match="gradient must be"):
            native.host_update(slabs, bad, coef, 0.0, 0, np.empty(n, BF16), page)


# -- the dispatching thread ----------------------------------------------------------------


@pytest.mark.parametrize(
    "sections",
    [
        dict(offload=dict(mode="stream")),
        pytest.param(
            dict(offload=dict(mode="stream", optimizer="nvme"), train=dict(grad_accum=2)),
            marks=pytest.mark.slow,
        ),
        dict(offload=dict(mode="stream"), optimizer=dict(grad_clip=0.05)),
    ],
    ids=["host", "nvme-accum2", "clipping"],
)
def test_the_dispatching_thread_does_no_host_work_on_a_gradient(tiny, monkeypatch, sections):
    """Every wait for a gradient's copy, every read of its norms and every host sum of
    its pages runs on the step's gradient thread, never on the thread that dispatches
    the stage functions (the test's own); the step reports that thread's time outside
    dispatch. Training still equals the in-memory runtime (the clipping case: the
    global norm, summed from the backwards' per-page norms, binds every step)."""
    import threading

    from equivalence import assert_losses_close

    from hetjax.parallel import single as placement
    from hetjax.runtime.in_memory import InMemoryRuntime
    from hetjax.runtime.loop import grads
    from hetjax.runtime.streaming import StreamingRuntime

    callers: set[str] = set()

    def recorded(fn):
        def call(*args, **kwargs):
            callers.add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return call

    for name in ("host_grad", "host_sq"):
        monkeypatch.setattr(
            placement.SingleDevice, name, recorded(getattr(placement.SingleDevice, name))
        )
    monkeypatch.setattr(grads, "aligned_concatenate", recorded(grads.aligned_concatenate))
    config = tiny(**sections)
    runtime = StreamingRuntime(config)
    try:
        batches = [_batch(config, seed) for seed in range(3)]
        stats = [runtime.train_step(b) for b in batches]
    finally:
        runtime.close()
    assert callers == {"hetjax-gradients"}, callers
    expected = InMemoryRuntime(config)
    assert_losses_close([s.loss for s in stats], [expected.train_step(b).loss for b in batches])
    assert all(s.metrics["dispatch_outside_s"] > 0 for s in stats)  # measured each step
