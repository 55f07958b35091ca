"""Expert-aware streaming (offload.expert_fetch=routed, hetjax/runtime/experts/routed.py): a
streamed MoE block copies only the experts its tokens were routed to, and trains exactly
as copying every expert does."""

import functools

import jax
import numpy as np
import pytest
from equivalence import assert_training_equal, check_tokens
from test_moe import MOE

from hetjax import timeline
from hetjax.config import ConfigError
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.train import train
from hetjax.types import RuntimeState
from models import build_model

# 16 experts, top-1, 1 x 8 tokens a micro-batch: at most 8 experts of 16 get a token, so
# a routed block copies at most half its experts, whatever the router
SPARSE = dict(MOE, num_experts=16, experts_per_token=1, max_seq_len=32)
SHORT = dict(steps=3, eval_batches=1, batch_size=2, grad_accum=2, seq_len=8)
# T5-MoE: one encoder block and two decoder blocks (each a dense and a sparse layer)
T5_MOE = dict(num_experts=16, experts_per_token=1, num_layers=2, num_decoder_layers=4)
T5_MOE |= dict(feed_forward_proj="relu", router_aux_loss_coef=0.02)


def _config(tiny, fetch: str, **offload):
    offload = dict(mode="stream", expert_fetch=fetch, **offload)
    return tiny(
        model=SPARSE,
        train=SHORT,
        optimizer=dict(name="adamw"),
        offload=offload,
        memory=dict(page_size="4KiB"),  # an expert's rows span pages: some stay behind
    )


def test_routed_streaming_equals_fetching_every_expert(tiny, tmp_path):
    """AdamW with weight decay, optimizer state and params on NVMe, both blocks routed:
    the losses, the validation loss and every param equal expert_fetch=all's (AdamW moves
    an expert with no token too, which both do: the gradient is zero in both, whether
    its pages came from the device or were known zero), and the metrics say how many
    experts were copied."""
    nvme = dict(optimizer="nvme", params="nvme")
    routed, every = (
        train(_config(tiny, f, **nvme), tmp_path / f, verbose=False) for f in ("routed", "all")
    )
    assert_training_equal(routed, every, build_model(tiny(model=SPARSE).model), check_tokens())
    for record in routed.records:
        # 2 micro-batches x 3 block copies (block0 forward and backward, block1 once:
        # the window keeps it to its backward), each at most 8 experts of 16
        assert 0 < record["experts_fetched"] <= 8 * 2 * 3
        assert 0 < record["experts_fetched_fraction"] <= 0.5
    assert not any("experts_fetched" in r for r in every.records)


@pytest.mark.slow  # 15 s; the Llama test above is routed streaming's in the default run
def test_t5_switch_blocks_stream_routed_as_fetching_every_expert(tiny, tmp_path):
    """T5-MoE: the Switch blocks of both stacks are routed (a dense layer, then a sparse
    one whose attention and router run first; a decoder block reads the encoder's output,
    whose gradient its routed backward returns) and train with AdamW as copying every
    expert does: losses, validation loss, every param and the logits. 16 experts, top-1,
    8 tokens a micro-batch: at most half are copied. (Routed blocks with params and state
    on NVMe: the Llama test above; T5's which blocks and which leaves: the skewed-router
    test below.)"""
    from test_t5 import t5_config, t5_tokens

    runs = {}
    for fetch in ("routed", "all"):
        config = t5_config(tiny, **T5_MOE).replace(
            train=dict(SHORT, seq_len=8),
            optimizer=dict(name="adamw"),
            offload=dict(mode="stream", expert_fetch=fetch),
            memory=dict(page_size="4KiB"),
        )
        runs[fetch] = train(config, tmp_path / fetch, verbose=False)
    assert_training_equal(runs["routed"], runs["all"], build_model(config.model), t5_tokens())
    for record in runs["routed"].records:
        # 2 micro-batches x (3 blocks forward + 2 backward: the window keeps the last
        # one from its forward to its backward), each at most 8 experts of 16
        assert 0 < record["experts_fetched"] <= 8 * 2 * 5
        assert 0 < record["experts_fetched_fraction"] <= 0.5


def test_a_model_whose_experts_are_not_found_is_refused(tiny, monkeypatch):
    """Routing with the expert leaves not found would compute with the wrong experts'
    rows: the runtime refuses it, naming the fix."""
    from test_t5 import t5_config

    from models.t5 import T5

    monkeypatch.setattr(T5, "__init__", _without_expert_params(T5.__init__))
    moe = dict(num_experts=4, experts_per_token=1, num_layers=2, num_decoder_layers=2)
    config = t5_config(tiny, **moe).replace(offload=dict(mode="stream"))
    with pytest.raises(ValueError, match="no expert leaves named"):
        StreamingRuntime(config).close()


def _without_expert_params(init):
    def wrapped(self, config):
        init(self, config)
        self.expert_params = ("experts",)

    return wrapped


def _skewed(runtime: StreamingRuntime, used: int, routers=(("blocks", "moe"),)) -> RuntimeState:
    """The runtime's params with every block's router sending each token to one of the
    first ``used`` experts: their columns are +/- a large multiple of one direction
    each, the other experts' zero, so a token's top expert is always one of the first
    ones (top-1; a logit of 0 never wins over the +|a| one of a pair). ``routers``: the
    paths of the routers' parent in the params (each (L, D, E))."""
    params = jax.tree.map(np.array, runtime.params())
    rng = np.random.default_rng(0)
    for path in routers:
        router = functools.reduce(dict.__getitem__, path, params)["router"]
        router[...] = 0
        for e in range(0, used, 2):
            direction = rng.standard_normal(router.shape[1]) * 10
            router[:, :, e], router[:, :, e + 1] = direction, -direction
    trace = jax.tree.map(np.zeros_like, params)  # SGD's momentum, before any step
    groups = runtime.model.groups
    return RuntimeState.from_trees(
        {"master": params, "trace": trace}, [np.zeros((), np.int32)], groups=groups
    )


def _moved(
    config, batch, skew, check=None, runtime_of=StreamingRuntime
) -> tuple[dict, float, dict]:
    """A second training step of ``config`` on ``batch`` from the skewed params: the bytes
    its copies moved (the timeline's count), its loss and its metrics. ``check``: called
    with the runtime first; ``runtime_of``: config -> the runtime (one device's)."""
    runtime = runtime_of(config)
    try:
        if check is not None:
            check(runtime)
        runtime.load_state(skew(runtime))
        runtime.train_step(batch)  # compiled; its copies are not counted
        with timeline.recording(timeline.Recorder()) as rec:
            report = runtime.train_step(batch)
        return rec.finish().moved_bytes, report.loss, report.metrics
    finally:
        runtime.close()


@pytest.mark.slow  # 21 s cold; routed copies' share: test_routed_streaming_equals_... (default)
def test_a_skewed_router_copies_fewer_bytes(tiny):
    """With a router that sends every token to 4 of 16 experts, a routed step copies
    exactly the other 12 experts' bytes less host -> device than copying every expert,
    and their gradients' pages do not come back (the timeline's count of the step's
    copies), for the same loss (small pages: an expert's rows span several)."""
    moved, losses = {}, {}
    # one micro-batch of 2 x 8 tokens: its gradient goes to the optimizer as it landed,
    # the pages known zero among them
    batch = np.random.default_rng(1).integers(0, 256, (1, 2, 9), dtype=np.int32)
    for fetch in ("routed", "all"):
        config = _config(tiny, fetch).replace(
            optimizer=dict(name="sgd", lr=0.1), train=dict(grad_accum=1)
        )
        moved[fetch], losses[fetch], metrics = _moved(config, batch, lambda r: _skewed(r, 4))
        if fetch == "routed":
            fetched = metrics["experts_fetched"]
    P = 4096 // 4  # elements of a 4 KiB page
    np.testing.assert_allclose(losses["routed"], losses["all"], rtol=1e-6)
    cfg = config.model
    expert = 3 * cfg.d_model * cfg.d_ff * 4  # one expert's gate, up and down, fp32
    # block copies: block0's forward and backward and block1's forward (the window
    # keeps the last block from its forward to its backward)
    copies = 3
    assert 0 < fetched <= 4 * copies
    h2d = {f: m["host_to_device"] for f, m in moved.items()}
    assert h2d["all"] - h2d["routed"] == (16 * copies - fetched) * expert
    # Gradients: the pages wholly inside experts 4-15's rows of each expert leaf stay on
    # the device (zero); at most two pages of a leaf's run of them are partly outside
    d2h = {f: m["device_to_host"] for f, m in moved.items()}
    rows = cfg.d_model * cfg.d_ff  # one expert's elements in one leaf
    grads = 2  # blocks
    assert d2h["all"] - d2h["routed"] >= grads * 3 * (12 * rows - 2 * P) * 4 > 0


@pytest.mark.slow  # (29 s cold; the default run has T5's routed training, Llama's bytes)
def test_t5_switch_blocks_with_a_skewed_router_copy_fewer_bytes(tiny):
    """T5-MoE, the routers of both stacks sending every token to 4 of 16 experts: a
    routed step copies exactly the other experts' bytes less host -> device, and their
    gradients' pages wholly in them stay on the device, for the same loss."""
    from test_t5 import t5_config

    moe = dict(T5_MOE, router_aux_loss_coef=0.0)
    # one micro-batch of 2 windows of 2 x 8 tokens (the encoder's 8, the decoder's 8)
    batch = np.random.default_rng(1).integers(0, 256, (1, 2, 16), dtype=np.int32)
    routers = (("encoder", "sparse", "moe"), ("decoder", "sparse", "moe"))
    skew = lambda runtime: _skewed(runtime, 4, routers)
    moved, losses = {}, {}
    for fetch in ("routed", "all"):
        config = t5_config(tiny, **moe).replace(
            train=dict(batch_size=2, grad_accum=1, seq_len=8),
            optimizer=dict(name="sgd", lr=0.1),
            offload=dict(mode="stream", expert_fetch=fetch),
            memory=dict(page_size="4KiB"),
        )
        check = _t5_routed if fetch == "routed" else None
        moved[fetch], losses[fetch], metrics = _moved(config, batch, skew, check)
        if fetch == "routed":
            fetched = metrics["experts_fetched"]
    np.testing.assert_allclose(losses["routed"], losses["all"], rtol=1e-6)
    cfg = config.model
    rows = cfg.d_model * cfg.d_ff  # one expert's elements in one leaf (wi or wo)
    # block copies: 3 blocks forward, 2 backward (the window keeps the last from its
    # forward to its backward); at most 4 experts each
    copies = 5
    assert 0 < fetched <= 4 * copies
    h2d = {f: m["host_to_device"] for f, m in moved.items()}
    assert h2d["all"] - h2d["routed"] == (16 * copies - fetched) * 2 * rows * 4
    d2h = {f: m["device_to_host"] for f, m in moved.items()}
    P = 4096 // 4  # elements of a 4 KiB page
    assert d2h["all"] - d2h["routed"] >= 3 * 2 * (12 * rows - 2 * P) * 4 > 0


def _t5_routed(runtime: StreamingRuntime) -> None:
    """T5-MoE's routed blocks: the encoder's one and the decoder's two, each group's
    fetcher with its own layout and its sparse layer's expert leaves."""
    assert runtime.routed == {"encoder0", "decoder0", "decoder1"}
    layouts = {g: f.block.layout for g, f in runtime.experts.items()}
    assert layouts[0] is not layouts[1]
    for g, fetcher in runtime.experts.items():
        paths = [layouts[g].leaves[k].path for k in fetcher.block.expert_leaves]
        assert paths == [("sparse", "moe", "wi"), ("sparse", "moe", "wo")]


def test_routed_applies_to_streamed_recomputed_blocks_only(tiny):
    """Kept blocks (whole on the device from forward to backward) and expert-parallel
    or dense models are not routed; a bad expert_fetch value is named."""
    runtime = StreamingRuntime(_config(tiny, "routed", keep_blocks=1))
    try:
        assert runtime.routed == {"block0"}
    finally:
        runtime.close()
    dense = StreamingRuntime(tiny(offload=dict(mode="stream")))
    try:
        assert not dense.routed and dense.experts is None
    finally:
        dense.close()
    with pytest.raises(ConfigError, match="offload.expert_fetch"):
        tiny(offload=dict(expert_fetch="some"))


@pytest.mark.slow  # 7 s: it trains to read a measured share
def test_the_planner_expects_the_routed_share_or_reads_the_measured_one(tmp_path):
    """The plan's host->device lane counts only the routed share of the streamed blocks'
    experts: uniform routing's expectation 1 - (1 - k/E)^tokens, or the share the
    workdir's last run measured (its metrics' median), which the table names; where
    routing saves nothing the planner copies the experts whole."""
    from hetjax.config import load_config
    from hetjax.planning.hardware import get_profile
    from hetjax.planning.search import make_plan
    from hetjax.planning.workload import measured_expert_fraction

    short = dict(batch_size=1, seq_len=4)  # 4 tokens, top-8 of 64 experts: 41% expected
    config = load_config("configs/moe_fine_7b.py").replace(train=short)
    hw = get_profile("rtx4090", "", config.model.compute_dtype)
    every = make_plan(config.replace(offload=dict(expert_fetch="all")), hw)
    routed = make_plan(config, hw)
    assert routed.candidate.mode == every.candidate.mode == "stream"
    assert routed.expert_fraction == pytest.approx(1 - (1 - 8 / 64) ** 4)
    assert "41% of its experts" in routed.table() and "experts:" not in every.table()
    assert routed.placement.expert_fetch == "routed" and every.placement.expert_fetch == "all"
    # the same placement, fewer bytes moved: 7 streamed blocks' experts, 59% of them not
    # copied, forward and backward
    assert routed.candidate.replace(expert_fetch="all") == every.candidate
    assert routed.lanes["host->device"] < 0.5 * every.lanes["host->device"]
    assert routed.config_overrides()["offload"]["expert_fetch"] == "routed"

    # 4 x 4096 tokens: uniform routing reaches every expert, routing would only add the
    # forward's wait, and the planner copies the experts whole
    whole = make_plan(load_config("configs/moe_fine_7b.py"), hw)
    assert whole.placement.expert_fetch == "all" and whole.expert_fraction == 1.0
    assert "copied whole" in whole.table()
    assert whole.config_overrides()["offload"]["expert_fetch"] == "all"

    assert measured_expert_fraction(tmp_path) is None
    lines = ['{"step": 1, "experts_fetched_fraction": 0.25}', '{"step": 2}', "{cut",
             '{"step": 3, "experts_fetched_fraction": 0.75}',
             '{"step": 4, "experts_fetched_fraction": 0.5}']  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert measured_expert_fraction(tmp_path) == 0.5
    measured = make_plan(config, hw, expert_fraction=measured_expert_fraction(tmp_path))
    assert "50% of its experts" in measured.table() and "measured" in measured.table()
