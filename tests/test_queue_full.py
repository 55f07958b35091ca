"""The accelerator's dispatch order, on the CPU (issue: GPU first contact, item 7): the
window keeps one block queued on the device (it waits for use j - 2, not j - 1) and the
device plan counts the slab that holds; the two-client emulation
(``HETJAX_HOST_CLIENT=separate``) runs that order. Compute is dispatched before a
block's boundary store; what reaches the device from the host comes from pinned
buffers there; XLA's pinned cap is the host plan's pinned part plus a margin."""

import jax
import numpy as np
import pytest

from hetjax import memory
from hetjax.runtime.placement import HOST_CLIENT_ENV, Shardings


class _Store:
    def prefetch(self, stage):
        pass

    def ready(self, stage):
        return True

    def get(self, stage, keep=False):
        return stage


def _window_events(monkeypatch, lag: int) -> list:
    from hetjax.runtime import window as window_module

    events = []
    monkeypatch.setattr(
        window_module.jax, "block_until_ready", lambda x: events.append(("wait", x)) or x
    )
    uses = ["b0", "b1", "b2", "b2", "b1", "b0"]
    win = window_module.PrefetchWindow(
        uses, 1, {}, _Store(), lambda name, slab: events.append(("copy", name)) or slab, lag=lag
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
    s = Sizes(10, 30, 25, 20, 30, 25, 20, 2, 2, ADAM, 20, 30, {"all": 0}, "release")
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
