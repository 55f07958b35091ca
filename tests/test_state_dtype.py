"""Moments in fewer bytes (``optimizer.state_dtype``, hetjax/optimizer/moments.py and
state_format.py): each format's update against a numpy reference written here from the
documented definition (never calling the code under test), in every tier and runtime;
checkpoints per dtype and across dtypes; the planner's bytes against the runtime's."""

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import require

from hetjax.config import OptimizerConfig
from hetjax.optimizer import moments, native
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.parallel.single import Shardings
from hetjax.state_format import state_format
from hetjax.storage.pages import Leaf, SlabLayout, aligned_concatenate

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
N = 3 * 8192  # three chunks of two pages each (CHUNK_ELEMS patched below)
PAGE = 4096
DECAYED = 8192 + 1000  # decay ends inside the second chunk, inside a page


@pytest.fixture
def compiler():
    require(
        native._compiler() is not None,
        "a C++ compiler for the native Adam kernel: apt-get install g++ (or set CXX)",
    )


# -- references (numpy, from the definitions in moments.py's docstring) -------------------


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by integer arithmetic on the
    bits (not ml_dtypes, not XLA), widened back to float32."""
    bits = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (rounded.astype(np.uint32) << 16).view(F32)


def _bf16_ordinal(x: np.ndarray) -> np.ndarray:
    """bfloat16 values (held as float32) as integers that count ulps: adjacent values
    differ by 1, across zero too."""
    bits = (np.asarray(x, F32).view(np.uint32) >> 16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def reference_adam(name, cfg, master, grads, scales, lrs, round_moment):
    """AdamW (optax's formulas, each operation rounded to float32 as written) over
    ``grads`` clipped by ``scales`` at learning rates ``lrs``; the moments are rounded by
    ``round_moment`` after each step and read back as float32; the update uses the
    unrounded new moments (the kernel's one pass)."""
    b1, b2, eps = F32(cfg.b1), F32(cfg.b2), F32(cfg.eps)
    p, mu, nu = master.copy(), np.zeros(N, F32), np.zeros(N, F32)
    for t, (grad, scale, lr) in enumerate(zip(grads, scales, lrs, strict=True), start=1):
        g = np.asarray(grad)[:N] * F32(scale)
        m = F32(1 - cfg.b1) * g + b1 * mu
        v = F32(1 - cfg.b2) * (g * g) + b2 * nu
        bc1, bc2 = F32(1) - b1 ** F32(t), F32(1) - b2 ** F32(t)
        u = (m / bc1) / (np.sqrt(v / bc2 + F32(0)) + eps)
        if name == "adamw":
            u[:DECAYED] = u[:DECAYED] + F32(cfg.weight_decay) * p[:DECAYED]
        p = p + F32(-lr) * u
        mu, nu = round_moment(m), round_moment(v)
    return {"master": p, "mu": mu, "nu": nu}


def _layout():
    return SlabLayout(
        leaves=(Leaf(("w",), (N,), 0, N),),
        treedef=None,
        tree_order=(0,),
        num_decay=DECAYED,
        size=N,
        page_elems=PAGE,
    )


def _run_slab(opt, master, grads, clips, in_place):
    state = opt.init("s", master)
    for grad, clip in zip(grads, clips, strict=True):
        slabs, scalars, _ = opt.update("s", *state, grad, clip, in_place=in_place)
        state = (slabs, scalars)
    return {k: np.concatenate([np.asarray(c) for c in v]) for k, v in state[0].items()}


@pytest.mark.parametrize("kernel", ["native", "optax"])
@pytest.mark.parametrize("in_place", [False, True], ids=["xla-buffers", "host-buffers"])
@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_bf16_moments_update_equals_the_numpy_reference(
    compiler, monkeypatch, kernel, in_place, name
):
    """Four steps with bfloat16 moments, the second clipped: mu and nu equal the
    reference's (float32 update, round to nearest even) bit for bit with the native
    kernel, through XLA's buffers (the jitted FFI call: state in RAM) and in place on
    host buffers (the NVMe tier's I/O buffers); the master agrees to float32 rounding
    (the reference's bias corrections and learning rate are numpy's, not XLA's). optax's
    jitted path widens, updates and rounds the same way: there XLA fuses one product of
    each moment's sum into an FMA, so its moments agree to one bfloat16 rounding."""
    import hetjax.optimizer.slab

    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 2 * PAGE)
    cfg = OptimizerConfig(
        name=name, lr=1e-2, warmup_steps=2, host_kernel=kernel, state_dtype="bfloat16"
    )
    host = Shardings.single_device().optimizer
    opt = SlabOptimizer(cfg, 10, {"s": _layout()}, host, "bfloat16")
    assert opt.native == (kernel == "native")
    rng = np.random.default_rng(1)
    master = rng.normal(size=N).astype(F32)
    grads = [aligned_concatenate([rng.normal(size=N).astype(F32)]) for _ in range(4)]
    clips = [(8.0, 0.0), (8.0, 2.0), (8.0, 0.0), (8.0, 0.0)]
    lrs = [1e-2 * 1 / 2, 1e-2]  # warmup: lr * (n + 1) / warmup, then cosine over 10 steps
    lrs += [1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + np.cos(np.pi * (n - 2) / 8)) for n in (2, 3)]
    want = reference_adam(name, cfg, master, grads, [1, 0.25, 1, 1], lrs, bf16_round)
    got = _run_slab(opt, master, grads, clips, in_place)
    assert got["mu"].dtype == got["nu"].dtype == BF16 and got["master"].dtype == F32
    for kind in ("mu", "nu"):
        widened = got[kind].astype(F32)
        if kernel == "native":
            np.testing.assert_array_equal(widened, want[kind], err_msg=kind)
        else:  # at most one bfloat16 ulp apart (an FMA's rounding moves the tie point)
            ulps = np.abs(_bf16_ordinal(widened) - _bf16_ordinal(want[kind]))
            assert ulps.max() <= 1, (kind, ulps.max())
    np.testing.assert_allclose(got["master"], want["master"], rtol=2e-6, atol=1e-7)
    assert not np.array_equal(got["master"], master)


# -- the runtimes ----------------------------------------------------------------------------

CLIP = dict(grad_clip=2.0)  # binds in some of the tiny runs' steps, not all (test_offload.py)


# 5 s (30 s with the shared cores loaded: three tiny runs)
@pytest.mark.slow
def test_stream_with_bf16_moments_on_nvme_equals_state_in_ram(tiny, tmp_path):
    """bfloat16 moments, optimizer state on NVMe (the native kernel in place on the I/O
    buffers, ``native.host_update``) and in host RAM (the kernel through XLA's buffers,
    the FFI call): the same kernel on the same operands, so the same training bit for
    bit (each entry point equals the numpy reference above); the NVMe tier's files hold
    bfloat16 moments, 4 + 2 + 2 bytes a parameter a copy. Against the in-memory
    runtime (optax's update, widened and rounded) the runs differ by bfloat16 roundings
    that an FMA moves (see the optax case above), so only the losses are compared,
    to a tolerance of their own: that bound is this test's measurement, not an
    equivalence."""
    from hetjax.train import train
    from models import build_model

    optimizer = dict(state_dtype="bfloat16", **CLIP)
    runs = {}
    for tier in ("nvme", "host"):
        config = tiny(
            optimizer=optimizer,
            offload=dict(mode="stream", optimizer=tier),
            memory=dict(page_size="16KiB"),
        )
        runs[tier] = train(config, tmp_path / tier, verbose=False)
    nvme, host = runs["nvme"], runs["host"]
    assert nvme.losses == host.losses and nvme.val_loss == host.val_loss
    jax.tree.map(np.testing.assert_array_equal, nvme.params, host.params)
    root = tmp_path / "nvme" / "nvme" / "optimizer"
    for kind, dtype in (("master", "float32"), ("mu", "bfloat16"), ("nu", "bfloat16")):
        meta = json.loads((root / "gen1" / kind / "zarr.json").read_text())
        assert meta["data_type"] == dtype, (kind, meta["data_type"])
    params = build_model(config.model).param_count()
    nvme_bytes = nvme.records[-1]["nvme_bytes"]
    assert 2 * 8 * params <= nvme_bytes < 2 * 8 * params * 1.5  # whole pages: padding
    assert nvme.records[-1]["nvme_read_bytes"] > 0
    ref = train(tiny(optimizer=optimizer), tmp_path / "ref", verbose=False)
    np.testing.assert_allclose(nvme.losses, ref.losses, rtol=1e-4)


# 8 s (40 s with the shared cores loaded: four tiny runs)
@pytest.mark.slow
def test_stream_with_int8_moments_on_nvme_equals_state_in_ram(tiny, tmp_path):
    """int8 moments, optimizer state on NVMe (the native kernel in place on the I/O
    buffers: codes in the tier's page files, scales in files of their own,
    ``storage/scales.py``), with two copies and with one written in place
    (``optimizer.speculation=never``), and in host RAM (the kernel through XLA's
    buffers): the same kernel on the same operands, so the same training bit for bit.
    The files hold int8 codes (read and written with O_DIRECT) and float32 scales, 4 +
    1 + 1 bytes a parameter and a scale per 2048 of each moment, per copy."""
    from hetjax.runtime.streaming import StreamingRuntime
    from hetjax.train import train

    def config(tier, **optimizer):
        return tiny(
            optimizer=dict(state_dtype="int8", **CLIP, **optimizer),
            offload=dict(mode="stream", optimizer=tier),
            memory=dict(page_size="16KiB", nvme_copies=2 if tier == "nvme" else 0),
        )

    runs = {
        "nvme": train(config("nvme"), tmp_path / "nvme", verbose=False),
        "host": train(config("host"), tmp_path / "host", verbose=False),
    }
    in_place = config("nvme", speculation="never").replace(memory=dict(nvme_copies=1))
    runs["in place"] = train(in_place, tmp_path / "in-place", verbose=False)
    host = runs["host"]
    for name in ("nvme", "in place"):
        run = runs[name]
        assert run.losses == host.losses and run.val_loss == host.val_loss, name
        jax.tree.map(np.testing.assert_array_equal, run.params, host.params)
        assert run.records[-1]["nvme_read_bytes"] > 0
    root = tmp_path / "nvme" / "nvme"
    kinds = (("optimizer", "master", "float32"), ("optimizer", "mu", "int8"))
    kinds += (("optimizer", "nu", "int8"), ("optimizer_scales", "mu", "float32"))
    kinds += (("optimizer_scales", "nu", "float32"),)
    for store, kind, dtype in kinds:
        meta = json.loads((root / store / "gen1" / kind / "zarr.json").read_text())
        assert meta["data_type"] == dtype, (store, kind, meta["data_type"])
    assert not (tmp_path / "in-place" / "nvme" / "optimizer" / "gen1").exists()
    # the bytes: those of the stages' pages, counted by hand (no stage is cached)
    runtime = StreamingRuntime(config("nvme"), workdir=tmp_path / "bytes")
    try:
        states, s = runtime.states, runtime.sizes
        assert not states.cached and states.codes.disk[0].links  # O_DIRECT pages
        elems = sum(s.own(n) for n in s.stages())
        scales = 2 * 4 * -(-elems // 2048)  # each page whole blocks: 16 KiB pages
        assert runtime.optimizer.layouts["block"].page_elems % 2048 == 0
        assert states.nvme_bytes == 2 * (6 * elems + scales)  # two copies
    finally:
        runtime.close()


# -- int8 blocks ------------------------------------------------------------------------------


def ref_code(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The code's magnitudes (index 0: zero) and the midpoints between neighbours, from
    the definition: 2**((k - top) / 8) for k in 1..top, top 127 signed, 255 unsigned."""
    top = 127 if signed else 255
    magnitudes = [0.0] + [2.0 ** ((k - top) / 8) for k in range(1, top + 1)]
    mids = [(a + b) / 2 for a, b in zip(magnitudes[:-1], magnitudes[1:], strict=True)]
    return np.array(magnitudes, F32), np.array(mids, F32)


def ref_quantize(x: np.ndarray, signed: bool, block: int = 2048):
    """Codes (int32: the signed index, or the unsigned byte) and scales of ``x``: blocks
    of the flattened ``x``; the nearest code to |x| / absmax (ties to the smaller); a
    positive unsigned value never code 0."""
    _, mids = ref_code(signed)
    flat = np.asarray(x, F32).reshape(-1)
    codes, scales = np.zeros(flat.size, np.int32), []
    for start in range(0, flat.size, block):
        part = flat[start : start + block]
        scale = np.abs(part).max()
        scales.append(scale)
        y = np.abs(part) / (scale if scale > 0 else F32(1))
        k = np.array([int((mids < v).sum()) for v in y])  # midpoints below: brute force
        if signed:
            k = np.where(part < 0, -k, k)
        else:
            k = np.where(y > 0, np.maximum(k, 1), 0)
        codes[start : start + block] = k
    return codes.reshape(np.shape(x)), np.array(scales, F32)


def ref_dequantize(codes: np.ndarray, scales: np.ndarray, signed: bool, block: int = 2048):
    magnitudes, _ = ref_code(signed)
    flat = codes.reshape(-1)
    values = np.sign(flat) * magnitudes[np.abs(flat)] if signed else magnitudes[flat]
    return (values.astype(F32) * np.repeat(scales, block)[: flat.size]).reshape(codes.shape)


def _codes(q) -> np.ndarray:
    """An Int8Blocks' codes as the reference's integers (an unsigned moment's as bytes)."""
    return np.asarray(q.codes).astype(np.int32)


@pytest.mark.parametrize("signed", [True, False], ids=["mu", "nu"])
def test_int8_blocks_equal_the_numpy_reference(signed):
    """Quantization of values over 30 octaves, zeros, a block of zeros and a partial last
    block: codes and scales equal the reference's exactly; dequantization too."""
    rng = np.random.default_rng(3)
    n = 3 * 2048 + 700
    x = rng.standard_normal(n).astype(F32) * np.exp2(rng.uniform(-30, 3, n)).astype(F32)
    x[2048:4096] = 0  # a block of zeros: scale 0
    x[:7] = 0
    x[7] = np.float32(1e-30)  # far below the smallest code: 0 (signed) or code 1
    x[8] = np.float32(300.0)  # the block's maximum
    if not signed:
        x = np.abs(x)
    q = jax.jit(lambda a: moments.quantize(a, signed))(x)
    codes = _codes(q) if signed else _codes(q) & 0xFF
    want_codes, want_scales = ref_quantize(x, signed)
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
    np.testing.assert_array_equal(codes, want_codes)
    assert want_scales[1] == 0 and codes[7] == (0 if signed else 1)
    got = jax.jit(lambda c: moments.dequantize(c, signed))(q)
    np.testing.assert_array_equal(np.asarray(got), ref_dequantize(want_codes, want_scales, signed))
    # the code's worst relative error: half a step of 2**(1/8) (4.4 %), where not floored
    big = np.abs(x) > want_scales.repeat(2048)[:n] * 2**-15
    err = np.abs(np.asarray(got) - x)[big] / np.abs(x)[big]
    assert err.max() <= (2 ** (1 / 8) - 1) / 2 * 1.0001


def test_int8_moments_update_equals_the_numpy_reference():
    """Adam with int8 moments (``moments.low_precision``, what the in-memory runtime
    runs) over four steps on a leaf of three blocks and a partial one, each step against
    the numpy reference of the same quantized update from the same state (dequantize,
    optax's formulas in float32, quantize): scales agree to float32 rounding, codes are
    equal but where XLA's FMA moves a moment across a midpoint (one code step, at most 1
    in 1000 of them), the params to float32 rounding."""
    import optax

    from hetjax.state_format import moment_format

    n, lr = 3 * 2048 + 500, 1e-2
    b1, b2, eps = F32(0.9), F32(0.95), F32(1e-8)
    tx = moments.low_precision(optax.adam(lr, 0.9, 0.95, 1e-8), moment_format("int8"))
    rng = np.random.default_rng(5)
    p = rng.normal(size=n).astype(F32)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for t in range(1, 5):
        g = rng.normal(size=n).astype(F32) * F32(10.0 ** -(t % 3))
        adam = state[0]  # ScaleByAdamState(count, mu, nu), mu and nu Int8Blocks
        mu = ref_dequantize(_codes(adam.mu), np.asarray(adam.mu.scales), True)
        nu = ref_dequantize(_codes(adam.nu) & 0xFF, np.asarray(adam.nu.scales), False)
        m = F32(1 - 0.9) * g + b1 * mu
        v = F32(1 - 0.95) * (g * g) + b2 * nu
        want_p = p + F32(-lr) * (
            (m / (F32(1) - b1 ** F32(t))) / (np.sqrt(v / (F32(1) - b2 ** F32(t))) + eps)
        )
        updates, state = update(g, state, p)
        p = np.asarray(optax.apply_updates(p, updates))
        adam = state[0]
        for got, want, signed in ((adam.mu, m, True), (adam.nu, v, False)):
            codes = _codes(got) if signed else _codes(got) & 0xFF
            want_codes, want_scales = ref_quantize(want, signed)
            np.testing.assert_allclose(np.asarray(got.scales), want_scales, rtol=2e-7)
            moved = codes != want_codes
            assert moved.mean() <= 1e-3 and np.abs(codes - want_codes).max() <= 1, (t, signed)
        np.testing.assert_allclose(p, want_p, rtol=2e-6, atol=1e-7)
        assert adam.mu.codes.dtype == adam.nu.codes.dtype == np.int8
        assert adam.mu.scales.shape == adam.nu.scales.shape == (4,)


def test_int8_moments_in_host_ram_update_equals_the_numpy_reference(monkeypatch):
    """The host optimizer with int8 moments (state in host or device memory: optax's
    jitted update on chunks, each chunk its own blocks) over three steps, the second
    clipped, on a slab of three chunks with weight decay ending inside one: each step
    against the numpy reference of the quantized update from the same state, chunk by
    chunk (as ``test_int8_moments_update_equals_the_numpy_reference``)."""
    import hetjax.optimizer.slab

    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 2 * PAGE)
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=2, state_dtype="int8", host_kernel="optax")
    opt = SlabOptimizer(cfg, 10, {"s": _layout()}, Shardings.single_device().optimizer, "float32")
    assert not opt.native  # optax's jitted path (the native kernel's: the test below)
    rng = np.random.default_rng(2)
    p = rng.normal(size=N).astype(F32)
    slabs, scalars = opt.init("s", p)
    assert [c.scales.shape for c in slabs["mu"]] == [(4,)] * 3  # 2 pages = 4 blocks a chunk
    b1, b2, eps, wd = F32(0.9), F32(0.95), F32(cfg.eps), F32(cfg.weight_decay)
    lrs = [1e-2 / 2, 1e-2, 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + np.cos(np.pi * 0 / 8))]
    for t, (scale, lr) in enumerate(zip([1.0, 0.25, 1.0], lrs, strict=True), start=1):
        g = rng.normal(size=N).astype(F32)
        mu = np.concatenate(
            [ref_dequantize(_codes(c), np.asarray(c.scales), True) for c in slabs["mu"]]
        )
        nu = np.concatenate(
            [ref_dequantize(_codes(c) & 0xFF, np.asarray(c.scales), False) for c in slabs["nu"]]
        )
        gs = g * F32(scale)
        m = F32(1 - 0.9) * gs + b1 * mu
        v = F32(1 - 0.95) * (gs * gs) + b2 * nu
        u = (m / (F32(1) - b1 ** F32(t))) / (np.sqrt(v / (F32(1) - b2 ** F32(t))) + eps)
        u[:DECAYED] = u[:DECAYED] + wd * p[:DECAYED]
        want_p = p + F32(-lr) * u
        clip = (8.0, 2.0) if scale != 1.0 else (8.0, 0.0)
        slabs, scalars, _ = opt.update("s", slabs, scalars, aligned_concatenate([g]), clip)
        for kind, want, signed in (("mu", m, True), ("nu", v, False)):
            for (a, b), chunk in zip(opt.chunk_bounds("s"), slabs[kind], strict=True):
                codes = _codes(chunk) if signed else _codes(chunk) & 0xFF
                want_codes, want_scales = ref_quantize(want[a:b], signed)
                np.testing.assert_allclose(np.asarray(chunk.scales), want_scales, rtol=2e-7)
                moved = codes != want_codes
                assert moved.mean() <= 1e-3 and np.abs(codes - want_codes).max() <= 1
        p = np.concatenate([np.asarray(c) for c in slabs["master"]])
        np.testing.assert_allclose(p, want_p, rtol=2e-6, atol=1e-7)


INT8_PAGE = 3072  # a block and a half: each page ends in a short block of its own


def ref_quantize_pages(x: np.ndarray, signed: bool, page: int):
    """``ref_quantize`` page by page (blocks restart at each page), concatenated."""
    parts = [ref_quantize(x[a : a + page], signed) for a in range(0, x.size, page)]
    return np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts])


def ref_dequantize_pages(codes: np.ndarray, scales: np.ndarray, signed: bool, page: int):
    per = -(-page // 2048)
    return np.concatenate(
        [
            ref_dequantize(codes[a : a + page], scales[j * per : (j + 1) * per], signed)
            for j, a in enumerate(range(0, codes.size, page))
        ]
    )


@pytest.mark.parametrize("entry", ["xla-buffers", "host-buffers"])
def test_int8_native_kernel_equals_the_numpy_reference_bit_for_bit(compiler, monkeypatch, entry):
    """The native kernel with int8 moments (dequantize, update, requantize in one pass)
    over three AdamW steps, the second clipped, on pages of 3072 elements (each page's
    blocks: one whole, one short) with decay ending inside a page: through XLA (the
    jitted FFI call on chunks of two pages: state in RAM) and on host buffers in place
    (``update_host``: the NVMe tier's I/O buffers). Each step against the numpy
    reference of the same quantized update from the same state (dequantize page by
    page, optax's formulas op by op in float32, quantize page by page): codes and scales
    equal bit for bit, the master to float32 rounding (numpy's bias corrections)."""
    import hetjax.optimizer.slab

    P = INT8_PAGE
    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 2 * P)
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=2, state_dtype="int8", host_kernel="native")
    layout = dataclasses.replace(_layout(), page_elems=P)
    opt = SlabOptimizer(cfg, 10, {"s": layout}, Shardings.single_device().optimizer, "float32")
    assert opt.native
    rng = np.random.default_rng(7)
    p = rng.normal(size=N).astype(F32)
    slabs, scalars = opt.init("s", p)
    if entry == "host-buffers":  # one writable numpy buffer a kind (codes, scales)
        whole = lambda cs: np.concatenate([np.asarray(c) for c in cs])
        slabs = {
            "master": whole(slabs["master"]),
            **{
                k: moments.Int8Blocks(
                    whole([c.codes for c in slabs[k]]), whole([c.scales for c in slabs[k]])
                )
                for k in ("mu", "nu")
            },
        }
    flat = lambda kind: (
        slabs[kind]
        if isinstance(slabs[kind], moments.Int8Blocks)
        else moments.Int8Blocks(
            np.concatenate([np.asarray(c.codes) for c in slabs[kind]]),
            np.concatenate([np.asarray(c.scales) for c in slabs[kind]]),
        )
    )
    b1, b2, eps, wd = F32(0.9), F32(0.95), F32(cfg.eps), F32(cfg.weight_decay)
    lrs = [1e-2 / 2, 1e-2, 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + np.cos(np.pi * 0 / 8))]
    for t, (scale, lr) in enumerate(zip([1.0, 0.25, 1.0], lrs, strict=True), start=1):
        g = rng.normal(size=N).astype(F32) * F32(10.0 ** -(t % 3))
        g[t::97] *= F32(1e-7)  # nu far below its block's smallest code: code 1, never 0
        mu, nu = flat("mu"), flat("nu")
        mu = ref_dequantize_pages(
            np.asarray(mu.codes).astype(np.int32), np.asarray(mu.scales), True, P
        )
        nu = ref_dequantize_pages(
            np.asarray(nu.codes).astype(np.int32) & 0xFF, np.asarray(nu.scales), False, P
        )
        gs = g * F32(scale)
        m = F32(1 - 0.9) * gs + b1 * mu
        v = F32(1 - 0.95) * (gs * gs) + b2 * nu
        u = (m / (F32(1) - b1 ** F32(t))) / (np.sqrt(v / (F32(1) - b2 ** F32(t))) + eps)
        u[:DECAYED] = u[:DECAYED] + wd * p[:DECAYED]
        want_p = p + F32(-lr) * u
        clip = (8.0, 2.0) if scale != 1.0 else (8.0, 0.0)
        grad = aligned_concatenate([g])
        if entry == "host-buffers":
            slabs, scalars, _ = opt.update_host("s", slabs, scalars, grad, clip)
        else:
            slabs, scalars, _ = opt.update("s", slabs, scalars, grad, clip)
        for kind, want, signed in (("mu", m, True), ("nu", v, False)):
            got = flat(kind)
            codes = np.asarray(got.codes).astype(np.int32)
            codes = codes if signed else codes & 0xFF
            if t == 1:  # from zero moments: the tiny ones at the floor (0; nu's 1)
                assert (codes[t::97] == (0 if signed else 1)).all(), kind
            want_codes, want_scales = ref_quantize_pages(want, signed, P)
            assert np.asarray(got.scales).shape == (N // P * 2,)
            np.testing.assert_array_equal(np.asarray(got.scales), want_scales, err_msg=kind)
            np.testing.assert_array_equal(codes, want_codes, err_msg=kind)
        p = np.asarray(
            slabs["master"]
            if entry == "host-buffers"
            else np.concatenate([np.asarray(c) for c in slabs["master"]])
        )
        np.testing.assert_allclose(p, want_p, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", ["native", "optax"])
def test_int8_shards_update_as_one_device_bit_for_bit(compiler, monkeypatch, kernel):
    """ZeRO-3's split of int8 moments (each device's optimizer updates its own page
    range: ``SlabLayout.shard``): a slab of 8 pages of 3072 elements (a block and a
    half: each page ends in a short block) updated three AdamW steps whole, as one
    device's, and as two shards of 4 pages, with chunks of 3 pages (one device's chunks
    start at pages 0, 3, 6; the shards' at 0, 3 and 4, 7): the shards' codes, scales and
    master, side by side, equal the one device's bit for bit, the blocks being each
    page's wherever the chunks and shards start."""
    import hetjax.optimizer.slab

    P = INT8_PAGE
    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 3 * P)
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=2, state_dtype="int8", host_kernel=kernel)
    whole = dataclasses.replace(_layout(), page_elems=P)
    layouts = {"one": whole, "s0": whole.shard(0, 4), "s1": whole.shard(4, 4)}
    opt = SlabOptimizer(cfg, 10, layouts, Shardings.single_device().optimizer, "float32")
    assert opt.native == (kernel == "native")
    assert [a for a, _ in opt.chunk_bounds("one")] == [0, 3 * P, 6 * P]
    rng = np.random.default_rng(11)
    p = rng.normal(size=N).astype(F32)
    half = N // 2
    state = {"one": opt.init("one", p), "s0": opt.init("s0", p[:half])}
    state["s1"] = opt.init("s1", p[half:])
    for clip in ((8.0, 0.0), (8.0, 2.0), (8.0, 0.0)):
        g = rng.normal(size=N).astype(F32)
        parts = {"one": g, "s0": g[:half], "s1": g[half:]}
        for name, (slabs, scalars) in state.items():
            grad = aligned_concatenate([parts[name]])
            state[name] = opt.update(name, slabs, scalars, grad, clip)[:2]
    for kind in ("master", "mu", "nu"):
        one = state["one"][0][kind]
        shards = state["s0"][0][kind] + state["s1"][0][kind]
        if kind == "master":
            cat = lambda cs: np.concatenate([np.asarray(c) for c in cs])
            np.testing.assert_array_equal(cat(shards), cat(one))
            continue
        for field in ("codes", "scales"):
            cat = lambda cs, f=field: np.concatenate([np.asarray(getattr(c, f)) for c in cs])
            np.testing.assert_array_equal(cat(shards), cat(one), err_msg=f"{kind} {field}")


# 12 s (60 s with the shared cores loaded: three tiny runs, two on 2 devices)
@pytest.mark.slow
def test_int8_moments_on_two_devices_train_as_one(tiny, tmp_path):
    """int8 moments under ZeRO-3 on 2 devices, the state in host RAM and on NVMe (each
    process's files, scales beside codes): SGD with momentum (its ``trace`` in int8)
    equals the one-device streaming run of the same batch in 2 micro-batches to the
    tolerance the fp32 ZeRO-3 tests hold (tests/test_zero.py's reference: the devices'
    gradient sum rounds otherwise, ~1e-7; the blocks are the same, the test above), but
    for the few elements a rounding moves across a code's midpoint
    (``equivalence.assert_int8_trees_close``). Against one micro-batch the int8 runs
    part by 3e-5 of the loss (measured): a gradient's rounding moves a moment across a
    code's midpoint, one step of 2**(1/8)."""
    from equivalence import (
        assert_evaluation_equal,
        assert_int8_trees_close,
        assert_logits_close,
        assert_losses_close,
        check_tokens,
        without_key_bias,
    )

    from hetjax.train import train
    from models import build_model

    opt = dict(name="sgd", lr=0.1, state_dtype="int8", **CLIP)
    pages = dict(page_size="16KiB")
    stream = dict(mode="stream")  # (in memory, offload.mode=none: blocks of whole leaves)
    reference = tiny(optimizer=opt, offload=stream, memory=pages, train=dict(grad_accum=2))
    one = train(reference, tmp_path / "one", verbose=False)
    for tier in ("host", "nvme"):
        config = tiny(
            optimizer=opt,
            offload=dict(mode="stream", optimizer=tier),
            memory=pages,
            distributed=dict(data_parallel=2),
        )
        two = train(config, tmp_path / tier, verbose=False)
        assert_losses_close(two.losses, one.losses)
        assert_evaluation_equal(two, one)
        assert_int8_trees_close(without_key_bias(two.params), without_key_bias(one.params))
        model = build_model(config.model)
        assert_logits_close(model, two.params, one.params, check_tokens(), rtol=1e-5)
    scales = tmp_path / "nvme" / "nvme" / "proc0" / "optimizer_scales" / "gen1" / "trace"
    assert json.loads((scales / "zarr.json").read_text())["data_type"] == "float32"


def test_int8_moments_on_nvme_store_codes_and_scales_in_their_files(tmp_path):
    """The NVMe tier's store of int8 moments (``storage/scales.py``) at the store's
    level: a streamed stage's int8 blocks come back as views of pooled buffers (codes
    and scales, each as written), updated in place and put, are the committed state
    after the commit (the other copy), and what a checkpoint reads from the frozen
    pages; a cached stage stays in RAM. The files: codes int8 and O_DIRECT, scales fp32
    with a CRC-32 of every page checked on read (a flipped bit: ``DamagedPageError``),
    ``4 + 1 + 1`` bytes an element and two 4-byte scales a page of 4096, a copy."""
    from hetjax.storage.scales import ScaledStateStore
    from hetjax.types import DamagedPageError

    P, rng = 4096, np.random.default_rng(13)
    fmt = state_format(OptimizerConfig(state_dtype="int8"))

    def blocks(pages: int, kind: str) -> moments.Int8Blocks:
        codes = rng.integers(-127, 128, pages * P).astype(np.int8)
        if kind == "nu":
            codes = rng.integers(0, 256, pages * P).astype(np.uint8).view(np.int8)
        return moments.Int8Blocks(codes, rng.random(pages * 2).astype(F32))

    def state(pages: int) -> dict:
        return {"master": rng.normal(size=pages * P).astype(F32), "mu": blocks(pages, "mu"),
                "nu": blocks(pages, "nu")}  # fmt: skip

    def same(a: dict, b: dict) -> None:
        for kind in ("master", "mu", "nu"):
            x, y = (d[kind][0] if isinstance(d[kind], list) else d[kind] for d in (a, b))
            for field in ("codes", "scales") if kind != "master" else ("",):
                get = (lambda v, f=field: np.asarray(getattr(v, f))) if field else np.asarray
                np.testing.assert_array_equal(get(x), get(y), err_msg=f"{kind} {field}")

    store = ScaledStateStore(
        tmp_path / "optimizer", fmt, {"a": (0, 2), "b": (2, 3)}, P, cached=["a"],
        sharding=Shardings.single_device().optimizer, io_slots=2, blocks=moments.Int8Blocks,
    )  # fmt: skip
    try:
        start = {"a": state(2), "b": state(3)}
        for stage in ("a", "b"):
            store.init_stage(stage, {k: [v] for k, v in start[stage].items()}, [np.int32(0)])
        store.wait_init()
        slabs, _ = store.get("b")
        same(slabs, start["b"])
        assert isinstance(slabs["mu"].scales, np.ndarray) and slabs["mu"].scales.size == 6
        new = state(3)
        for kind in ("master", "mu", "nu"):  # in place, as the native kernel updates
            if kind == "master":
                slabs[kind][:] = new[kind]
            else:
                slabs[kind].codes[:], slabs[kind].scales[:] = new[kind].codes, new[kind].scales
        store.put("b", slabs, [np.int32(1)])
        store.put("a", store.get("a")[0], [np.int32(1)])
        store.commit()
        same(store.committed("b")[0], new)
        same(store.committed("a")[0], start["a"])
        held, _, release = store.freeze("b")
        same(dict(held), new)  # read from the frozen pages, page by page
        release()
        elems = 5 * P
        assert store.nvme_bytes == 2 * (6 * elems + 2 * 4 * 2 * 5)
        assert store.codes.disk[0].links  # the codes' pages: O_DIRECT
        scales = tmp_path / "optimizer_scales" / f"gen{store.current}" / "mu" / "c" / "3" / "0"
        raw = bytearray(scales.read_bytes())
        raw[0] ^= 1
        scales.write_bytes(bytes(raw))
        with pytest.raises(DamagedPageError):
            store.committed("b")
    finally:
        store.flush()


# -- checkpoints ------------------------------------------------------------------------------


def _save_and_open(state, directory):
    """``state`` (a runtime's ``save_state()``) written as checkpoint 2 of ``directory``
    and opened again (read on demand)."""
    from hetjax.checkpoint import Checkpointer

    ckpt = Checkpointer(directory, async_save=False)
    ckpt.save(2, state, {"step": 2})
    ckpt.wait()
    stored, _ = ckpt.restore(2)
    return stored


def _moment_leaves(opt_state) -> dict[str, list]:
    """The in-memory runtime's moments by kind (``mu``, ``nu``), leaf by leaf, as they
    are held (arrays, or Int8Blocks)."""
    adam = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "nu"))
        if hasattr(s, "nu")
    ]
    assert len(adam) == 1
    is_blocks = lambda x: isinstance(x, moments.Int8Blocks)
    return {k: jax.tree.leaves(getattr(adam[0], k), is_leaf=is_blocks) for k in ("mu", "nu")}


def _converted(saved: np.ndarray, kind: str, dtype: str):
    """The reference conversion of a saved moment (float32 or bfloat16 values) to a run
    of ``dtype``: widened exactly, then fp32 as is, bfloat16 rounded to nearest even,
    int8 quantized; returned as the runtime holds it (codes and scales for int8)."""
    wide = np.asarray(saved).astype(F32)
    if dtype == "float32":
        return wide
    if dtype == "bfloat16":
        return bf16_round(wide)
    return ref_quantize(wide, signed=kind != "nu")


# 7 s (90 s with the shared cores loaded: nine tiny in-memory runtimes, three checkpoints)
@pytest.mark.slow
def test_in_memory_checkpoints_round_trip_per_dtype_and_across(tiny, tmp_path):
    """In memory, each state dtype trained two steps and checkpointed: the checkpoint
    holds fp32 and bfloat16 moments as they are (int8 ones as the float32 values their
    blocks hold: a checkpoint's kind has one dtype and no scales), and restoring it into
    a run of each dtype gives that run's conversion of the saved values (reference
    above): back into its own dtype, exactly the state it saved."""
    from equivalence import training_batches

    from hetjax.runtime.in_memory import InMemoryRuntime

    saved_dtype = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}
    for source in ("float32", "bfloat16", "int8"):
        config = tiny(optimizer=dict(state_dtype=source))
        runtime = InMemoryRuntime(config)
        for batch in training_batches(config, 2):
            runtime.train_step(batch)
        stored = _save_and_open(runtime.save_state(), tmp_path / source)
        assert stored.state_format.dtype("mu").name == saved_dtype[source]
        assert stored.state_format.dtype("master").name == "float32"
        held = _moment_leaves(runtime.state.opt_state)
        for target in ("float32", "bfloat16", "int8"):
            restored = InMemoryRuntime(tiny(optimizer=dict(state_dtype=target)))
            restored.load_state(stored)
            got = _moment_leaves(restored.state.opt_state)
            for kind in ("mu", "nu"):
                saved = jax.tree.leaves(stored.kind_tree(kind))
                # the kind trees' leaves and the optax state's leaves: one order
                for leaf, s, h in zip(got[kind], saved, held[kind], strict=True):
                    want = _converted(s, kind, target)
                    if target == "int8":
                        codes = _codes(leaf) if kind == "mu" else _codes(leaf) & 0xFF
                        np.testing.assert_array_equal(codes, want[0])
                        np.testing.assert_array_equal(np.asarray(leaf.scales), want[1])
                    else:
                        assert leaf.dtype == np.dtype(target)
                        np.testing.assert_array_equal(np.asarray(leaf).astype(F32), want)
                    if target == source:  # its own dtype: the state it saved
                        jax.tree.map(np.testing.assert_array_equal, leaf, h)
            jax.tree.map(np.testing.assert_array_equal, restored.state.params, runtime.state.params)


def _stream_values(runtime, stage: str) -> dict[str, np.ndarray]:
    """A streaming run's committed state of ``stage`` as flat values: as held (float32,
    bfloat16), int8 blocks as the float32 values they hold (in host RAM, the code's
    dequantization; on NVMe, the reference's of the codes and scales in its files)."""
    from hetjax.storage.states import MemoryStateStore

    if isinstance(runtime.states, MemoryStateStore):
        held = runtime.states.slabs[stage]
        values = runtime.optimizer.values
        return {k: values(k, chunks, _layout_of(stage)) for k, chunks in held.items()}
    slabs = runtime.states.committed(stage)[0]
    P = runtime.optimizer.layouts[_layout_of(stage)].page_elems
    return {k: _reference_values(v, k, P) for k, v in slabs.items()}


def _reference_values(slab, kind: str, page: int) -> np.ndarray:
    """A committed slab's values; int8 blocks dequantized by the reference, page by page."""
    if not isinstance(slab, moments.Int8Blocks):
        return np.asarray(slab)
    codes = np.asarray(slab.codes).astype(np.int32)
    codes = codes if kind != "nu" else codes & 0xFF
    return ref_dequantize_pages(codes, np.asarray(slab.scales), kind != "nu", page)


# 25 s (120 s with the shared cores loaded: twenty tiny streaming runtimes, four checkpoints)
@pytest.mark.slow
def test_stream_checkpoints_round_trip_per_dtype_and_across(tiny, tmp_path):
    """Streaming, float32, bfloat16 and int8 moments on NVMe (float32 and bfloat16: the
    checkpoint hard-links the tier's files; int8: codes and scales read back and saved
    as the float32 values they hold) and int8 in host RAM (saved the same way), trained
    two steps and checkpointed; restored into a streaming run of each dtype with its
    state in host RAM and an int8 run on NVMe: every stage's committed state is the
    saved one converted (bfloat16 widened exactly, float32 rounded to nearest even,
    int8 quantized page by page: the reference above), and in its own dtype exactly the
    state it saved."""
    from equivalence import training_batches

    from hetjax.runtime.streaming import StreamingRuntime

    def stream(dtype, tier, name):
        config = tiny(
            optimizer=dict(state_dtype=dtype),
            offload=dict(mode="stream", optimizer=tier),
            memory=dict(page_size="16KiB"),
        )
        return config, StreamingRuntime(config, workdir=tmp_path / name)

    dtypes = ("float32", "bfloat16", "int8")
    sources = [(d, "nvme") for d in dtypes] + [("int8", "host")]
    for source, tier in sources:
        config, runtime = stream(source, tier, f"{source}-{tier}")
        try:
            for batch in training_batches(config, 2):
                runtime.train_step(batch)
            runtime.settle()
            held = {s: _stream_values(runtime, s) for s in runtime.stage_names}
            stored = _save_and_open(runtime.save_state(), tmp_path / f"ckpt-{source}-{tier}")
        finally:
            runtime.close()
        saved = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}[source]
        assert stored.state_format.dtype("nu").name == saved
        for target, target_tier in [(d, "host") for d in dtypes] + [("int8", "nvme")]:
            name = f"{source}-{tier}-to-{target}-{target_tier}"
            _, restored = stream(target, target_tier, name)
            try:
                restored.load_state(stored)
                opt = restored.optimizer
                for stage in restored.stage_names:
                    layout = _layout_of(stage)
                    P = opt.layouts[layout].page_elems
                    if target_tier == "nvme":
                        got = restored.states.committed(stage)[0]
                        got = {k: [v] for k, v in got.items()}  # one chunk: the whole slab
                        bounds = [(0, got["master"][0].size)]
                    else:
                        got = restored.states.slabs[stage]
                        bounds = opt.chunk_bounds(layout)
                    master = np.concatenate([np.asarray(c) for c in got["master"]])
                    np.testing.assert_array_equal(master, held[stage]["master"])
                    for kind in ("mu", "nu"):
                        values = held[stage][kind]
                        if target == "int8":
                            for (a, b), chunk in zip(bounds, got[kind], strict=True):
                                want = ref_quantize_pages(values[a:b].astype(F32), kind == "mu", P)
                                codes = _codes(chunk) if kind == "mu" else _codes(chunk) & 0xFF
                                np.testing.assert_array_equal(codes, want[0])
                                np.testing.assert_array_equal(np.asarray(chunk.scales), want[1])
                        else:
                            flat = np.concatenate([np.asarray(c) for c in got[kind]])
                            assert flat.dtype == np.dtype(target), (stage, kind)
                            want = _converted(values, kind, target)
                            np.testing.assert_array_equal(flat.astype(F32), want)
                        if target == source:  # its own dtype: the state it saved
                            if target_tier == "nvme":
                                now = _reference_values(got[kind][0], kind, P)
                            else:
                                now = opt.values(kind, got[kind], layout)
                            np.testing.assert_array_equal(now, values)
            finally:
                restored.close()


def _layout_of(stage: str) -> str:
    from hetjax.runtime.setup import layout_name

    return layout_name(stage)


# -- bytes ------------------------------------------------------------------------------------

EIGHT = dict(num_layers=8, d_model=32, num_heads=4, max_seq_len=32)


# 11 s (45 s with the shared cores loaded: five streaming runtimes)
@pytest.mark.slow
def test_planner_bytes_equal_the_runtimes_for_each_state_dtype(tiny, tmp_path):
    """``optimizer.state_dtype`` moves the planner's bytes (``Workload.from_config``)
    and the streaming runtime's (its plans, its NVMe store, the state it holds in host
    RAM) together, to the bytes counted by hand: 4 + 4 + 4 bytes a parameter with fp32
    moments, 4 + 2 + 2 with bfloat16, 4 + 1 + 1 and a 4-byte scale per 2048 of each
    moment with int8 (in RAM and on NVMe, where the scales have files of their own)."""
    from hetjax.memory_host import nvme_parts, plan_host
    from hetjax.planning.workload import Workload, memory_sizes
    from hetjax.runtime.streaming import StreamingRuntime

    offload = dict(mode="stream", params="host", optimizer="nvme", prefetch_depth=1)
    memory_cfg = dict(page_size="16KiB", device_budget="64MiB", host_budget="64MiB")
    for dtype, per_param in (("float32", 12), ("bfloat16", 8), ("int8", 6 + 2 * 4 / 2048)):
        config = tiny(
            model=EIGHT, offload=offload, memory=memory_cfg, optimizer=dict(state_dtype=dtype)
        )
        runtime = StreamingRuntime(config, workdir=tmp_path / dtype)
        try:
            s, t = runtime.sizes, config.train
            assert runtime.optimizer.state_format.bytes_per_param == per_param
            measured = runtime.fns.memory_sizes(
                t.micro_batch_size, t.seq_len, runtime.compute_dtype
            )
            w = Workload.from_config(config, measured)
            assert w.state_bytes_per_param == per_param
            planned = memory_sizes(w)
            o = runtime.offload  # the placement the runtime resolved from the config
            planned_host = plan_host(planned, o, config.memory.host_budget)
            assert planned_host.parts == runtime.host_plan.parts
            elems = sum(s.own(n) for n in s.stages())
            assert nvme_parts(planned, o, planned_host)["optimizer"] == (runtime.states.nvme_bytes)
            assert elems % 2048 == 0  # whole int8 blocks: the scales' bytes are whole too
            assert runtime.states.nvme_bytes == 2 * per_param * elems  # two copies
        finally:
            runtime.close()
    # state in host RAM, each dtype: two copies held after a step (the committed
    # state and the dead one kept as the next update's output), as the planner counts
    from equivalence import training_batches

    host = dict(mode="stream", params="host", optimizer="host", prefetch_depth=1)
    for dtype in ("float32", "bfloat16", "int8"):
        config = tiny(
            model=EIGHT, offload=host, memory=memory_cfg, optimizer=dict(state_dtype=dtype)
        )
        runtime = StreamingRuntime(config, workdir=tmp_path / f"host-{dtype}")
        try:
            s, t = runtime.sizes, config.train
            measured = runtime.fns.memory_sizes(
                t.micro_batch_size, t.seq_len, runtime.compute_dtype
            )
            o = runtime.offload
            planned = plan_host(
                memory_sizes(Workload.from_config(config, measured)), o, config.memory.host_budget
            )
            for batch in training_batches(config, 2):
                runtime.train_step(batch)
            elems = sum(s.own(n) for n in s.stages())
            by_hand = {  # per element, and int8: a 4-byte scale per 2048 of each moment
                "float32": 12 * elems,
                "bfloat16": 8 * elems,
                "int8": 6 * elems + 2 * 4 * elems // 2048,
            }[dtype]
            assert runtime.states.host_bytes() == 2 * by_hand, dtype
            assert planned.parts["optimizer"] == runtime.host_plan.parts["optimizer"] == 2 * by_hand
        finally:
            runtime.close()
    # int8 on pages of 3072 elements (a block and a half: two scales a page), on NVMe
    # and in host RAM: the planner counts each page's blocks as the runtime holds them
    short = dict(memory_cfg, page_size="12KiB")
    for tier in ("nvme", "host"):
        config = tiny(
            model=EIGHT,
            offload=dict(offload, optimizer=tier),
            memory=short,
            optimizer=dict(state_dtype="int8"),
        )
        runtime = StreamingRuntime(config, workdir=tmp_path / f"int8-short-{tier}")
        try:
            s, t, o = runtime.sizes, config.train, runtime.offload
            assert runtime.optimizer.layouts["block"].page_elems == 3072
            measured = runtime.fns.memory_sizes(
                t.micro_batch_size, t.seq_len, runtime.compute_dtype
            )
            planned = memory_sizes(Workload.from_config(config, measured))
            planned_host = plan_host(planned, o, config.memory.host_budget)
            assert planned_host.parts == runtime.host_plan.parts
            elems = sum(s.own(n) for n in s.stages())
            by_hand = 6 * elems + 2 * 4 * 2 * (elems // 3072)  # two 4-byte scales a page
            if tier == "nvme":
                assert nvme_parts(planned, o, planned_host)["optimizer"] == 2 * by_hand
                assert runtime.states.nvme_bytes == 2 * by_hand
            else:
                for batch in training_batches(config, 1):
                    runtime.train_step(batch)
                held = runtime.states.host_bytes()  # two copies, as the plan counts
                assert held == planned_host.parts["optimizer"] == 2 * by_hand
        finally:
            runtime.close()
    int8 = tiny(model=EIGHT, offload=offload, memory=memory_cfg, optimizer=dict(state_dtype="int8"))
    fmt = state_format(int8.optimizer)
    assert fmt.bytes_per_param == 4 + 2 * (1 + 4 / 2048)
    assert fmt.nbytes(4096) == 4096 * 4 + 2 * (4096 + 2 * 4)


# 7 s (45 s with the shared cores loaded): a benchmark smoke test
@pytest.mark.slow
def test_state_dtype_bench_quick(tmp_path, monkeypatch, capsys):
    from hetjax.bench import main

    monkeypatch.chdir(tmp_path)  # its PNG: runs/bench/state_dtype.png
    out = tmp_path / "state_dtype.json"
    assert main(["state_dtype", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["shapes"]["gpt_tiny"]["runs"]
    assert sorted(runs) == ["bfloat16", "float32", "int8"]
    assert all(np.isfinite(r["val_loss"]) and len(r["losses"]) == 6 for r in runs.values())
    assert runs["float32"]["val_minus_fp32"] == 0
    assert (tmp_path / "runs" / "bench" / "state_dtype.png").stat().st_size > 0
    assert "int8" in capsys.readouterr().out


# 22 s (90 s with the shared cores loaded: two runs and a killed one, a launched process)
@pytest.mark.slow
def test_int8_on_nvme_in_place_sigkill_mid_step_then_resume_equals_uninterrupted(tmp_path):
    """int8 moments on NVMe, one copy written in place: killed with SIGKILL while
    step 5 is half written over the pages (scales written, codes in flight) and resumed
    from step 4's checkpoint (its int8 moments saved as the float32 values they hold and
    requantized on restore, which gives back the same codes and scales), the run ends
    with exactly the losses and params of the uninterrupted run (the crash harness of
    tests/test_checkpoint.py)."""
    from test_checkpoint import NVME, STEPS, config, launch

    from hetjax.train import train

    optimizer = dict(warmup_steps=2, lr=3e-3, speculation="never", state_dtype="int8")
    cfg = config(NVME, optimizer=optimizer, checkpoint=dict(async_save=False))
    reference = train(cfg, tmp_path / "ref", verbose=False)
    killed = tmp_path / "killed"
    launch(cfg, killed, faults="kill_mid_update@5", expect_rc=-9)
    for store in ("optimizer", "optimizer_scales"):  # one copy each, in place
        tier = killed / "nvme" / store
        assert (tier / "gen0").is_dir() and not (tier / "gen1").exists(), store
    resumed = train(cfg, killed, verbose=False)
    assert 0 < len(resumed.losses) < STEPS  # it did resume, not start over
    np.testing.assert_array_equal(resumed.losses, reference.losses[-len(resumed.losses) :])
    jax.tree.map(np.testing.assert_array_equal, resumed.params, reference.params)


# 23 s (90 s with the shared cores loaded: two child processes compiling anew, a reference;
# in a worktree run with PYTHONPATH at its root, as the children import hetjax)
@pytest.mark.slow
def test_int8_moments_on_nvme_in_two_processes_train_as_one(tiny, tmp_path):
    """2 processes x 2 CPU devices (gloo), int8 moments on NVMe (each process's files,
    its pages' scales beside its codes): SGD with momentum equals the one-device
    streaming run of the same batch in 4 micro-batches to the ZeRO-3 tests' tolerance
    (test_int8_moments_on_two_devices_train_as_one says why that reference)."""
    from equivalence import assert_int8_trees_close, without_key_bias
    from test_zero import _params_like, _run_two_processes

    from hetjax.train import train

    opt = dict(name="sgd", lr=0.1, state_dtype="int8", **CLIP)
    reference = tiny(
        optimizer=opt,
        offload=dict(mode="stream"),
        memory=dict(page_size="16KiB"),
        train=dict(grad_accum=4),
    )
    ref = train(reference, tmp_path / "ref", verbose=False)
    args = ("optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.grad_clip=2.0")
    args += ("optimizer.state_dtype=int8", "offload.mode=stream", "offload.optimizer=nvme")
    saved = _run_two_processes(tmp_path, *args)
    np.testing.assert_allclose(saved["losses"], ref.losses, rtol=1e-5)
    params = _params_like(saved, ref.params)
    assert_int8_trees_close(without_key_bias(params), without_key_bias(ref.params))
    for k in (0, 1):  # each process its own codes and scales
        for store in ("optimizer", "optimizer_scales"):
            root = tmp_path / f"proc{k}" / "nvme" / f"proc{k}" / store
            assert (root / "gen0" / "trace" / "zarr.json").is_file(), (k, store)
