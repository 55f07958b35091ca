"""Every file in configs/ parses, and its model initialises abstractly (no allocation)
with a parameter count within 2% of the size its source names."""

import math

import jax
import pytest

from hetjax.config import CONFIGS_DIR, load_config_module
from models import build_model

CONFIG_FILES = sorted(CONFIGS_DIR.glob("*.py"))


def test_configs_exist():
    names = {p.stem for p in CONFIG_FILES}
    assert {"gpt_tiny", "gpt_small", "gpt1p3b", "gpt2p7b", "gpt6p7b", "gpt13b", "gpt175b"} <= names
    assert {f"fuyou_gpt{s}" for s in ("33b", "65b", "135b", "276b", "412b", "805b")} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_parses_and_eval_shape_matches_nominal(path):
    module = load_config_module(path)
    config = module.get_config()
    model = build_model(config.model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))  # abstract: nothing allocated
    n = sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
    assert n == model.param_count()
    assert abs(n / module.NOMINAL_PARAMS - 1) < 0.02, (path.stem, n, module.NOMINAL_PARAMS)
    for group in model.groups:  # each group's blocks stacked on their layer axis
        blocks = shapes[group.key]
        assert all(a.shape[0] == group.num_layers for a in jax.tree.leaves(blocks))
    assert sum(g.num_layers for g in model.groups) == config.model.num_blocks


def test_gpt175b_shape():
    config = load_config_module(CONFIGS_DIR / "gpt175b.py").get_config()
    m = config.model
    assert (m.num_layers, m.d_model, m.num_heads, m.max_seq_len) == (96, 12288, 96, 2048)
