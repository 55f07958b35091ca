"""The ledger (``runtime/loop/ledger.py``): arrays held for long are added and removed as their
holders take and drop them; a record counts those and the ones passed to it, each once."""

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import timeline
from hetjax.runtime.loop.ledger import Ledger
from hetjax.runtime.streaming import StreamingRuntime


def test_held_and_passed_arrays_count_once():
    ledger = Ledger()
    a, b, c = jnp.zeros(4), jnp.zeros(8), jnp.zeros(16)  # 16, 32, 64 bytes (fp32)
    ledger.hold("slab", [a, b])
    ledger.hold("vjp", (a, {"x": c}))  # a, held twice: counted once
    ledger.record([b, c, jnp.zeros(2)])  # held ones passed again count nothing more
    assert ledger.current == {"device": 16 + 32 + 64 + 8}
    ledger.release("slab")  # a stays: the vjp still holds it
    ledger.record([])
    assert ledger.current == {"device": 16 + 64}
    ledger.hold("vjp", [c])  # holding again replaces what the holder held
    ledger.release("nothing")  # a holder that held nothing
    ledger.record([])
    assert ledger.current == {"device": 64}
    assert ledger.peak["device"] == 16 + 32 + 64 + 8


def test_memory_kinds_and_buffers_outside_jax_count_apart():
    ledger = Ledger()
    x = jnp.zeros(4)
    host = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    ledger.hold(("resident", "embed"), x)
    ledger.hold(("block", 0), host)
    ledger.record([], host_buffers=100, device_buffers=5)
    assert ledger.current == {"device": 16 + 5, "pinned_host": 16 + 100}
    ledger.reset_peak()
    assert ledger.peak["device"] == 0


def test_steps_accounted_are_the_first_the_probed_and_the_traced():
    ledger = Ledger()
    assert ledger.begin_step(probed=False)  # the first step
    ledger.record([jnp.zeros(4)])
    assert not ledger.begin_step(probed=False)  # a plain step: no walk, peak kept
    assert ledger.peak["device"] == 16
    assert ledger.begin_step(probed=True)  # a probed one starts its peak afresh
    assert ledger.peak["device"] == 0
    with timeline.recording(timeline.Recorder()):
        assert ledger.begin_step(probed=False)  # a traced one
    assert not ledger.begin_step(probed=False)


def test_a_plain_step_walks_nothing_at_its_dispatches(tiny):
    """Per-dispatch accounting runs in the first step and under a probe only; the
    report has the device peak exactly when the step was accounted."""
    config = tiny(offload=dict(mode="stream"), model=dict(num_layers=3))
    runtime = StreamingRuntime(config)
    records, probed = [], []
    record = runtime.ledger.record
    runtime.ledger.record = lambda *a, **k: (records.append(1), record(*a, **k))
    try:
        batch = np.random.default_rng(0).integers(0, 256, (1, 2, 17)).astype(np.int32)
        counts, reported = [], []
        for probe in (None, None, probed.append, None):
            runtime.probe = probe
            before = len(records)
            report = runtime.train_step(batch)
            counts.append(len(records) - before)
            reported.append("device_bytes_peak" in report.metrics)
        assert counts[0] > 3 and counts[1] == 0 and counts[2] == counts[0] and counts[3] == 0
        assert len(probed) == counts[2]  # the probe is called at each accounted dispatch
        assert reported == [True, False, True, False]
    finally:
        runtime.close()
