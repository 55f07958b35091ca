"""One device takes a stage's params leaf by leaf (``pages.LeafBuffers``, issue #19 item
6): every weight a device buffer of its own, none cut out of the pages it spans at each
use. Storage stays pages; gradients leave the device as pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import assert_trees_close, training_batches

from hetjax.parallel.layouts import stage_layouts
from hetjax.parallel.single import HOST_CLIENT_ENV, SingleDevice
from hetjax.runtime.stages import functions as stages
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.storage.pages import LeafBuffers, SlabLayout
from models import build_model

PAGES = dict(page_size="16KiB")  # several pages a block: weights span pages


def _tree():
    rng = np.random.default_rng(0)
    return {
        "ln": {"scale": rng.normal(size=(7,)), "bias": rng.normal(size=(7,))},
        "dense": {"kernel": rng.normal(size=(30, 100)), "bias": rng.normal(size=(100,))},
        "wte": rng.normal(size=(5, 3)),
    }


def test_leaf_buffers_are_views_and_give_the_pages_gradient():
    """Leaf views share the slab's memory; a function of the params has the same value,
    and its gradient the same pages, bit for bit, whether the params come as pages or
    as leaf buffers (``grad_pages`` builds each page from the leaf pieces it covers)."""
    tree = jax.tree.map(lambda a: a.astype(np.float32), _tree())
    layout = SlabLayout.from_params(tree, page_bytes=4096, leaf_buffers=True)  # 4 pages
    slab = layout.flatten_np(tree)
    views = layout.leaf_views(slab)
    assert [v.shape for v in views] == [leaf.shape for leaf in layout.leaves]
    assert all(np.shares_memory(v, slab) for v in views)

    def loss(params):
        return sum(jnp.sum(jnp.sin(a) * (k + 1)) for k, a in enumerate(jax.tree.leaves(params)))

    of_pages = jax.jit(jax.value_and_grad(lambda p: loss(layout.unflatten_pages(p))))
    value_p, grad_p = of_pages(layout.to_pages(jnp.asarray(slab)))

    @jax.jit
    def of_leaves(leaves):
        value, grad = jax.value_and_grad(lambda b: loss(layout.unflatten_pages(b)))(leaves)
        assert isinstance(grad, LeafBuffers)  # the gradient comes back leaf by leaf
        return value, layout.grad_pages(grad)

    value_l, grad_l = of_leaves(LeafBuffers(jnp.asarray(v) for v in views))
    assert float(value_l) == float(value_p)
    assert len(grad_l) == len(grad_p) == layout.num_pages
    for a, b in zip(grad_l, grad_p, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(grad_l[-1])[layout.size - 3 * layout.page_elems :] == 0)  # pad
    # pages cut into leaves on the device (the device cache's) are the host's views
    cut = jax.jit(layout.leaves_of_pages)(layout.to_pages(jnp.asarray(slab)))
    for a, b in zip(cut, views, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def _concatenates(fn, args) -> int:
    return fn.lower(*args).compile().as_text().count(" concatenate(")


def test_block_forward_copies_no_weight_out_of_pages(tiny):
    """The compiled block forward of the runtime's one-device layout concatenates
    nothing; the same block taking pages cuts each weight that spans pages out of them
    (a device copy at every use), so the check can fail."""
    config = tiny(memory=PAGES)
    model = build_model(config.model)
    B, T = config.train.micro_batch_size, config.train.seq_len
    counts = {}
    for name, layouts in (
        ("leaves", SingleDevice().stage_layouts(model, config.memory.page_size)),
        ("pages", stage_layouts(model, config.memory.page_size)),
    ):
        fns = stages.StageFunctions(model, layouts, SingleDevice())
        args = fns.abstract_args(B, T, jnp.float32)
        counts[name] = _concatenates(fns.block_fwd, args["block_fwd"])
        assert layouts["block"].num_pages > 1
    assert counts == {"leaves": 0, "pages": counts["pages"]} and counts["pages"] > 0


@pytest.mark.parametrize(
    "offload, emulate",
    [
        (dict(mode="stream"), False),  # host RAM
        (dict(mode="stream", optimizer="nvme", params="nvme"), False),  # read as numpy
        (dict(mode="stream", optimizer="nvme", params="nvme"), True),  # landed in pinned
        pytest.param(  # cut on the device (~9 s)
            dict(mode="stream", optimizer_device_stages=2), False, marks=pytest.mark.slow
        ),
    ],
    ids=["host", "nvme", "nvme-pinned", "device-cache"],
)
def test_every_store_hands_one_device_leaf_buffers(tiny, offload, emulate, monkeypatch):
    """Whatever tier the params live in, a stage reaches the device as its leaves, each
    in the memory the tier says (host stores: pinned_host; the device cache: device),
    and after a step they are the updated params (the stores cut the new pages). On the
    CPU backend a host store's leaves reach the device without a copy
    (``SingleDevice.to_device``)."""
    if emulate:
        monkeypatch.setenv(HOST_CLIENT_ENV, "separate")
    config = tiny(offload=offload, memory=PAGES)
    runtime = StreamingRuntime(config)
    try:
        runtime.train_step(training_batches(config, 1)[0])
        if "nvme" in offload.values():  # the step's writes landed: every stage read back
            runtime.param_store.wait()  # (one still being written is served from RAM)
        params = runtime.params()  # the fp32 masters, which fp32 compute params equal
        of = lambda stage: (
            params[stage]
            if stage in ("embed", "head")
            else jax.tree.map(lambda a: a[runtime.block_names.index(stage)], params["blocks"])
        )
        for stage in runtime.stage_names:
            got = runtime.param_store.get(stage)
            layout = runtime.layouts[runtime.layout_name(stage)]
            assert isinstance(got, LeafBuffers), (stage, type(got))
            assert [a.shape for a in got] == [leaf.shape for leaf in layout.leaves]
            kind = "device" if stage in runtime.device_stages else "pinned_host"
            pinned = emulate or "nvme" not in offload.values()
            if kind == "device" or pinned:
                assert all(a.sharding.memory_kind == kind for a in got), stage
            on_device = runtime.parallel.to_device(got, layout)
            assert all(a.sharding.memory_kind == "device" for a in on_device)
            if kind != "device":  # the CPU's device memory is the host's: no copy
                shared = [
                    np.shares_memory(np.asarray(d), np.asarray(g))
                    for d, g in zip(on_device, got, strict=True)
                ]
                assert all(shared), (stage, shared)
            # the leaves are the params the optimizer published after the step
            published = layout.unflatten_pages(LeafBuffers(np.asarray(a) for a in got))
            assert_trees_close(published, of(stage), 0)
    finally:
        runtime.close()
