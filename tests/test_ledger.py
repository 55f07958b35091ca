"""The ledger (``runtime/ledger.py``): arrays held for long are added and removed as their
holders take and drop them; a record counts those and the ones passed to it, each once."""

import jax
import jax.numpy as jnp

from hetjax.runtime.ledger import Ledger


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
