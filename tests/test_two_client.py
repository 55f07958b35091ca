"""A GPU's topology on a CPU (issue #19 item 7): the host optimizer on a second JAX
client (``HETJAX_HOST_CLIENT=separate``, ``parallel/single.py``), as on a GPU where it
runs on the CPU client while the stages run on the GPU's. Every array between the
optimizer and the "device" then crosses clients: gradients out, refreshed params back,
the device cache's state, the republication after a poisoned step. The streaming
runtime must equal ``offload.mode=none`` through it in every tier."""

import jax
import numpy as np
import pytest
from equivalence import (
    assert_gpt_training_equal,
    assert_losses_close,
    assert_trees_close,
    check_fp16_overflow_skips_then_trains,
    check_tokens,
    training_batches,
    without_key_bias,
)

from hetjax import memory
from hetjax.parallel.single import HOST_CLIENT_ENV, Shardings
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from models import build_model

CLIP = dict(grad_clip=2.0)  # binds in some of the tiny run's steps: redos happen
PAGES = dict(page_size="16KiB")


@pytest.fixture(autouse=True)
def separate_client(monkeypatch):
    monkeypatch.setenv(HOST_CLIENT_ENV, "separate")


@pytest.fixture(scope="module")
def reference(reference_run):
    from conftest import tiny_config

    return reference_run(tiny_config(optimizer=CLIP))


def test_the_host_optimizer_runs_on_another_client():
    shardings = Shardings.single_device()
    (host_side,) = shardings.optimizer.device_set
    (device_side,) = shardings.device.device_set
    assert host_side.client is not device_side.client
    assert shardings.host.device_set == {device_side}  # param slabs: the device's client
    page = jax.device_put(np.ones(8, np.float32), shardings.optimizer)
    assert page.sharding.device_set == {host_side}


TIERS = {
    "host": dict(mode="stream"),
    "host-optax": dict(mode="stream"),
    "nvme": dict(mode="stream", optimizer="nvme", params="nvme"),
    "device-cache": dict(mode="stream", optimizer="nvme", optimizer_device_stages=2),
    "activations-nvme": dict(mode="stream", activations="nvme"),
}


# default run: host, nvme, device-cache; the others with -m slow
@pytest.mark.parametrize(
    "tier",
    [
        t if t in ("host", "nvme", "device-cache") else pytest.param(t, marks=pytest.mark.slow)
        for t in TIERS
    ],
)
def test_stream_through_two_clients_equals_none(reference, tiny, tmp_path, tier):
    """Clipping at 2.0 binds in some steps: the speculative updates are redone."""
    kernel = "optax" if tier == "host-optax" else "auto"
    config = tiny(
        offload=TIERS[tier],
        optimizer=dict(CLIP, host_kernel=kernel),
        memory=dict(PAGES, nvme_path=str(tmp_path / "ssd")),
    )
    result = train(config, tmp_path, verbose=False)
    assert_gpt_training_equal(result, reference, build_model(config.model), check_tokens())
    redo = [r["optimizer_redo"] for r in result.records]
    assert 0 < redo[-1] < len(redo), redo  # some steps were redone, not all


def test_poisoned_step_republishes_across_clients(reference, tiny):
    """A NaN step drops every speculative update, the device cache's included, and
    republishes the committed params from the other client; training then equals the
    reference."""
    offload = dict(mode="stream", optimizer="host", optimizer_device_stages=2)
    config = tiny(optimizer=CLIP, memory=PAGES, offload=offload)
    runtime = StreamingRuntime(config)
    try:
        batches = training_batches(config, 5)
        before = runtime.params()
        assert runtime.train_step(batches[0], poison=True).nonfinite
        jax.tree.map(np.testing.assert_array_equal, runtime.params(), before)
        losses = [runtime.train_step(batch).loss for batch in batches]
        assert_losses_close(losses, reference.losses)
        assert_trees_close(without_key_bias(runtime.params()), without_key_bias(reference.params))
    finally:
        runtime.close()


def test_fp16_overflow_skips_across_clients(tiny):
    model = dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float16")
    config = tiny(
        model=model,
        offload=dict(mode="stream", params="nvme"),
        memory=PAGES,
        train=dict(loss_scale_init=2.0**60),
    )
    runtime = StreamingRuntime(config)
    try:
        batch = np.random.default_rng(0).integers(0, 256, (1, 4, 17)).astype(np.int32)
        check_fp16_overflow_skips_then_trains(runtime, batch)
    finally:
        runtime.close()


# the stage functions the runtime calls: the head's, and each stage group's
FUNCTIONS = ("head_loss", "head_fwd_bwd", "aux_fwd_bwd")
GROUP_FUNCTIONS = (
    "input_fwd",
    "block_fwd",
    "block_fwd_keep",
    "block_bwd",
    "block_bwd_kept",
    "input_bwd",
    "zero_context",
)


@pytest.mark.parametrize(
    "offload",
    [
        dict(params="host"),
        dict(params="nvme", keep_blocks=1),
        dict(params="nvme", swap_blocks=2, swap_tier="nvme"),  # read back through pinned
    ],
    ids=["host", "nvme_keep", "nvme_swap"],
)
def test_no_stage_function_reads_pinned_host_memory(tiny, offload, monkeypatch):
    """On a GPU an operand in ``pinned_host`` memory makes XLA read host RAM over PCIe
    inside the kernel: every stage function's array arguments must be in device memory
    (param pages copied in by the prefetcher, batches put on the device). Each stage
    function is wrapped to record the memory kinds it is called with over real steps."""
    if offload.get("swap_blocks"):  # one of the two swapped blocks' rows goes to disk
        monkeypatch.setattr(memory, "IO_READAHEAD", 1)
    config = tiny(offload=dict(mode="stream", **offload), memory=PAGES)
    runtime = StreamingRuntime(config)
    kinds: dict[str, set] = {}

    def recording(name, fn):
        def call(*args):
            for leaf in jax.tree.leaves(args):
                if isinstance(leaf, jax.Array):
                    kinds.setdefault(name, set()).add(leaf.sharding.memory_kind)
            return fn(*args)

        return call

    try:
        for name in FUNCTIONS:
            setattr(runtime.fns, name, recording(name, getattr(runtime.fns, name)))
        for group in runtime.fns.groups:
            for name in GROUP_FUNCTIONS:
                setattr(group, name, recording(name, getattr(group, name)))
        swapped = runtime.fns.swapped(runtime.config.offload.swap_level)
        for name in ("forward", "backward"):
            setattr(swapped, name, recording(f"swapped {name}", getattr(swapped, name)))
        for batch in training_batches(config, 2):
            runtime.train_step(batch)
    finally:
        runtime.close()
    assert {"input_fwd", "head_fwd_bwd", "input_bwd"} <= set(kinds)
    if offload.get("swap_blocks"):
        assert {"swapped forward", "swapped backward"} <= set(kinds)
        assert runtime.residual_swap.read_bytes > 0  # staged through pinned memory
    else:
        assert {"block_fwd", "block_bwd"} & set(kinds)
    assert all(k == {"device"} for k in kinds.values()), kinds


def test_jax_platforms_without_cpu_is_a_clear_error(monkeypatch):
    """On a GPU machine ``JAX_PLATFORMS=cuda`` hides the CPU backend the host optimizer
    needs: the error names the variable and the fix."""
    from hetjax.config import ConfigError
    from hetjax.parallel import single as placement

    def devices(backend=None):
        raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(placement.jax, "devices", devices)
    with pytest.raises(ConfigError, match=r"JAX_PLATFORMS='cuda' must include cpu: set "):
        placement.cpu_device()
    with pytest.raises(ConfigError, match=r"JAX_PLATFORMS=cuda,cpu or unset it"):
        placement.cpu_device()


def test_published_params_never_cross_clients_as_jax_arrays(tiny, monkeypatch):
    """The host optimizer's pages reach the device client's ``pinned_host`` memory as
    numpy views (one copy), not as another client's arrays (XLA's Literal path)."""
    from hetjax.storage import params

    arrived, crossed = [], []
    put, publish = jax.device_put, params.HostParamStore.publish

    def client_of(leaf):
        return next(iter(leaf.devices())).client

    def other_client(tree, sharding):
        (target,) = sharding.device_set
        leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
        return [client_of(x) is not target.client for x in leaves]

    def recording_put(x, sharding=None, **kw):
        if getattr(sharding, "memory_kind", None) == "pinned_host":
            crossed.extend(other_client(x, sharding))
        return put(x, sharding, **kw)

    def recording_publish(self, stage, pages):
        arrived.extend(other_client(pages, self.sharding))
        return publish(self, stage, pages)

    monkeypatch.setattr(params.jax, "device_put", recording_put)
    monkeypatch.setattr(params.HostParamStore, "publish", recording_publish)
    for kernel in ("optax", "native"):
        config = tiny(offload=dict(mode="stream"), optimizer=dict(host_kernel=kernel))
        runtime = StreamingRuntime(config)
        try:
            for batch in training_batches(config, 2):
                runtime.train_step(batch)
        finally:
            runtime.close()
    assert any(arrived)  # optax's pages come as the other client's arrays ...
    assert not any(crossed)  # ... and are put as numpy views


def test_nvme_param_reads_land_in_pinned_memory(tmp_path):
    """Under the emulated GPU topology the NVMe param store copies pages it reads into
    the device's pinned_host memory as they land, so the copy to the device is from
    pinned memory (on a GPU, a DMA); without it, on a CPU, pages stay numpy."""
    from hetjax.storage.params import NvmeParamStore

    shardings = Shardings.single_device()
    assert shardings.pinned_staging() == shardings.host
    pages = {"head": (0, 2), "block0": (2, 1)}
    store = NvmeParamStore(tmp_path, np.float32, pages, 8, stage_to=shardings.pinned_staging())
    values = np.arange(24, dtype=np.float32).reshape(3, 8)
    store.publish("head", list(values[:2]))
    store.publish("block0", list(values[2:]))
    store.commit()
    store.wait()
    for stage, (first, n) in pages.items():
        store.prefetch(stage)
        got = store.get(stage)
        assert all(p.sharding.memory_kind == "pinned_host" for p in got)
        np.testing.assert_array_equal(np.stack([np.asarray(p) for p in got]), values[first:][:n])
    assert store.read_bytes == values.nbytes


@pytest.mark.cpu_only
def test_a_cpu_without_emulation_does_not_stage(monkeypatch):
    monkeypatch.delenv(HOST_CLIENT_ENV)
    assert Shardings.single_device().pinned_staging() is None


def test_boundaries_read_from_nvme_land_in_pinned_memory(tmp_path):
    """Boundary activations swapped to NVMe come back through pinned memory too (the
    last ``depth`` slots never leave RAM: the first ones are read from disk)."""
    from hetjax.storage.swap import BoundarySwap

    shardings = Shardings.single_device()
    swap = BoundarySwap(
        tmp_path,
        5,
        (2, 3, 4),
        np.float32,
        chunk_elems=8,
        depth=2,
        stage_to=shardings.pinned_staging(),
    )
    rows = np.arange(5 * 24, dtype=np.float32).reshape(5, 2, 3, 4)
    swap.begin()
    for slot, row in enumerate(rows):
        swap.put(slot, jax.device_put(row, shardings.host))
    for slot in reversed(range(5)):
        got = swap.get(slot)
        np.testing.assert_array_equal(np.asarray(got), rows[slot])
        if slot < 3:  # written, then read back from disk
            assert got.sharding.memory_kind == "pinned_host"
    assert swap.read_bytes == 3 * rows[0].nbytes
    swap.close()


# The stages the prefetch window copies to the device in a step of the 4-block model,
# written from its definition (runtime/loop/window.py): the uses are forward's blocks 0-3,
# then backward's recomputed ones in reverse (block 3 too, unless kept: a kept block's
# backward uses its forward's vjp, not its params); a stage is copied for a use unless
# it is resident or its device copy is still there, which it is only when its previous
# use is at most max(prefetch depth, 1) uses before (depth 2 unless set). Resident: the
# embed, the head and the device cache's blocks.
#   no kept block: uses 0 1 2 3 3 2 1 0; block 3 stays from use 3 to 4, blocks 2, 1 and 0
#     (3, 5 and 7 uses apart) are copied again
#   keep 1 (block 3): uses 0 1 2 3 2 1 0; block 2 stays (2 uses apart, depth 2)
#   device cache of 2 stages (embed and block 0, resident): blocks 1-3, then 2 and 1
FORWARD = ["block0", "block1", "block2", "block3"]


@pytest.mark.parametrize(
    "offload, copies, resident",
    [
        (dict(mode="stream"), FORWARD + ["block2", "block1", "block0"], ()),
        pytest.param(
            dict(mode="stream", params="nvme", optimizer="nvme", prefetch_depth=1),
            FORWARD + ["block2", "block1", "block0"],
            (),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(mode="stream", activations="host", keep_blocks=1),
            FORWARD + ["block1", "block0"],
            (),
            marks=pytest.mark.slow,
        ),
        (
            dict(mode="stream", optimizer_device_stages=2),
            FORWARD[1:] + ["block2", "block1"],
            ("block0",),
        ),
    ],
    ids=["host", "nvme-depth1", "activations-host-keep1", "device-cache"],
)
def test_every_transfer_is_planned_and_counted(tiny, offload, copies, resident):
    """Under ``jax.transfer_guard("disallow")`` steps run with no implicit transfer
    (each one a sync copy on a GPU; a Python scalar passed to a jit is one): every
    host <-> device copy is an explicit ``device_put`` of the plan. The bytes a step
    copies to the device are those of the plan: the stages the prefetch window copies
    (forward, then backward's recomputed blocks), the resident stages refreshed after
    the update unless device-cached, and the boundaries crossing back; to the host,
    each stage's gradient (the device cache's stay) and the boundaries."""
    from hetjax import timeline

    model = dict(num_layers=4, d_model=32, num_heads=4, max_seq_len=32)
    config = tiny(model=model, offload=offload, optimizer=CLIP, memory=PAGES)
    runtime = StreamingRuntime(config)
    try:
        batches = training_batches(config, 3)
        runtime.train_step(batches[0])  # compiles
        # Host -> device (and between devices): the step's report reads its losses as
        # Python floats, a device -> host fetch (on the CPU a zero-copy view the guard
        # lets through; on a GPU an implicit copy it would stop).
        with (
            jax.transfer_guard_host_to_device("disallow"),
            jax.transfer_guard_device_to_device("disallow"),
        ):
            runtime.train_step(batches[1])
            recorder = timeline.Recorder(2)
            with timeline.recording(recorder):
                runtime.train_step(batches[2])
        moved = recorder.finish().moved_bytes

        def nbytes(stage):  # params as the device takes them (leaf buffers: unpadded)
            return sum(p.nbytes for p in runtime.param_store.get(stage))

        def grad_nbytes(stage):  # a gradient leaves as its slab's pages, padding included
            layout = runtime.layouts[runtime.layout_name(stage)]
            return layout.padded_size * runtime.compute_dtype.itemsize

        L, kept = runtime.num_layers, config.offload.keep_blocks
        refreshed = [n for n in ("embed", "head", *resident) if n not in runtime.device_stages]
        boundary = 0
        if config.offload.activations != "device":
            (B, T) = (config.train.micro_batch_size, config.train.seq_len)
            boundary = (L - kept) * B * T * model["d_model"] * 4
        h2d = sum(map(nbytes, copies + refreshed)) + boundary
        grads = sum(grad_nbytes(n) for n in runtime.stage_names if n not in runtime.device_stages)
        grads += grad_nbytes("embed") if "embed" not in runtime.device_stages else 0  # tied head
        assert moved == {"host_to_device": h2d, "device_to_host": grads + boundary}
    finally:
        runtime.close()


@pytest.mark.cpu_only  # 2 devices: the CPU's virtual ones
@pytest.mark.parametrize("optimizer", ["host", pytest.param("nvme", marks=pytest.mark.slow)])
def test_zero3_steps_have_no_implicit_transfers(tiny, optimizer):
    """ZeRO-3 over 2 devices: its scalars are put replicated, its batches as global
    arrays, its pages by explicit copies (``parallel/zero.py``)."""
    from hetjax.train import build_runtime

    config = tiny(
        offload=dict(mode="stream", optimizer=optimizer),
        distributed=dict(data_parallel=2),
        memory=PAGES,
    )
    runtime = build_runtime(config)
    try:
        batches = training_batches(config, 2)
        runtime.train_step(batches[0])
        with jax.transfer_guard("disallow"):
            assert np.isfinite(runtime.train_step(batches[1]).loss)
    finally:
        runtime.close()
