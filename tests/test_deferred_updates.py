"""Deferred expert updates (offload.expert_updates=deferred, hetjax/optimizer/deferred.py):
the optimizer state of experts without a token stays on NVMe, its updates caught up
exactly before the expert's next use; training equals updating every expert every step,
bit for bit, and moves fewer bytes."""

import jax
import numpy as np
import pytest
from equivalence import assert_losses_close, assert_trees_close, bit_exact_here
from test_expert_fetch import _config, _skewed

from hetjax.checkpoint import Checkpointer
from hetjax.optimizer.deferred import Deferred
from hetjax.runtime.streaming import StreamingRuntime
from hetjax.types import RuntimeState

NVME = dict(optimizer="nvme", params="nvme")
P = 4096 // 4  # elements of a 4 KiB page (the configs' memory.page_size)


def _batches(steps: int, seed: int = 1) -> list[np.ndarray]:
    """Training batches: 2 micro-batches of 1 x 8 tokens (+1)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (2, 1, 9), dtype=np.int32) for _ in range(steps)]


def _run(
    config, batches, used: int, tmp_path=None, save_at: int = 0, resume: bool = True,
    runtime_of=StreamingRuntime,
):  # fmt: skip
    """Trains ``config`` from the skewed params (tokens routed to ``used`` experts of 16)
    on ``batches``; returns the losses, each step's metrics with the state store's bytes
    read by kind and written (``moments_read``, ``state_written``), the evaluation loss
    on the first batch, the deferred pages' count after each step, and the final master
    params. ``save_at``: a checkpoint then, resumed by a second runtime for the rest
    (``resume``), or the same runtime going on. ``runtime_of``: config -> the runtime
    (one device's)."""
    runtime = runtime_of(config)
    losses, metrics, behind = [], [], []
    ckpt = Checkpointer(tmp_path / "ckpt") if save_at else None
    try:
        runtime.load_state(_skewed_adamw(runtime, used))
        for step, batch in enumerate(batches, 1):
            states = runtime.states
            moments, written = states.read_kinds["mu"] + states.read_kinds["nu"], states.write_bytes
            report = runtime.train_step(batch)
            losses.append(report.loss)
            metrics.append(
                report.metrics
                | {
                    "moments_read": states.read_kinds["mu"] + states.read_kinds["nu"] - moments,
                    "state_written": states.write_bytes - written,
                }
            )
            behind.append(sum(len(p) for p in runtime.loop.pending().values()))
            if step == save_at:
                ckpt.save(step, runtime.save_state(), {})
                ckpt.wait()
                if not resume:
                    continue
                runtime.close()
                runtime = runtime_of(config)
                runtime.load_state(ckpt.restore(step)[0])
        val = runtime.eval_loss(batches[0][0])
        return losses, metrics, val, behind, runtime.params()
    finally:
        runtime.close()
        if ckpt is not None:
            ckpt.close()


def _skewed_adamw(runtime: StreamingRuntime, used: int) -> RuntimeState:
    """``test_expert_fetch._skewed``'s router (tokens to the first ``used`` experts)
    with AdamW's state: zero moments, zero step counts."""
    return _adamw_state(runtime, _skewed(runtime, used).params())


def _adamw_state(runtime: StreamingRuntime, params) -> RuntimeState:
    """``params`` with AdamW's state: zero moments, zero step counts."""
    zeros = jax.tree.map(np.zeros_like, params)
    scalars = [np.zeros((), np.int32)] * len(runtime.states.scalars["embed"])
    trees = {"master": params, "mu": zeros, "nu": zeros}
    return RuntimeState.from_trees(trees, scalars, groups=runtime.model.groups)


def _adamw(tiny, updates: str, params: str = "nvme", dtype: str = "float32"):
    """AdamW with weight decay and clipping that binds (a redo of some steps' updates),
    the state on NVMe, the params on ``params`` (NVMe in fp32: the state's master),
    4 KiB pages."""
    config = _config(tiny, "routed", optimizer="nvme", params=params, expert_updates=updates)
    return config.replace(
        optimizer=dict(name="adamw", weight_decay=0.1, grad_clip=0.5, lr=1e-2),
        train=dict(grad_accum=2, batch_size=2),
        model=dict(compute_dtype=dtype),
    )


@pytest.mark.parametrize(
    "used, params, dtype",
    [
        (8, "nvme", "float32"),
        pytest.param(4, "nvme", "float32", marks=pytest.mark.slow),
        pytest.param(8, "host", "float32", marks=pytest.mark.slow),
        pytest.param(8, "nvme", "bfloat16", marks=pytest.mark.slow),  # params' own files
    ],
)
def test_deferred_equals_updating_every_expert_and_moves_fewer_bytes(tiny, used, params, dtype):
    """Tokens routed to ``used`` of 16 experts: the pages of experts without a token in a
    step are deferred (their state not read but the master, not written), those routed
    again caught up before their copy; losses, the evaluation loss and every param equal
    updating every expert every step, bit for bit, whichever store holds the params.
    Each step reads the deferred pages' two moments less and writes their three kinds
    less, and reads and writes the three kinds of the pages it caught up once more."""
    batches = _batches(5)
    runs = {
        u: _run(_adamw(tiny, u, params, dtype), batches, used=used) for u in ("deferred", "all")
    }
    (losses, metrics, val, behind, params), every = runs["deferred"], runs["all"]
    if bit_exact_here():
        assert losses == every[0]
        assert val == every[2]
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(every[4]), strict=True):
            np.testing.assert_array_equal(a, b)
    else:  # a GPU's scatter atomics without XLA's deterministic ops
        assert_losses_close([*losses, val], [*every[0], every[2]], 1e-5)
        assert_trees_close(params, every[4], 1e-5)
    assert any(m["optimizer_redo"] for m in metrics)  # clipping bound: a redo ran
    cfg = _adamw(tiny, "all").model
    rows = cfg.d_model * cfg.d_ff  # one expert's elements in one expert leaf
    # 2 blocks x 3 leaves: the experts never routed, their pages wholly inside
    assert min(behind) >= 2 * 3 * ((16 - used) * rows - 2 * P) // P > 0
    page = P * 4
    for m, m_all in zip(metrics, every[1], strict=True):
        deferred, caught = m["expert_pages_deferred"], m["expert_pages_caught_up"]
        assert deferred > 0
        assert m_all["moments_read"] - m["moments_read"] == (2 * deferred - 2 * caught) * page
        assert m_all["state_written"] - m["state_written"] == (3 * deferred - 3 * caught) * page
        # (the master is read whole: the params of the pages left alone come from it)
    if used == 8:  # the routed set moves among the 8: some experts come back
        assert sum(m["expert_pages_caught_up"] for m in metrics) > 0


@pytest.mark.slow  # 10 s; deferred == every expert and a resume are in the default run
@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "going_on"])
def test_a_checkpoint_with_pages_behind_resumes_exactly(tiny, tmp_path, resume):
    """Saved at step 2 with pages behind (caught up into the checkpoint), resumed by a
    new runtime or trained on by the same one: steps 3-4 and the final params equal a
    run without the checkpoint."""
    batches = _batches(4)
    config = _adamw(tiny, "deferred")
    losses, _, val, _, params = _run(
        config, batches, used=4, tmp_path=tmp_path, save_at=2, resume=resume
    )
    whole = _run(config, batches, used=4)
    assert losses == whole[0] and val == whole[2]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole[4]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bookkeeping_counts_each_page_missed_update():
    """A page skipped at updates 1 and 2 of a stage is caught up with those two updates'
    starting scalars; once caught up, none is kept."""
    d = Deferred()
    for step, skip in enumerate([(), (5,), (5,), ()]):
        d.defer("block0", frozenset(skip))
        if step == 3:
            assert d.catch_up_groups("block0") == [([5], ["s1", "s2"])]
            d.caught_up("block0", [5])
        d.updated("block0", d.skip_of("block0"), f"s{step}")
        d.commit()
        d.end_step()
    assert d.pending() == {} and d.inputs["block0"] == {} and d.updates["block0"] == 4
    d.defer("block0", frozenset({7}))
    d.updated("block0", d.skip_of("block0"), "s4")
    d.abort()  # a dropped step defers nothing
    d.commit()
    assert d.pending() == {}


@pytest.mark.parametrize("bad", [dict(expert_updates="lazy")])
def test_bad_setting_names_the_key(tiny, bad):
    from hetjax.config import ConfigError

    with pytest.raises(ConfigError, match="offload.expert_updates"):
        tiny(offload=bad)


@pytest.mark.slow  # ~12 s (the default run's time, 2026-11-27)
def test_the_planner_counts_the_state_deferred_experts_leave_on_disk():
    """With the state on NVMe, a plan counts only the share of the routed experts'
    state a step touches (uniform routing: an expert gets a token in one of A
    micro-batches with q = 1 - (1 - f)^A), plus catching up those coming back after a
    gap (q (1 - q)), and the table says so; expert_updates=all moves it all."""
    from hetjax.config import load_config
    from hetjax.planning.cost import deferred_bytes
    from hetjax.planning.hardware import get_profile
    from hetjax.planning.search import make_plan
    from hetjax.planning.workload import Workload

    short = dict(batch_size=2, grad_accum=2, seq_len=4)  # 4 tokens a micro-batch, top-8/64
    offload = dict(mode="stream", optimizer="nvme", params="nvme")
    config = load_config("configs/moe_fine_7b.py").replace(train=short, offload=offload)
    w = Workload.from_config(config, backend="gpu")
    f = 1 - (1 - 8 / 64) ** 4
    q = 1 - (1 - f) ** 2
    assert w.deferred_expert_updates and w.expert_step_share == pytest.approx(q)
    every = config.replace(offload=dict(expert_updates="all"))
    assert not Workload.from_config(every, backend="gpu").deferred_expert_updates
    saved_r, saved_w, again = deferred_bytes(w, 12.0)
    assert again == pytest.approx(12 * q * (1 - q))
    assert saved_r == pytest.approx(8 * (1 - q) - again)  # the master is read anyway
    assert saved_w == pytest.approx(12 * (1 - q) - again)

    hw = get_profile("rtx4090", "", config.model.compute_dtype)
    tight = dict(host_budget="64GiB")  # the state (84 GB) goes to NVMe
    deferred = make_plan(config.replace(memory=tight), hw)
    whole = make_plan(every.replace(memory=tight), hw)
    assert deferred.candidate == whole.candidate
    assert deferred.placement.optimizer == "nvme" and deferred.placement.expert_fetch == "routed"
    assert deferred.lanes["nvme"] < whole.lanes["nvme"]
    assert f"updates {q:.0%} of it on NVMe" in deferred.table()
    assert "expert_updates" not in whole.table()


def _expert_of(tokens: np.ndarray) -> np.ndarray:
    """The expert :func:`_routed_by_token` sends each token id to: 2 i + s for the
    embedding's one coordinate i = t mod 16 and its sign s = (t // 16) mod 2 (0: +).
    The 256 token ids fall 8 to each of the 32 experts: uniform tokens, uniform routing."""
    return 2 * (tokens % 16) + (tokens // 16) % 2


def _routed_by_token(runtime: StreamingRuntime) -> RuntimeState:
    """The runtime's params (d 32, 32 experts, top-1) with routing that depends on the
    token id alone, :func:`_expert_of`: token t's embedding is +/- 100 on coordinate
    t mod 16, zero elsewhere (what attention and the experts add is small beside it, so
    each block's normalised input stays nearly +/- sqrt(32) there), and each block's
    router column 2 i is +10 on coordinate i, column 2 i + 1 is -10."""
    params = jax.tree.map(np.array, runtime.params())
    t = np.arange(256)
    embed = params["embed"]["embed_tokens"]  # (V, D)
    embed[...] = 0
    embed[t, t % 16] = np.where((t // 16) % 2 == 0, 100.0, -100.0)
    router = params["blocks"]["moe"]["router"]  # (L, D, E)
    router[...] = 0
    for i in range(16):
        router[:, i, 2 * i], router[:, i, 2 * i + 1] = 10.0, -10.0
    return _adamw_state(runtime, params)


@pytest.mark.slow  # 7 s warm, 16 s cold: 8 steps of a routed MoE, its state on NVMe
def test_the_planners_deferred_share_is_what_a_run_defers():
    """The planner's expected share of the routed experts' state a step leaves alone,
    1 - q with q = 1 - (1 - f)^A (uniform routing), against a run's
    ``expert_pages_deferred`` where routing is uniform by construction: 32 experts,
    top-1, 2 micro-batches of 8 tokens, uniform random token ids routed by id
    (:func:`_routed_by_token`). An expert's rows in each of its 3 leaves are exactly one
    4 KiB page (32 x 32 fp32, every leaf page-aligned), so each step defers 2 blocks x 3
    pages per expert that got no token: counted from the step's token ids, exactly. Over
    8 steps the mean share deferred is within 0.06 of 1 - q = (31/32)^16 = 0.601: the
    number of experts without a token among 32 after 16 uniform draws has a standard
    deviation of 1.4 (0.044 of 32) a step, 0.016 over 8 steps; measured here (19.25
    experts a step without a token, 0.6016), 0.0002 off. A planner that forgot the
    micro-batches (1 - f = 0.776) or took top-2 (0.356) would be 0.17 and 0.25 off."""
    from conftest import tiny_config
    from test_expert_fetch import _config

    from hetjax.planning.workload import Workload

    config = _config(tiny_config, "routed", optimizer="nvme", params="nvme")
    config = config.replace(
        model=dict(num_experts=32, d_ff=32, num_kv_heads=4),
        # no clipping: no redo, whose second update would count its pages again
        optimizer=dict(name="adamw", weight_decay=0.1, lr=1e-2, grad_clip=0.0),
    )
    assert config.offload.expert_updates == "deferred"  # (the default)
    w = Workload.from_config(config, backend="cpu")
    assert w.deferred_expert_updates and w.micro_batches == 2
    share = 1 - w.expert_step_share
    assert share == pytest.approx((31 / 32) ** 16)  # f = 1 - (31/32)^8, A = 2
    pages = 2 * 3  # a step defers per expert without a token: 2 blocks x 3 leaves

    runtime = StreamingRuntime(config)
    deferred, without = [], []
    try:
        runtime.load_state(_routed_by_token(runtime))
        for batch in _batches(8, seed=3):
            report = runtime.train_step(batch)
            used = np.unique(_expert_of(batch[:, :, :-1]))  # the inputs, not the targets
            without.append(32 - len(used))
            deferred.append(report.metrics["expert_pages_deferred"])
    finally:
        runtime.close()
    assert deferred == [pages * n for n in without]
    measured = np.mean(deferred) / (pages * 32)
    assert abs(measured - share) <= 0.06, (measured, share, without)
