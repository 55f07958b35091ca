"""Mixture-of-experts llama blocks (Mixtral routing): logits and the load-balancing loss
equal transformers' MixtralForCausalLM; configs parse and plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import assert_training_equal, assert_trees_close, check_tokens
from hf_models import VOCAB

from hetjax.config import Config, ConfigError
from hetjax.train import train
from models import build_model
from models.llama import router_balance_loss
from models.staged import token_loss

MOE = dict(
    family="llama", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
    num_experts=4, experts_per_token=2, router_aux_loss_coef=0.02, tie_embeddings=False,
    vocab_size=VOCAB, max_seq_len=256, rope_theta=5000.0,
)  # fmt: skip


def build_hf_mixtral(seed: int = 0):
    """A random-weight MixtralForCausalLM of MOE's shape, norm weights perturbed, fp32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, sliding_window=None,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:  # experts' 3-D weights are left uninitialised (empty) by some versions
                p.copy_(0.1 * torch.randn_like(p))
    return model.float().eval()


def params_from_hf(model) -> dict:
    """Our params (fp32 numpy) from a MixtralForCausalLM's state dict."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    F = model.config.intermediate_size
    layers = []
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2F, D)
        layers.append(
            {
                "input_layernorm": {"scale": sd[p + "input_layernorm.weight"]},
                "post_attention_layernorm": {"scale": sd[p + "post_attention_layernorm.weight"]},
                **{
                    n: {"kernel": sd[p + f"self_attn.{n}.weight"].T}
                    for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                },
                "moe": {
                    "router": sd[p + "mlp.gate.weight"].T,  # (D, E)
                    "gate_proj": gate_up[:, :F].transpose(0, 2, 1),  # (E, D, F)
                    "up_proj": gate_up[:, F:].transpose(0, 2, 1),
                    "down_proj": sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1),  # (E, F, D)
                },
            }
        )
    return {
        "embed": {"embed_tokens": sd["model.embed_tokens.weight"]},
        "blocks": jax.tree.map(lambda *a: np.stack(a), *layers),
        "head": {
            "norm": {"scale": sd["model.norm.weight"]},
            "lm_head": {"kernel": sd["lm_head.weight"].T},
        },
    }


def tokens(batch=2, seq=16, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq), dtype=np.int32)


def test_shapes_and_active_flops():
    model = build_model(Config().replace(model=MOE).model)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    moe = shapes["blocks"]["moe"]
    assert moe["router"].shape == (2, 32, 4)
    assert moe["gate_proj"].shape == moe["up_proj"].shape == (2, 4, 32, 48)
    assert moe["down_proj"].shape == (2, 4, 48, 32)
    assert "gate_proj" not in shapes["blocks"]
    dense = build_model(Config().replace(model={**MOE, "num_experts": 0}).model)
    expert = 3 * 32 * 48
    # the MoE's params: the dense model's MLP replaced by 4 experts and a router
    assert model.param_count() == dense.param_count() + 2 * (3 * expert + 32 * 4)
    # FLOPs: a token uses 2 of the 4 experts, so 2 experts' params and the router more
    T = 16
    assert model.flops_per_token(T) == dense.flops_per_token(T) + 6 * 2 * (expert + 32 * 4)


def test_config_checks():
    with pytest.raises(ConfigError, match="model.experts_per_token"):
        Config().replace(model={**MOE, "experts_per_token": 5})
    with pytest.raises(ConfigError, match="model.num_experts"):
        Config().replace(model=dict(family="gpt", num_experts=4))
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef"):
        Config().replace(model={**MOE, "router_aux_loss_coef": -1.0})


def test_logits_and_aux_loss_equal_transformers():
    import torch

    hf = build_hf_mixtral()
    model = build_model(Config().replace(model=MOE).model)
    params = jax.tree.map(jnp.asarray, params_from_hf(hf))
    ids = tokens()
    with torch.no_grad():
        out = hf(
            input_ids=torch.from_numpy(ids).long(),
            labels=torch.from_numpy(ids).long(),
            output_router_logits=True,
        )
    np.testing.assert_allclose(np.asarray(model.logits(params, ids)), out.logits.numpy(), atol=1e-4)
    x = model.embed(params["embed"], ids)
    _, stats = model._run_blocks(params["blocks"], x)
    aux = router_balance_loss(stats, model.config)
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    # HF's loss: the cross-entropy of the shifted labels plus coef x aux (over all T)
    logits = model.logits(params, ids)
    ce = token_loss(logits[:, :-1], jnp.asarray(ids[:, 1:]))
    np.testing.assert_allclose(float(ce + model.aux_loss(stats)), float(out.loss), rtol=1e-5)


# -- training under every runtime, the auxiliary loss on ------------------------------------

TRAIN_MOE = dict(MOE, max_seq_len=32)
SHORT = dict(steps=4, eval_batches=1)  # the validation loss is compared too
# SGD: ZeRO-3 sums gradients over devices in another order than one device does, which
# AdamW's first steps amplify beyond 1e-5 (tests/test_zero.py's docstring); SGD compares
# the gradients themselves, so one offload.mode=none reference serves every runtime.
SGD = dict(name="sgd", lr=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import tiny_config

    config = tiny_config(model=TRAIN_MOE, train=SHORT, optimizer=SGD)
    return train(config, tmp_path_factory.mktemp("ref"), verbose=False)


# Default-run representatives: test_logits_and_aux_loss_equal_transformers (in memory),
# test_stream_nvme_equals_none and test_expert_parallel_on_4_devices_equals_single_device's
# data2xexpert2 case (ZeRO-3 over 2 devices beside 2 expert shards; both share the
# reference); the others are slow (ZeRO-3 alone over 4 devices among them).


@pytest.mark.guards(tier="nvme", parallel="single")
def test_stream_nvme_equals_none(reference, tiny, tmp_path):
    """offload.mode=stream with the optimizer on NVMe, the last block kept (its vjp from
    forward) and the other swapped (its activations to host memory and back) trains as
    offload.mode=none: the aux loss and its gradients are in both (the statistics'
    cotangent through a kept block's backward and a swapped one's; a recomputed one's in
    the ZeRO-3 test and, slow, with AdamW)."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=1, swap_blocks=1)
    config = tiny(model=TRAIN_MOE, train=SHORT, optimizer=SGD, offload=offload)
    result = train(config, tmp_path, verbose=False)
    assert reference.losses[-1] < reference.losses[0]
    assert_training_equal(result, reference, build_model(config.model), check_tokens())


@pytest.mark.slow  # ~17 s; Zero3.jit's batch means: tests/test_zero.py in the default run
def test_zero3_on_4_devices_equals_single_device(reference, tiny, tmp_path):
    """ZeRO-3 over 4 devices: each device's router statistics are averaged over the
    devices before the aux loss (declared Kind.MEAN in runtime/stages/signatures.py), so it
    equals one device's on the whole micro-batch, while the gradients' per-page squared
    norms stay split over the devices as the gradients: the step's gradient norm (their
    sum) equals the reference's."""
    config = tiny(
        model=TRAIN_MOE,
        train=SHORT,
        optimizer=SGD,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=4),
    )
    result = train(config, tmp_path / "zero", verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())
    norms = [[r["grad_norm"] for r in run.records] for run in (result, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)


@pytest.mark.slow  # ~30 s on 2 cores with a cold compilation cache (its own reference)
def test_stream_nvme_equals_none_with_adamw(tiny, tmp_path):
    """As test_stream_nvme_equals_none, with AdamW (the config's optimizer): one device
    sums as offload.mode=none does, so AdamW's amplification is no concern."""
    offload = dict(mode="stream", optimizer="nvme", params="nvme", keep_blocks=1)
    none, stream = (
        train(tiny(model=TRAIN_MOE, train=SHORT, offload=o), tmp_path / o["mode"], verbose=False)
        for o in (dict(mode="none"), offload)
    )
    assert none.losses[-1] < none.losses[0]
    assert_training_equal(stream, none, build_model(tiny(model=TRAIN_MOE).model), check_tokens())


@pytest.mark.slow  # ~25 s on 2 cores with a cold compilation cache (un-jitted gradients)
def test_aux_loss_is_in_the_loss_and_gradients(tiny):
    """The training loss is the cross-entropy plus coef x the balance loss, and the
    router's gradient changes with the coefficient."""
    config = tiny(model=TRAIN_MOE)
    model = build_model(config.model)
    off = build_model(tiny(model={**TRAIN_MOE, "router_aux_loss_coef": 0.0}).model)
    params = model.init(jax.random.key(0))
    ids = tokens()
    loss = model.loss(params, ids[:, :-1], ids[:, 1:])
    x, stats = model._run_blocks(params["blocks"], model.embed(params["embed"], ids[:, :-1]))
    ce = model.head_loss(params["head"], params["embed"], x, ids[:, 1:])
    aux = router_balance_loss(stats, model.config)
    np.testing.assert_allclose(loss, ce + 0.02 * aux, rtol=1e-6)
    np.testing.assert_allclose(off.loss(params, ids[:, :-1], ids[:, 1:]), ce, rtol=1e-6)
    g_on = jax.grad(model.loss)(params, ids[:, :-1], ids[:, 1:])["blocks"]["moe"]["router"]
    g_off = jax.grad(off.loss)(params, ids[:, :-1], ids[:, 1:])["blocks"]["moe"]["router"]
    assert not np.allclose(g_on, g_off)


# -- expert parallelism (distributed.expert_parallel) -----------------------------------


def ep_config(tiny, data: int, experts: int, **model):
    """The tiny MoE's training run on ``data`` x ``experts`` devices, SGD (as the
    reference fixture's); ``model``: changes to its shape."""
    return tiny(
        model={**TRAIN_MOE, **model},
        train=SHORT,
        optimizer=SGD,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        distributed=dict(data_parallel=data, expert_parallel=experts),
    )


@pytest.mark.parametrize(
    "data,experts",
    [(2, 2), pytest.param(1, 4, marks=pytest.mark.slow)],  # ~20 s each on 2 cores
    ids=["data2xexpert2", "expert4"],
)
@pytest.mark.guards(tier="host", parallel="expert")
def test_expert_parallel_on_4_devices_equals_single_device(
    reference, tiny, tmp_path, data, experts
):
    """Experts split over the expert axis (each device holds 4 / experts of every block's
    experts and exchanges its tokens' rows by all-to-all), ZeRO-3 over the rest: losses,
    the validation loss, every final param (experts included, gathered back from their
    devices) and the gradient norms equal one device's at 1e-5 (fp32, SGD)."""
    config = ep_config(tiny, data, experts)
    result = train(config, tmp_path, verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())
    norms = [[r["grad_norm"] for r in run.records] for run in (result, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)


# Each offload feature once refused under expert parallelism (hetjax/support.py), at data x
# expert = 2 x 2
EP_FEATURES = {
    "keep": dict(keep_blocks=1),
    "swap_host": dict(swap_blocks=1),
    "swap_nvme": dict(swap_blocks=2, swap_tier="nvme"),
    "device_cache": dict(optimizer_device_stages=2),
}


@pytest.mark.slow  # ~20 s each (2 cores)
@pytest.mark.parametrize("feature", list(EP_FEATURES))
def test_formerly_refused_features_under_expert_parallelism_equal_single_device(
    reference, tiny, tmp_path, feature, monkeypatch
):
    """Kept and swapped blocks (host and NVMe) and the device cache of optimizer state
    (embed's and block 0's updates on the device) with experts split over 2 x 2
    devices: losses, the validation loss, every final param and the logits equal one
    device's at 1e-5 (fp32, SGD). A kept or swapped block's keep levels and residual
    bytes are measured on one device inside the mesh (its all-to-all needs it); read
    ahead one block, so one swapped block's residuals go through the disk each step."""
    from hetjax import memory

    monkeypatch.setattr(memory, "IO_READAHEAD", 1)
    config = ep_config(tiny, 2, 2)
    config = config.replace(offload=dict(mode="stream", **EP_FEATURES[feature]))
    result = train(config, tmp_path, verbose=False)
    assert_training_equal(result, reference, build_model(config.model), check_tokens())
    if feature == "swap_nvme":  # one device's bytes: a swapped block's input and saved
        # activations, never its pages (its dense pages went too: 141,312 B a step against
        # 43,008 before 2026-11-27's eighth session)
        one = config.replace(distributed=dict(data_parallel=1, expert_parallel=1))
        single = train(one, tmp_path / "one", verbose=False)
        for r, s in zip(result.records, single.records, strict=True):
            assert r["nvme_write_bytes"] == r["nvme_read_bytes"] == s["nvme_write_bytes"] > 0
    if feature == "device_cache":
        assert all(r["optimizer_device_params"] > 0 for r in result.records)


def test_expert_slab_shares_hold_their_devices_experts(tiny):
    """A block's slab under expert parallelism (2 x 2 devices): device (s, g)'s share
    holds a share of its group g's experts (experts 2g, 2g + 1) and no other's; the
    gather gives each device the dense params whole and its group's experts whole,
    and none of the other group's; flatten / unflatten round-trip the block exactly."""
    from hetjax.parallel.grouped import GroupedSlabLayout
    from hetjax.parallel.groupings import ExpertGrouping
    from hetjax.parallel.zero import Zero3

    config = ep_config(tiny, 2, 2)
    zero = Zero3(config)
    model = build_model(config.model)
    layout = zero.stage_layouts(model, config.memory.page_size)["block"]
    assert isinstance(layout, GroupedSlabLayout) and (layout.groups, layout.shares) == (2, 2)
    assert [type(p.grouping) for p in layout.parts] == [ExpertGrouping]
    block = jax.tree.map(np.asarray, model.init_stage("block", jax.random.key(0)))
    E = config.model.num_experts
    for name in ("gate_proj", "up_proj", "down_proj"):  # expert e's entries all e + 1
        shape = block["moe"][name].shape
        block["moe"][name] = np.broadcast_to(np.arange(1, E + 1.0)[:, None, None], shape).copy()
    slab = layout.flatten_np(block)
    jax.tree.map(np.testing.assert_array_equal, layout.unflatten(slab), block)
    P = layout.page_elems
    shares = slab.reshape(layout.devices, layout.share * P)
    for n, share in enumerate(shares):
        g = n % layout.groups  # the mesh is (data, expert): device n = (n // 2, n % 2)
        experts = set(np.unique(share[: layout.group_share * P])) - {0.0}
        assert experts and experts <= {2.0 * g + 1, 2.0 * g + 2}, (n, experts)
    host = jax.device_put(slab.reshape(-1, P), zero.sharded.slab_host)
    pages = zero.to_device(host, layout)
    for shard in pages.group.addressable_shards:
        g = int(np.argwhere(zero.mesh.devices == shard.device)[0][1])
        assert shard.data.shape == (layout.group.num_pages, P)  # one group's pages
        mine = layout.group.unflatten(np.asarray(shard.data).reshape(-1))
        for name, value in mine["moe"].items():
            np.testing.assert_array_equal(value, block["moe"][name][2 * g : 2 * g + 2])
    dense = np.concatenate([np.asarray(p) for p in pages.dense])
    rest = layout.dense.unflatten(dense[layout.dense.padded_size - layout.dense.size :])
    np.testing.assert_array_equal(rest["q_proj"]["kernel"], block["q_proj"]["kernel"])
    np.testing.assert_array_equal(rest["moe"]["router"], block["moe"]["router"])


def test_planner_counts_a_devices_share_of_the_experts(tiny):
    """The planner's per-device block (what the device window holds) is the dense params
    and 1/expert_parallel of the experts, padded to whole pages; what each device stores
    and updates is 1/devices of the whole block either way."""
    from hetjax.planning.workload import Workload, memory_sizes

    config = ep_config(tiny, 1, 4)
    dense_config = ep_config(tiny, 4, 1)
    model = build_model(config.model)
    shapes = jax.eval_shape(lambda key: model.init_stage("block", key), jax.random.key(0))
    count = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
    experts = count({k: shapes["moe"][k] for k in ("gate_proj", "up_proj", "down_proj")})
    whole = count(shapes)
    sizes = memory_sizes(Workload.from_config(config, devices=4), 4)
    zero3 = memory_sizes(Workload.from_config(dense_config, devices=4), 4)
    page = 16 * 1024 // 4
    assert whole - experts + experts // 4 <= sizes.block < whole - experts + experts // 4 + 8 * page
    assert zero3.block >= whole > sizes.block
    assert 4 * sizes.own_block >= whole and 4 * zero3.own_block >= whole


@pytest.mark.slow  # ~12 s (the default run's time, 2026-11-27)
def test_mixtral_8x7b_plans_with_its_experts_over_8_devices():
    """``--plan`` of configs/mixtral_8x7b.py with expert_parallel=8 on an 8-GPU profile:
    a device computes with a block of its one expert and the dense params (under a
    sixth of the whole block), stores 1/8 of every whole block as ZeRO-3 does, and the
    all-to-alls enter the collectives lane; a 1-GPU profile is refused naming the key."""
    from hetjax.config import load_config
    from hetjax.planning.hardware import get_profile
    from hetjax.planning.search import make_plan
    from hetjax.planning.workload import Workload

    dist = {"distributed.data_parallel": "0", "offload.mode": "stream"}
    experts = load_config("mixtral_8x7b", {**dist, "distributed.expert_parallel": "8"})
    zero3 = load_config("mixtral_8x7b", dist)
    w8, w1 = (Workload.from_config(c, devices=8) for c in (experts, zero3))
    assert w8.block_params < w1.block_params / 6
    # every param stored, padded to whole pages twice a block (the dense part, a group)
    assert w1.params <= w8.params < 1.01 * w1.params
    assert w8.exchange_bytes > 0 == w1.exchange_bytes
    plans = [make_plan(c, get_profile("angel-a100-40g")) for c in (experts, zero3)]
    assert all(p.lanes["collectives"] > 0 for p in plans)
    with pytest.raises(ConfigError, match="'distributed.expert_parallel' .8. must divide"):
        make_plan(experts, get_profile("a100-80g"))


def test_bad_expert_parallel_settings_are_named(tiny):
    from hetjax.parallel.zero import Zero3

    with pytest.raises(ConfigError, match="'distributed.expert_parallel' .3. must divide"):
        ep_config(tiny, 1, 3)  # 4 experts
    with pytest.raises(ConfigError, match="'distributed.expert_parallel'.*has none"):
        tiny(offload=dict(mode="stream"), distributed=dict(expert_parallel=2))  # a GPT
    with pytest.raises(ConfigError, match="'train.batch_size'.*expert_parallel=4 devices"):
        ep_config(tiny, 2, 4)  # 4 rows over 8 devices
    # the device count is known when the mesh is made: 8 virtual devices here
    every = dict(data_parallel=0, expert_parallel=3)
    config = tiny(model={**TRAIN_MOE, "num_experts": 6}, offload=dict(mode="stream"))
    with pytest.raises(ConfigError, match="'distributed.expert_parallel' .3. must divide the dev"):
        Zero3(config.replace(distributed=every))
    with pytest.raises(ConfigError, match="'train.batch_size' .4.*the mesh's 8 devices"):
        Zero3(config.replace(distributed=dict(data_parallel=0, expert_parallel=2)))
    # The norm scales (not weight-decayed) must end the slab, in the last device's share
    # of the dense pages: 2 D of them, against a share of at least a page and 1/N of
    # the dense params (4 D^2 and more), so only some thousand devices cut them: 4096
    # devices (shapes alone), 1024-element pages, d 1024.
    from hetjax.parallel.layouts import stage_layouts

    wide = build_model(tiny(model={**TRAIN_MOE, "d_model": 1024, "d_ff": 16}).model)
    with pytest.raises(ConfigError, match="'memory.page_size': a stage's 2048 norm-scale"):
        stage_layouts(wide, 4096, page_multiple=4096, expert_parallel=2)


@pytest.mark.slow  # ~25 s: two runtimes built and stepped on 4 devices
def test_expert_parallel_runtime_holds_a_devices_share_of_the_experts(tiny):
    """The runtime's slab sizes are the planner's (one memory model: the block a device
    computes with has its share of the experts, the one it stores every expert), and what the
    device really held in a step (the ledger: the window's slabs, gradients in flight)
    is less with the experts split over 2 devices than with ZeRO-3 over 4, whose
    window gathers every expert."""
    from hetjax.data import make_datasets
    from hetjax.parallel.zero import Zero3
    from hetjax.planning.workload import Workload, memory_sizes
    from hetjax.runtime.streaming import StreamingRuntime

    peak, blocks = {}, {}
    for data, experts in ((2, 2), (4, 1)):
        # experts 4 x wider than the tiny MoE's: in its pages padding hides the saving
        config = ep_config(tiny, data, experts, d_ff=192)
        runtime = StreamingRuntime(config, parallel=Zero3(config))
        planned = memory_sizes(Workload.from_config(config, devices=4), 4)
        fields = ("embed", "block", "head")
        assert [getattr(planned, f) for f in fields] == [getattr(runtime.sizes, f) for f in fields]
        # the planner's process holds one device's shares, this one all 4 devices'
        assert 4 * planned.own_block == runtime.sizes.own_block
        data_batch, _, _ = make_datasets(config)
        runtime.train_step(data_batch.batch(0).reshape(1, 4, -1))
        peak[experts], blocks[experts] = runtime.ledger.peak["device"], runtime.sizes.block
        runtime.close()
    assert blocks[2] < blocks[1]
    assert peak[2] < peak[1], peak


@pytest.mark.slow  # ~10 s
def test_expert_parallel_steps_have_no_implicit_transfers(tiny):
    """Under ``jax.transfer_guard("disallow")`` an expert-parallel step (2 x 2 devices)
    copies nothing implicitly: its block pages' gather and its all-to-alls stay on the
    devices, its batches and scalars are put explicitly (as ZeRO-3's,
    tests/test_two_client.py)."""
    from equivalence import training_batches

    from hetjax.train import build_runtime

    config = ep_config(tiny, 2, 2)
    runtime = build_runtime(config)
    try:
        batches = training_batches(config, 2)
        runtime.train_step(batches[0])
        with jax.transfer_guard("disallow"):
            assert np.isfinite(runtime.train_step(batches[1]).loss)
    finally:
        runtime.close()


@pytest.mark.slow  # ~45 s: five short runs
def test_expert_parallel_checkpoint_restores_into_any_placement(tiny, tmp_path):
    """A checkpoint of an expert-parallel run (its block slabs laid out by device)
    resumes in the same placement reading its pages as they are, and in another
    expert_parallel, or on one device in memory, from the params reassembled from its
    pieces: each ends where the uninterrupted run does."""
    import shutil

    def run(steps, workdir, data=2, experts=2, offload="stream"):
        config = ep_config(tiny, data, experts).replace(
            train=dict(steps=steps),
            offload=dict(mode=offload),
            checkpoint=dict(every_steps=2, at_end=False),
        )
        return train(config, tmp_path / workdir, verbose=False)

    straight = run(4, "straight")
    run(2, "saved")
    legs = [("same", 2, 2, "stream"), ("expert4", 1, 4, "stream"), ("memory", 1, 1, "none")]
    for workdir, data, experts, offload in legs:
        shutil.copytree(tmp_path / "saved" / "checkpoints", tmp_path / workdir / "checkpoints")
        resumed = run(4, workdir, data, experts, offload)
        np.testing.assert_allclose(resumed.losses, straight.losses[2:], rtol=1e-5)
        assert_trees_close(resumed.params, straight.params)


@pytest.mark.slow  # two child processes compile everything anew (~60 s on 2 cores)
def test_expert_parallel_across_two_processes_equals_single_device(reference, tmp_path):
    """2 processes x 2 CPU devices over gloo, the experts split over all 4 (each
    all-to-all crosses the processes): losses, validation loss and final params equal
    one device's."""
    from test_zero import _params_like, _run_two_processes

    model = [f"model.{k}={v}" for k, v in TRAIN_MOE.items()]
    saved = _run_two_processes(
        tmp_path,
        *model,
        "train.steps=4",
        "train.eval_batches=1",
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "distributed.expert_parallel=4",
    )
    np.testing.assert_allclose(saved["losses"], reference.losses, rtol=1e-5)
    np.testing.assert_allclose(saved["val_loss"], reference.val_loss, rtol=1e-5)
    assert_trees_close(_params_like(saved, reference.params), reference.params)
