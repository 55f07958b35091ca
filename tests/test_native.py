"""The host optimizer's native Adam/AdamW kernel (hetjax/native.py, csrc/adam.cc): the
same update as optax's over slabs, in every output-buffer mode and compute dtype; the
build's cache and its failures; the config's choice."""

import numpy as np
import pytest
from conftest import require

from hetjax.config import ConfigError, OptimizerConfig
from hetjax.optimizer import native
from hetjax.optimizer.slab import SlabOptimizer
from hetjax.parallel.single import Shardings
from hetjax.storage.pages import Leaf, SlabLayout, aligned_concatenate


@pytest.fixture
def compiler():
    """The native kernel's tests need a C++ compiler (skipped without one, failed under
    CI=true: conftest.require)."""
    require(
        native._compiler() is not None,
        "a C++ compiler for the native Adam kernel: apt-get install g++ (or set CXX)",
    )


N = 3 * 8192  # three chunks of two pages each (CHUNK_ELEMS patched below)
PAGE = 4096


def _optimizers(name, dtype, monkeypatch):
    import hetjax.optimizer.slab

    monkeypatch.setattr(hetjax.optimizer.slab, "CHUNK_ELEMS", 2 * PAGE)
    # Decay ends inside the second chunk, inside a page.
    layout = SlabLayout(
        leaves=(Leaf(("w",), (N,), 0, N),),
        treedef=None,
        tree_order=(0,),
        num_decay=8192 + 1000,
        size=N,
        page_elems=PAGE,
    )
    host = Shardings.single_device().optimizer
    cfg = dict(name=name, lr=1e-2, warmup_steps=2)
    return [
        SlabOptimizer(OptimizerConfig(host_kernel=k, **cfg), 10, {"s": layout}, host, dtype)
        for k in ("optax", "native")
    ]


def _optax_moments(cfg, grads, scales) -> dict[str, np.ndarray]:
    """Adam's mu and nu after ``grads`` clipped by ``scales``, as optax writes them
    (``(1 - b1) * g + b1 * mu``, ``(1 - b2) * g**2 + b2 * nu``), each operation rounded
    to float32 (numpy fuses nothing)."""
    f32 = np.float32
    mu = nu = np.zeros(N, f32)
    for grad, scale in zip(grads, scales, strict=True):
        g = np.asarray(grad)[:N] * f32(scale)
        mu = f32(1 - cfg.b1) * g + f32(cfg.b1) * mu
        nu = f32(1 - cfg.b2) * (g * g) + f32(cfg.b2) * nu
    return {"mu": mu, "nu": nu}


@pytest.mark.parametrize("name", ["adamw", "adam"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["fresh", "spare", "in place"])
def test_native_kernel_equals_optax(compiler, monkeypatch, name, dtype, mode):
    """Four steps, the second clipped (global norm above max). mu and nu of the native
    kernel are optax's formulas evaluated op by op in float32, bit for bit (numpy below);
    optax's jitted update differs from those by one rounding a step (XLA fuses one of the
    two products of ``(1 - b) * g + b * m`` into an FMA, which one depending on the
    fusion), so against it master, mu, nu and the compute-dtype pages agree to float32
    rounding; the step counts exactly."""
    optimizers = _optimizers(name, dtype, monkeypatch)
    assert [o.native for o in optimizers] == [False, True]
    rng = np.random.default_rng(1)
    master = rng.normal(size=N).astype(np.float32)
    grads = [aligned_concatenate([rng.normal(size=N).astype(np.float32)]) for _ in range(4)]
    moments = _optax_moments(optimizers[0].cfg, grads, [1.0, 2.0 / 8.0, 1.0, 1.0])
    results = []
    for opt in optimizers:
        state, spare = opt.init("s", master), opt.init("s", master)[0]
        for step, grad in enumerate(grads):
            clip = (8.0, 2.0) if step == 1 else (8.0, 0.0)
            kwargs = {"spare": spare} if mode == "spare" else {"in_place": mode == "in place"}
            slabs, scalars, pages = opt.update("s", *state, grad, clip, **kwargs)
            spare, state = state[0], (slabs, scalars)
        slabs = {k: np.concatenate([np.asarray(c) for c in v]) for k, v in state[0].items()}
        pages = np.concatenate([np.asarray(p, np.float32) for p in pages])
        results.append((slabs, [int(s) for s in state[1]], pages))
    (ref, ref_counts, ref_pages), (got, counts, got_pages) = results
    assert counts == ref_counts
    assert sorted(got) == sorted(ref)
    for kind in ("mu", "nu"):
        np.testing.assert_array_equal(got[kind], moments[kind], err_msg=kind)
    for kind in ref:
        np.testing.assert_allclose(got[kind], ref[kind], rtol=2e-6, atol=1e-7, err_msg=kind)
    assert not np.array_equal(ref["master"], master)  # it moved
    eps = float(np.finfo(np.dtype(dtype) if dtype != "bfloat16" else np.float32).eps)
    eps = 2**-7 if dtype == "bfloat16" else eps
    np.testing.assert_allclose(got_pages, ref_pages, rtol=eps, atol=1e-6)
    np.testing.assert_allclose(got_pages, got["master"], rtol=eps, atol=1e-6)


def test_auto_runs_the_native_kernel_where_a_compiler_is(compiler):
    """The default (host_kernel=auto) builds and uses the kernel: with a compiler present,
    the equivalence tests of the offloaded runtimes run it, not optax's fallback."""
    assert native.use_native("auto", "adamw", "cpu") is True
    host = Shardings.single_device().optimizer
    assert SlabOptimizer(OptimizerConfig(), 10, {}, host, "float32").native


def test_build_is_cached_and_a_failed_build_is_clear(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("HETJAX_CACHE", str(tmp_path / "cache"))
    lib = native._build()
    assert lib.is_file() and lib.parent == tmp_path / "cache" / "native"
    stamp = lib.stat().st_mtime_ns
    assert native._build() == lib and lib.stat().st_mtime_ns == stamp  # not rebuilt

    monkeypatch.setenv("HETJAX_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(native.NativeKernelError, match="compiling adam.cc failed"):
        native._build()
    assert list((tmp_path / "other" / "native").iterdir()) == []  # nothing half-written


def test_auto_falls_back_to_optax_with_a_warning(monkeypatch):
    def broken():
        raise native.NativeKernelError("no C++ compiler found")

    monkeypatch.setattr(native, "load", broken)
    with pytest.warns(UserWarning, match="optax runs instead"):
        assert native._auto_available.__wrapped__() is False
    with pytest.raises(native.NativeKernelError, match="no C\\+\\+ compiler"):
        native.use_native("native", "adamw", "cpu")
    assert native.use_native("optax", "adamw", "cpu") is False
    assert native.use_native("auto", "lion", "cpu") is False
    assert native.use_native("native", "adamw", "gpu") is False  # device-cached state


def test_native_for_other_optimizers_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer.host_kernel.*auto or optax.*lion"):
        OptimizerConfig(name="lion", host_kernel="native")
    with pytest.raises(ConfigError, match="host_kernel"):
        OptimizerConfig(host_kernel="avx")
