import os

# Multi-device tests use virtual CPU devices; must be set before JAX initialises. A
# user's own XLA_FLAGS keep theirs and gain the device count (unless they set one).
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the child processes of the crash tests, which inherit this) compile the
# same small programs: a persistent compilation cache halves their CPU time. One
# directory for the whole run: the pytest-xdist workers inherit the controller's
# setting, and CI's slow suite starts with the default run's programs; each process
# writes its entries whole (tests/_cache.py).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import _cache  # noqa: E402
import _cost  # noqa: E402
import _matrix  # noqa: E402
import pytest  # noqa: E402

from hetjax.config import Config  # noqa: E402

_cache.write_entries_whole()


def tiny_config(**sections) -> Config:
    """A very small GPT for fast tests: 2 layers, d 32, vocab 256, seq 16 (attention in
    two tiles)."""
    base = Config().replace(
        # attention_block 8: T 16 in two tiles of the blockwise attention, the path of a
        # real run's T above the default tile (256), not one tile alone
        model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, attention_block=8),
        train=dict(steps=5, batch_size=4, seq_len=16, log_every=1, eval_batches=2),
        optimizer=dict(warmup_steps=2, lr=3e-3),
        # The documented unshuffled order (data.shuffle's default is true since
        # 2026-11-23): the inputs the equivalence tests were validated on. Some of their
        # preconditions depend on the data (clipping that binds in some steps and not
        # all), and Adam's amplified summation-order noise and fp16 rounding differ
        # between orders (issue #24's note); the shuffled order is tested by the default
        # config's runs and tests/test_data.py.
        data=dict(corpus_bytes=200_000, shuffle=False),
        checkpoint=dict(every_steps=0, at_end=False),  # tests/test_checkpoint.py turns them on
    )
    return base.replace(**sections) if sections else base


@pytest.fixture
def tiny():
    return tiny_config


_REFERENCE_RUNS: dict = {}


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``run(config)``: ``hetjax.train.train(config)``, once per config in this process:
    the reference run an equivalence test compares against, shared by every test and
    module that asks for the same config (read it, never change it)."""

    def run(config: Config):
        if config not in _REFERENCE_RUNS:
            from hetjax.train import train

            workdir = tmp_path_factory.mktemp("reference")
            _REFERENCE_RUNS[config] = train(config, workdir, verbose=False)
        return _REFERENCE_RUNS[config]

    return run


# -- prerequisites ------------------------------------------------------------------------

# CI must run every test: there (CI=true, as GitHub Actions and most CI services set it) a
# missing prerequisite fails the test that needs it, saying what to install, instead of
# skipping it unnoticed.
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
# (a filterwarnings message is a regex, and ':' separates its fields: '.' stands for it)
NATIVE_KERNEL_FALLBACK = r"hetjax. the native Adam kernel is not used"


def require(available: bool, what: str) -> None:
    """Skips the calling test when ``available`` is false (``what``: the missing
    prerequisite and how to install it); under CI=true fails it instead."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"missing prerequisite (CI=true runs every test): {what}", pytrace=False)
    pytest.skip(f"needs {what}")


def pytest_addoption(parser):
    _cost.addoption(parser)


def pytest_configure(config):
    _cost.configure(config)  # --cost: each test's compile and run time (tests/_cost.py)
    if IN_CI:
        # Without a C++ compiler the offloaded runtimes fall back to optax with this
        # warning, and every equivalence test would silently test optax: in CI, an error.
        config.addinivalue_line("filterwarnings", f"error:{NATIVE_KERNEL_FALLBACK}:UserWarning")
    # On a GPU fp32 matmuls default to TF32 (10-bit mantissa): the equivalence tests'
    # 1e-5 needs full fp32 there, as the CPU always computes it.
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("", "cpu"):
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")


def on_accelerator(platforms: str | None) -> bool:
    """Whether tests run on an accelerator: ``JAX_PLATFORMS``'s first platform, or,
    where it is empty (JAX picks), the backend JAX starts."""
    if platforms:
        return platforms.split(",")[0] != "cpu"
    import jax

    return jax.default_backend() != "cpu"


def cpu_only_deselected(items: list, platforms: str | None) -> tuple[list, list]:
    """``items`` split into (kept, deselected): tests marked ``cpu_only`` (they assume
    the CPU backend: one memory, 8 virtual devices) are deselected on an accelerator."""
    if not on_accelerator(platforms):
        return list(items), []
    kept = [item for item in items if item.get_closest_marker("cpu_only") is None]
    return kept, [item for item in items if item.get_closest_marker("cpu_only") is not None]


def pytest_collection_modifyitems(config, items):
    try:  # the support matrix's guards name known cells (tests/_matrix.py)
        _matrix.check_items(items)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    kept, deselected = cpu_only_deselected(items, os.environ.get("JAX_PLATFORMS"))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
