"""fp32 params on NVMe with the optimizer state there too are its fp32 master, stored once
(issue #23 item 4): no param files, nothing written for them but the state, reads from
the state's committed master (or its RAM cache), and training equal to the in-memory
reference."""

import concurrent.futures
import dataclasses
import gc
import json
import weakref

import jax
import numpy as np
import pytest
from equivalence import assert_losses_close, assert_trees_close, training_batches

from hetjax import memory
from hetjax.memory import Sizes
from hetjax.memory_host import nvme_parts, plan_host
from hetjax.placement import Placement
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.state_format import StateFormat
from hetjax.storage.nvme_states import _copy_when_done
from hetjax.storage.params import MasterPages, OwnPages
from hetjax.train import train

# no clipping: a step whose clipping binds updates twice (update_loop.py)
ADAMW = dict(name="adamw", lr=3e-3, weight_decay=0.1, warmup_steps=2, grad_clip=0.0)
# the equivalence with offload.mode=none at 1e-5 is checked with SGD, as in test_stream.py
# (Adam amplifies summation-order noise in near-zero gradients: ~1e-4 on a bias here)
SGD = dict(name="sgd", lr=0.1, weight_decay=0.0)
ON_NVME = dict(mode="stream", optimizer="nvme", params="nvme")


def _config(tiny, **sections):
    """The tiny GPT with 3 blocks, AdamW, several pages a stage, params and state on
    NVMe; ``sections`` override."""
    base = dict(
        model=dict(num_layers=3),
        optimizer=ADAMW,
        memory=dict(page_size="16KiB"),
        offload=ON_NVME,
    )
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny(**base)


def test_which_params_are_the_master():
    assert memory.params_are_master(Placement(params="nvme", optimizer="nvme"), 4)
    assert not memory.params_are_master(Placement(params="nvme", optimizer="nvme"), 2)  # bf16
    assert not memory.params_are_master(Placement(params="nvme", optimizer="host"), 4)
    assert not memory.params_are_master(Placement(params="host", optimizer="nvme"), 4)
    sizes = Sizes(
        num_layers=4, embed=4_000, block=10_000, head=2_000, own_embed=4_000,
        own_block=10_000, own_head=2_000, compute_bytes=4, block_grad_bytes=4,
        state_format=StateFormat.fp32(["mu", "nu"]),
        boundary=1_000, working_set=0, kept={"all": 0}, grad_policy="release",
    )  # fmt: skip
    o = Placement(params="nvme", optimizer="nvme")
    parts = nvme_parts(sizes, o, plan_host(sizes, o, 0))
    assert parts["params"] == 0 and parts["optimizer"] > 0
    # bf16 params: two copies of their own, 2 bytes a param (4 blocks, embed, head)
    bf16 = dataclasses.replace(sizes, compute_bytes=2)
    assert nvme_parts(bf16, o, plan_host(bf16, o, 0))["params"] == 2 * 2 * 46_000


def _run(config, steps: int, check_step=None):
    """Trains ``config`` ``steps`` steps in a StreamingRuntime: losses, params, and
    ``check_step(runtime, report)`` after each step."""
    runtime = StreamingRuntime(config)
    try:
        losses = []
        for batch in training_batches(config, steps):
            report = runtime.train_step(batch)
            losses.append(report.loss)
            if check_step is not None:
                check_step(runtime, report)
        return losses, runtime.params()
    finally:
        runtime.close()


@pytest.mark.slow  # 13 s; master params in the default run: ..._train_as_params_of_their_own
def test_fp32_params_on_nvme_are_the_state_s_master(tiny, tmp_path):
    """No param files; a step writes one copy of state and nothing for the params,
    and reads the state (or copies its master from the params' reads) and every block's
    master at most twice (forward, backward's recompute) beside it; the run equals
    offload.mode=none (SGD, 1e-5)."""
    nvme = tmp_path / "nvme"
    config = _config(tiny, optimizer=SGD, train=dict(steps=4), memory=dict(nvme_path=str(nvme)))
    runtime = StreamingRuntime(config)
    try:
        store = runtime.param_store
        assert isinstance(store.pages, MasterPages) and store.nvme_bytes == 0
        one_generation = runtime.states.nvme_bytes // 2
        blocks = block_bytes(runtime)
    finally:
        runtime.close()
    result = train(config, tmp_path / "stream")  # verbose: it writes metrics.jsonl
    assert not (nvme / "params").exists() and (nvme / "optimizer").is_dir()
    records = [json.loads(line) for line in (tmp_path / "stream" / "metrics.jsonl").open()]
    assert len(records) == 4
    for r in records:
        assert r["nvme_write_bytes"] == one_generation  # the state's alone
        assert one_generation <= r["nvme_read_bytes"] <= one_generation + 2 * blocks
    reference = train(_config(tiny, optimizer=SGD, offload=dict(mode="none"), train=dict(steps=4)),
                      tmp_path / "none", verbose=False)  # fmt: skip
    assert_losses_close(result.losses, reference.losses)
    assert_trees_close(result.params, reference.params)


def test_master_params_train_as_params_of_their_own(tiny, monkeypatch):
    """AdamW: the params read from the master train bit for bit as those written to files
    of their own (what fp32 params on NVMe had before). The host optimizer's state reads
    take the master of blocks whose backward read is at hand from that read: per step
    the state store reads one copy less those blocks' masters."""
    config = _config(tiny)
    state_reads = []

    def check_step(runtime, report):
        state_reads.append(runtime.states.read_bytes)

    losses, params = _run(config, 4, check_step)
    runtime = StreamingRuntime(config)
    try:
        copy = runtime.states.nvme_bytes // 2
        one_master = (
            runtime.param_store.stage_pages["block1"][1] * runtime.param_store.page_elems * 4
        )
    finally:
        runtime.close()
    per_step = np.diff(state_reads)
    # at least one of the 3 blocks' masters copied, at most all of them
    assert all(copy - 3 * one_master <= r <= copy - one_master for r in per_step), (
        per_step, copy, one_master,
    )  # fmt: skip
    monkeypatch.setattr(memory, "params_are_master", lambda o, compute_bytes: False)
    own = StreamingRuntime(config)
    assert isinstance(own.param_store.pages, OwnPages)
    own.close()
    own_losses, own_params = _run(config, 4)
    assert losses == own_losses
    jax.tree.map(np.testing.assert_array_equal, params, own_params)


def block_bytes(runtime) -> int:
    """Bytes of every block's params (fp32)."""
    pages = runtime.param_store.stage_pages
    n = sum(count for stage, (_, count) in pages.items() if stage.startswith("block"))
    return n * runtime.param_store.page_elems * 4


BUDGET = "1792KiB"  # SGD's state (the master) of the head and block2 cached


def test_cached_stages_params_come_from_their_state_in_ram(tiny, tmp_path):
    """With a host budget that caches some stages' state, their params are copied from
    the cached master (never read from disk), and training still equals
    offload.mode=none."""
    # prefetch depth 1: block2's forward read is not one the host keeps from its update
    # (memory_host.kept_published)
    offload = dict(prefetch_depth=1)
    config = _config(
        tiny, optimizer=SGD, memory=dict(host_budget=BUDGET), train=dict(steps=4), offload=offload
    )
    runtime = StreamingRuntime(config)
    disk_reads: list[str] = []
    try:
        cached = set(runtime.host_plan.cached_stages)
        assert "block2" in cached and len(cached) < 5, cached  # some stages cached, not all
        store = runtime.param_store
        assert isinstance(store.pages, MasterPages)
        stage_at = {first: stage for stage, (first, _) in store.stage_pages.items()}
        for disk in runtime.states.disk:
            disk.read_into = lambda k, first, out, r=disk.read_into: (
                disk_reads.append((k, stage_at.get(first))) or r(k, first, out)
            )
        losses = [runtime.train_step(b).loss for b in training_batches(config, 4)]
        params = runtime.params()
    finally:
        runtime.close()
    master_reads = {stage for kind, stage in disk_reads if kind == "master"}
    assert master_reads and not master_reads & cached
    reference = train(_config(tiny, optimizer=SGD, train=dict(steps=4), offload=dict(mode="none")),
                      tmp_path / "none", verbose=False)  # fmt: skip
    assert_losses_close(losses, reference.losses)
    assert_trees_close(params, reference.params)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_params_in_another_dtype_have_files_of_their_own(tiny, dtype):
    config = _config(tiny, model=dict(num_layers=2, compute_dtype=dtype))
    runtime = StreamingRuntime(config)
    try:
        assert isinstance(runtime.param_store.pages, OwnPages)
        assert runtime.param_store.nvme_bytes > 0
        assert (runtime.nvme_dir / "params").is_dir()
    finally:
        runtime.close()


def test_master_copy_lets_go_of_the_read_it_copied():
    """The copy of a master read made elsewhere (``nvme_states._copy_when_done``) holds
    that read only until it copies it: the read's callbacks stay with it, and a callback
    naming the read was a cycle that kept its pages (a pooled param slab) alive until
    a full collection, so the slab pool allocated a fresh one meanwhile."""
    read = concurrent.futures.Future()  # (not done yet: the copy waits in it)
    out = np.zeros(4, np.float32)
    copied = _copy_when_done(read, out)
    pages = np.arange(4, dtype=np.float32).reshape(2, 2)
    held = weakref.ref(pages)
    gc.disable()
    try:
        read.set_result(pages)
        copied.result()
        np.testing.assert_array_equal(out, [0, 1, 2, 3])
        del read, pages
        assert held() is None, "the copied read's pages outlived the copy"
    finally:
        gc.enable()
