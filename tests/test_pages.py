import jax
import numpy as np
import pytest

from hetjax.storage.pages import PAGE_ALIGN, SlabLayout, fitted_page_elems
from models import build_model


def _tree():
    rng = np.random.default_rng(0)
    return {
        "ln": {
            "scale": rng.normal(size=(7,)).astype(np.float32),
            "bias": rng.normal(size=(7,)).astype(np.float32),
        },
        "dense": {
            "kernel": rng.normal(size=(30, 100)).astype(np.float32),
            "bias": rng.normal(size=(100,)).astype(np.float32),
        },
        "wte": rng.normal(size=(5, 3)).astype(np.float32),
    }


def test_layout_orders_decayed_first_and_pads_to_pages():
    tree = _tree()
    layout = SlabLayout.from_params(tree, page_bytes=4096)  # 1024 elements a page
    assert [leaf.path for leaf in layout.leaves][:2] == [("dense", "kernel"), ("wte",)]
    assert layout.num_decay == 30 * 100 + 5 * 3
    assert layout.size == 3000 + 15 + 100 + 7 + 7
    assert layout.num_pages == 4 and layout.padded_size == 4096
    slab = layout.flatten_np(tree)
    assert np.all(slab[layout.size :] == 0)


def test_flatten_unflatten_round_trips_through_pages():
    tree = _tree()
    layout = SlabLayout.from_params(tree, page_bytes=4096)
    slab = layout.flatten_np(tree)
    np.testing.assert_array_equal(np.asarray(layout.flatten(tree)), slab)  # jnp == numpy
    pages = layout.to_pages(slab)
    assert len(pages) == layout.num_pages
    for out in (layout.unflatten(slab), jax.jit(layout.unflatten_pages)(pages)):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, out), tree)


def test_gpt_block_layout_covers_every_parameter(tiny):
    model = build_model(tiny().model)
    block = model.init_stage("block", jax.random.key(0))
    layout = SlabLayout.from_params(block, page_bytes=4096)
    assert layout.size == sum(a.size for a in jax.tree.leaves(block))
    names = {leaf.path for leaf in layout.leaves[: len(layout.leaves)]}
    decayed = {leaf.path for leaf in layout.leaves if leaf.offset < layout.num_decay}
    assert all(p[-1] == "kernel" for p in decayed) and len(names) == 12


@pytest.mark.parametrize("multiple", [1, 2, 4])
@pytest.mark.parametrize("block", [1, 1000, 12_590_080, 50_358_272, 3 * 2**20, 3 * 2**20 + 1])
def test_fitted_pages_keep_the_page_count_and_pad_less_than_4kib_a_page(block, multiple):
    page = 2**20  # 4 MiB of fp32, memory.page_size's default
    fitted = fitted_page_elems(block, page, multiple)
    pages = -(-block // page)
    pages = -(-pages // multiple) * multiple
    assert fitted <= page and fitted % PAGE_ALIGN == 0
    assert -(-block // fitted) <= pages  # no more pages than unfitted
    assert pages * fitted - block < pages * PAGE_ALIGN  # padding: under 4 KiB a page
    assert fitted_page_elems(block, 256, multiple) == 256  # pages of 1 KiB stay
