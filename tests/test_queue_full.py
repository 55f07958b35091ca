"""The accelerator's dispatch order, on the CPU (issue: GPU first contact, item 7): the
window keeps one block queued on the device (it waits for use j - 2, not j - 1) and the
device plan counts the slab that holds; the two-client emulation
(``HETJAX_HOST_CLIENT=separate``) runs that order. Compute is dispatched before a
block's boundary store; what reaches the device from the host comes from pinned
buffers there; XLA's pinned cap is the host plan's pinned part plus a margin."""

import jax
import numpy as np
import pytest
from equivalence import training_batches

from hetjax import memory
from hetjax.config import ConfigError
from hetjax.parallel.single import HOST_CLIENT_ENV, Shardings


class InstantStore:
    """A param store whose stages are always ready: ``get`` returns the stage's name."""

    def prefetch(self, stage):
        pass

    def ready(self, stage):
        return True

    def get(self, stage, keep=False):
        return stage


def _window_events(monkeypatch, lag: int) -> list:
    from hetjax.runtime.loop import window as window_module

    events = []
    monkeypatch.setattr(
        window_module.jax, "block_until_ready", lambda x: events.append(("wait", x)) or x
    )
    uses = ["b0", "b1", "b2", "b2", "b1", "b0"]
    win = window_module.PrefetchWindow(
        uses,
        1,
        {},
        InstantStore(),
        lambda name, slab: events.append(("copy", name)) or slab,
        lag=lag,
    )
    for j in range(len(uses)):
        win.get(j)
        events.append(("dispatch", j))
        win.done(j, after=f"out{j}")
    return events


def test_lag_two_keeps_one_use_queued(monkeypatch):
    """With lag 2 use j is dispatched before use j - 1's result is waited for: while the
    thread waits, the device has the next block queued, never an empty queue at a
    block boundary."""
    events = _window_events(monkeypatch, lag=2)
    assert events == [
        ("copy", "b0"), ("dispatch", 0), ("copy", "b1"),
        ("dispatch", 1), ("copy", "b2"),
        ("wait", "out0"), ("dispatch", 2),
        ("wait", "out1"), ("dispatch", 3), ("copy", "b1"),
        ("wait", "out2"), ("dispatch", 4), ("copy", "b0"),
        ("wait", "out3"), ("dispatch", 5),
    ]  # fmt: skip
    for j in range(1, 5):  # use j queued before use j - 1 is waited for
        assert events.index(("dispatch", j)) < events.index(("wait", f"out{j - 1}"))


def test_lag_one_is_the_cpu_order(monkeypatch):
    """The default (the CPU backend's) waits for the previous use before each get."""
    events = _window_events(monkeypatch, lag=memory.window_wait_lag(False))
    waits = [e for e in events if e[0] == "wait"]
    assert waits == [("wait", f"out{j}") for j in range(5)]
    for j in range(1, 6):
        assert events.index(("wait", f"out{j - 1}")) < events.index(("dispatch", j))


def test_the_lag_is_one_policy():
    assert memory.window_wait_lag(False) == memory.WAIT_LAG_HOST == 1
    assert memory.window_wait_lag(True) == memory.WAIT_LAG_ACCELERATOR == 2


def test_lag_two_plans_one_more_slab():
    """The device plan with lag 2 holds one more block slab in its window: the dropped
    slab of the use still queued."""
    from test_stream import ADAM

    from hetjax.memory import Sizes, device_parts, plan_device
    from hetjax.placement import Placement

    # (as test_stream's planner test: a block slab is 25 elements of 2 bytes, 10 layers)
    s = Sizes(
        num_layers=10, embed=30, block=25, head=20, own_embed=30, own_block=25, own_head=20,
        compute_bytes=2, block_grad_bytes=2, state_format=ADAM, boundary=20, working_set=30,
        kept={"all": 0}, grad_policy="release",
    )  # fmt: skip
    o = Placement(params="host", optimizer="host", activations="host", prefetch_depth=1)
    slab = s.compute_bytes * s.block
    one, two = device_parts(s, o, 1, 0), device_parts(s, o, 1, 0, lag=2)
    assert two["blocks"] - one["blocks"] == slab
    assert {k: v for k, v in two.items() if k != "blocks"} == {
        k: v for k, v in one.items() if k != "blocks"
    }
    cpu, accelerator = plan_device(s, o, 0), plan_device(s, o, 0, lag=2)
    assert (cpu.wait_lag, accelerator.wait_lag) == (1, 2)
    assert accelerator.required - cpu.required == slab
    # a budget that holds depth 1 at lag 1 holds only depth 0 at lag 2
    tight = plan_device(s, o, cpu.required, lag=2)
    assert tight.prefetch_depth == 0 and tight.required <= cpu.required
    # a budget that holds no prefetch at lag 2 falls back to lag 1 rather than refuse
    fixed = sum(one.values()) - one["blocks"]
    tightest = plan_device(s, o, fixed + slab, lag=2)
    assert (tightest.wait_lag, tightest.prefetch_depth) == (1, 0)
    assert tightest.required == fixed + slab
    with pytest.raises(ConfigError, match="cannot hold one stage"):
        plan_device(s, o, fixed + slab - 1, lag=2)


@pytest.mark.cpu_only
def test_the_emulation_plans_and_runs_lag_two(tiny, monkeypatch):
    """The two-client emulation runs an accelerator's window (lag 2) and plans for it;
    the plain CPU backend keeps lag 1."""
    from hetjax.runtime.streaming import StreamingRuntime

    config = tiny(offload=dict(mode="stream"))
    runtime = StreamingRuntime(config)
    assert runtime.plan.wait_lag == 1
    runtime.close()
    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    runtime = StreamingRuntime(config)
    assert runtime.plan.wait_lag == 2
    assert runtime._window(runtime.schedule.uses).lag == 2
    runtime.close()


@pytest.mark.parametrize("activations", ["host", "device"])
def test_compute_is_dispatched_before_boundary_stores_and_loads(tiny, monkeypatch, activations):
    """Under the emulated GPU topology each block's forward is dispatched before its
    boundary's copy out, and in backward each block's backward before the next one's
    boundary load (which it then overlaps); results as before (``test_two_client``)."""
    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    from hetjax.runtime.streaming import StreamingRuntime

    config = tiny(offload=dict(mode="stream", activations=activations))
    runtime = StreamingRuntime(config)
    events = []
    try:
        boundaries = runtime.blocks[0].parts.boundaries
        store, load = boundaries.store, boundaries.load
        monkeypatch.setattr(
            boundaries, "store", lambda i, x: events.append(("store", i)) or store(i, x)
        )
        monkeypatch.setattr(boundaries, "load", lambda i: events.append(("load", i)) or load(i))
        for group in {id(b.group): b.group for b in runtime.blocks}.values():
            fwd, bwd = group.block_fwd, group.block_bwd
            monkeypatch.setattr(
                group, "block_fwd", lambda *a, f=fwd: events.append(("fwd", a[1].shape)) or f(*a)
            )
            monkeypatch.setattr(
                group, "block_bwd", lambda *a, f=bwd: events.append(("bwd", None)) or f(*a)
            )
        runtime.train_step(training_batches(config, 1)[0])
    finally:
        runtime.close()
    L = config.model.num_blocks
    assert config.train.grad_accum == 1  # (one micro-batch: one forward, one backward)
    kinds = [e[0] for e in events]
    # forward: fwd then store, block by block
    assert kinds[: 2 * L] == ["fwd", "store"] * L, kinds
    # backward: the last block's boundary comes back before backward starts, then each
    # block's backward is dispatched before the next one's load
    assert kinds[2 * L :] == ["load"] + ["bwd", "load"] * (L - 1) + ["bwd"], kinds


def _pinned(pieces) -> bool:
    leaves = jax.tree.leaves(pieces)
    return bool(leaves) and all(
        isinstance(a, jax.Array) and a.sharding.memory_kind == "pinned_host" for a in leaves
    )


def test_every_swap_slot_reaches_the_device_pinned(tmp_path, monkeypatch):
    """Under the emulated GPU topology every boundary and swapped block's residuals
    that the swaps hand back is a ``pinned_host`` array: read from disk, and the last
    slots kept in RAM (never written) and those taken before their write was done."""
    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    from hetjax.storage.swap import BoundarySwap, ResidualSwap

    shardings = Shardings.single_device()
    stage_to = shardings.pinned_staging()
    swap = BoundarySwap(
        tmp_path / "b", 5, (2, 3, 4), np.float32, chunk_elems=8, depth=2, stage_to=stage_to
    )
    rows = np.arange(5 * 24, dtype=np.float32).reshape(5, 2, 3, 4)
    swap.begin()
    for slot, row in enumerate(rows):
        swap.put(slot, jax.device_put(row, shardings.host))
    for slot in reversed(range(5)):
        got = swap.get(slot)
        assert _pinned(got), (slot, type(got))
        np.testing.assert_array_equal(np.asarray(got), rows[slot])
    swap.close()

    residuals = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int32)]
    nbytes = sum(a.nbytes for a in residuals)
    swap = ResidualSwap(tmp_path / "r", 3, nbytes, chunk_bytes=8, depth=1, stage_to=stage_to)
    swap.begin()
    for slot in range(3):
        swap.put(slot, jax.device_put([a + slot for a in residuals], shardings.host))
    for slot in reversed(range(3)):
        got = swap.get(slot)
        assert _pinned(got), (slot, type(got))
        for a, b in zip(got, residuals, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b + slot)
    swap.close()


def test_published_params_reach_the_device_pinned(tmp_path, monkeypatch):
    """Under the emulated GPU topology the NVMe param store hands a stage served from
    its published data (landing after the commit, as the last stages updated are) as
    ``pinned_host`` arrays, copied ahead on the I/O threads by ``prefetch``, as it hands
    reads; kept stages (a get with ``keep``) stay those pinned arrays."""
    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    from hetjax.storage.params import NvmeParamStore

    shardings = Shardings.single_device()
    pages = {"head": (0, 2), "block0": (2, 1)}
    store = NvmeParamStore(
        tmp_path, np.float32, pages, 8, stage_to=shardings.pinned_staging(),
        keep_published=("head",),
    )  # fmt: skip
    values = np.arange(24, dtype=np.float32).reshape(3, 8)
    store.publish("head", list(values[:2]))
    store.publish("block0", list(values[2:]))
    store.commit()  # head is kept published: served from its data, not read
    assert store.cache.in_ram("head")
    store.prefetch("head")
    assert "head" in store._staging  # the copy to pinned memory runs on the I/O threads
    got = store.get("head", keep=True)
    assert _pinned(got)
    np.testing.assert_array_equal(np.stack([np.asarray(p) for p in got]), values[:2])
    assert store.get("head") is got  # the kept copy: the same pinned arrays
    assert store.read_bytes == 0
    store.wait()
    store.prefetch("block0")  # from disk, staged as before
    assert _pinned(store.get("block0"))
    store.close()


@pytest.mark.cpu_only
def test_the_plain_cpu_keeps_numpy_views(tmp_path, monkeypatch):
    """On the CPU backend without the emulation nothing is staged: published data is
    handed out as views of itself (zero copy)."""
    monkeypatch.delenv(HOST_CLIENT_ENV, raising=False)
    from hetjax.storage.params import NvmeParamStore

    stage_to = Shardings.single_device().pinned_staging()
    assert stage_to is None
    store = NvmeParamStore(
        tmp_path, np.float32, {"head": (0, 2)}, 8, stage_to=stage_to, keep_published=("head",)
    )
    values = np.arange(16, dtype=np.float32).reshape(2, 8)
    store.publish("head", list(values))
    store.commit()
    store.prefetch("head")
    got = store.get("head")
    assert all(isinstance(p, np.ndarray) for p in got) and not store._staging
    store.close()


def test_the_pinned_check_keeps_a_margin_for_xla():
    """The host plan's pinned part plus ``PINNED_MARGIN`` must fit XLA's pinned cap;
    the launcher's cap is the bound the plan's pinned part is planned within."""
    from hetjax import xla_env
    from hetjax.config import Config, ConfigError
    from hetjax.memory_host import HostMemoryPlan

    GiB = 1 << 30
    plan = HostMemoryPlan(
        budget=0, param_slabs=5 * GiB, gradients=0, optimizer_state=0, optimizer_io=0,
        cache=0, cached_stages=(), grads=None, boundaries=GiB,
    )  # fmt: skip
    margin = xla_env.PINNED_MARGIN
    assert margin == 2 * GiB
    assert plan.pinned == 6 * GiB
    plan.check_pinned(8 * GiB, margin=margin)  # 6 GiB + 2 GiB: fits
    with pytest.raises(ConfigError, match="plus 2.00 GiB for XLA's own, and XLA allows"):
        plan.check_pinned(8 * GiB - 1, margin=margin)
    plan.check_pinned(6 * GiB)  # (no margin: as before)
    config = Config().replace(memory=dict(host_budget="100GiB"))
    assert xla_env.pinned_bound(config) == 100 * GiB
    assert xla_env.wanted(config)[xla_env.PINNED_LIMIT] == "100"


def _expert_row_copies(fetchers, put, copies: list):
    """A ``jax.device_put`` that notes the memory kind of each expert row (an expert
    leaf's row, or one of them) copied to the fetchers' device ("numpy": pageable)."""
    targets = {id(f.device) for f in fetchers}
    shapes = set()
    for f in fetchers:
        for k in f.block.expert_leaves:
            row = f.block.layout.leaves[k].shape[1:]
            shapes |= {tuple(row), (1, *row)}

    def recording(x, device=None, *a, **k):
        if id(device) in targets:
            copies.extend(
                "numpy" if isinstance(r, np.ndarray) else r.sharding.memory_kind
                for r in jax.tree.leaves(x)
                if tuple(r.shape) in shapes
            )
        return put(x, device, *a, **k)

    return recording


@pytest.mark.slow  # 26 s cold: two routed runtimes (pinned hand-offs in the default run above)
@pytest.mark.cpu_only  # (its plain run is the CPU's)
def test_routed_expert_rows_reach_the_device_pinned(tiny, monkeypatch):
    """Under the emulated GPU topology a routed block's experts' rows are gathered into
    ``pinned_host`` arrays before their copy to the device (none is copied from a numpy
    row of pageable memory), and the steps' losses are the plain CPU's."""
    from test_expert_fetch import _config

    from hetjax.runtime.streaming import StreamingRuntime

    config = _config(tiny, "routed")
    batches = training_batches(config, 2)
    losses, kinds, put = {}, {}, jax.device_put
    for mode in ("plain", "separate"):
        if mode == "separate":
            monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
        runtime = StreamingRuntime(config)
        copies = []
        monkeypatch.setattr(
            jax, "device_put", _expert_row_copies(runtime.experts.values(), put, copies)
        )
        try:
            losses[mode] = [runtime.train_step(b).loss for b in batches]
        finally:
            monkeypatch.setattr(jax, "device_put", put)
            runtime.close()
        kinds[mode] = set(copies) if copies else None
    assert kinds == {"plain": {"numpy"}, "separate": {"pinned_host"}}  # (CPU: no staging)
    assert losses["separate"] == losses["plain"]
