"""Sizing for a GPU, checked on the CPU (issue #19, items 3 and 4): the launcher sets
XLA's device memory fraction and pinned host cap from the config before JAX starts; the
planner plans within that fraction of a profile's physical memory; an accelerator that
does not report its memory is an error, never taken for host RAM; the host plan's
pinned part is checked against XLA's cap."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hetjax import xla_env
from hetjax.config import Config, ConfigError
from hetjax.memory import GradientPlan
from hetjax.memory_host import HostMemoryPlan
from hetjax.planning.hardware import (
    PROFILES,
    HardwareError,
    device_capacity,
    measure_device_bandwidth,
)
from hetjax.planning.search import budgets

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def test_launcher_variables_come_from_the_config_and_the_environment_wins():
    config = Config().replace(memory=dict(device_fraction=0.8, host_budget="100GiB"))
    assert xla_env.wanted(config) == {
        "XLA_CLIENT_MEM_FRACTION": "0.8",
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "100",
    }
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    notes = xla_env.apply(config, environ)
    assert environ == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",  # set by the user: kept, and said
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "100",
    }
    assert notes == [
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 from the environment (the config asks 0.8)"
    ]
    assert xla_env.pinned_limit(environ) == 100 * GiB
    assert xla_env.pinned_limit({}) == 64 * GiB  # XLA's default
    # without a host budget: 90% of the machine's RAM
    ram = xla_env.machine_ram()
    wanted = int(xla_env.wanted(Config())["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"])
    assert (wanted - 1) * GiB < 0.9 * ram <= wanted * GiB


@pytest.mark.slow  # ~16 s (the default run's time, 2026-11-27)
def test_launch_sets_them_before_jax_starts(tmp_path):
    code = (
        "import sys, jax; from hetjax import launch; launch.main(); "
        "import os; print('fraction', os.environ['XLA_CLIENT_MEM_FRACTION'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_P", "XLA_CLIENT"))}
    env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = "3"
    args = ["--config", "configs/gpt_tiny.py", "--workdir", str(tmp_path), "--config.train.steps=1"]
    args += ["--config.memory.device_fraction=0.7", "--config.checkpoint.at_end=false"]
    # the default's placement without measuring the machine, and no summary extras
    args += ["--config.offload.mode=stream", "--config.offload.optimizer=nvme"]
    args += ["--config.train.in_memory_steps=0", "--config.train.trace_every=0"]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fraction 0.7" in out.stdout
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=3 from the environment" in out.stderr


@pytest.mark.parametrize("fraction", [0.9, 0.75])
def test_planner_plans_within_the_fraction_of_physical_memory(fraction):
    h100 = PROFILES["h100"]
    assert h100.device_memory == 81_559 << 20  # what an H100 80GB has, not 80 GiB
    config = Config().replace(memory=dict(device_fraction=fraction))
    assert budgets(config, h100)["device"] == int(fraction * h100.device_memory)
    small = config.replace(memory=dict(device_budget="10GiB"))
    assert budgets(small, h100)["device"] == 10 * GiB


def _device(stats):
    return types.SimpleNamespace(platform="gpu", device_kind="Test GPU", memory_stats=lambda: stats)


def test_device_capacity_never_falls_back_to_host_ram():
    assert device_capacity(_device({"bytes_limit": 10 * GiB, "bytes_in_use": GiB})) == 9 * GiB
    with pytest.raises(HardwareError, match="Test GPU .*no bytes_limit.*memory.device_budget"):
        device_capacity(_device({"bytes_in_use": 0}))
    with pytest.raises(HardwareError, match="memory.device_budget"):
        device_capacity(_device(None))


def test_device_bandwidth_is_measured():
    assert measure_device_bandwidth(16 << 20) > 1e8  # bytes/s: any machine's memory


def test_pinned_part_of_the_host_plan_is_checked_against_the_cap():
    grads = GradientPlan.__new__(GradientPlan)
    plan = HostMemoryPlan(
        budget=0,
        param_slabs=40 * GiB,
        gradients=30 * GiB,
        optimizer_state=0,
        optimizer_io=100 * GiB,
        cache=0,
        cached_stages=(),
        grads=grads,
        boundaries=5 * GiB,
    )
    assert plan.pinned == 75 * GiB  # params, gradients, boundaries; not the optimizer's
    plan.check_pinned(80 * GiB)
    with pytest.raises(ConfigError, match=r"75.00 GiB of pinned.*allows 64.00 GiB: short by"):
        plan.check_pinned(64 * GiB)


# -- issue #59: the H200 and GH200, the kernel's key on Arm, the norms that clip ------------


def test_the_h200_and_gh200_profiles_plan_a_model():
    from hetjax.config import load_config
    from hetjax.planning.hardware import NAMES, get_profile
    from hetjax.planning.search import make_plan

    h200, gh200 = PROFILES["h200"], PROFILES["gh200"]
    assert h200.device_memory == 143_771 << 20  # an H200 141GB, as nvidia-smi says
    assert {"h200", "gh200"} <= set(NAMES) and get_profile("gh200") is gh200
    assert gh200.host_memory > h200.host_memory and gh200.h2d_bw > h200.h2d_bw  # C2C
    for hw in (h200, gh200):
        plan = make_plan(load_config("gpt_tiny"), hw)
        assert plan.hardware == hw.name and plan.step_s > 0 and plan.tflops > 0


# /proc/cpuinfo of an Arm machine (fields as Linux prints them on aarch64): no
# "model name", no "flags"; NVIDIA Grace (Neoverse V2, part 0xd4f) vs Graviton3 (V1)
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics {features}
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: {part}
CPU revision\t: 1
"""


def test_the_native_kernels_key_tells_arm_cpus_apart():
    """A kernel built with -march=native for one Arm CPU must not be loaded on another:
    the build key reads Arm's fields (the x86 ones are absent there)."""
    from hetjax.optimizer.native import _cpu_signature

    grace = _cpu_signature(ARM_CPUINFO.format(features="sve sve2 bf16", part="0xd4f"))
    graviton = _cpu_signature(ARM_CPUINFO.format(features="sve bf16", part="0xd40"))
    assert grace != graviton
    assert "CPU part\t: 0xd4f" in grace and "sve2" in grace and "BogoMIPS" not in grace
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\nbogomips\t: 1\n"
    assert _cpu_signature(x86) == "flags\t\t: fpu avx2\nmodel name\t: AMD EPYC"


def test_the_device_cache_norm_is_taken_at_the_highest_precision():
    """The norm feeds clipping: on a GPU a dot at default precision is TF32 or bf16."""
    import jax
    import jax.numpy as jnp

    from hetjax.runtime.loop.grads import DeviceGradients

    grads = DeviceGradients(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    text = grads.average.lower(jnp.ones(8), 2.0).as_text()
    (dot,) = [line for line in text.splitlines() if "dot_general" in line]
    assert "precision = [HIGHEST, HIGHEST]" in dot


def test_auto_attention_falls_back_to_blockwise_where_cudnn_fails_its_probe(monkeypatch, capsys):
    """``auto`` on a GPU in bf16 picks cuDNN's fused attention; where its probe fails
    (injected: the kernel raises), one warning line, and the blockwise attention runs:
    its output equals the blockwise attention's exactly. The probe runs once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import tiny_config

    from models import attention

    def broken(*args, **kwargs):
        raise RuntimeError("cuDNN: injected failure\nmore detail")

    monkeypatch.setattr(attention, "PROBED", {})
    monkeypatch.setattr(attention, "fused_supported", lambda *a: True)  # as on a GPU
    monkeypatch.setattr(attention, "fused_attention", broken)
    m = tiny_config(model=dict(compute_dtype="bfloat16", attention="auto")).model
    assert attention.resolve("auto", "gpu", jnp.bfloat16, m.head_dim) == "fused"
    attention.probe_for(m, 16)  # train's start-up probe
    line = capsys.readouterr().err.strip()
    assert line == (
        f"hetjax: warning: cuDNN fused attention failed its probe (bfloat16, head width "
        f"{m.head_dim}, 16 positions: RuntimeError: cuDNN: injected failure); "
        "model.attention=auto runs the blockwise attention"
    )
    assert attention.chosen(m) == (
        "blockwise (cuDNN failed its probe: RuntimeError: cuDNN: injected failure)"
    )
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, m.num_heads, 1, m.head_dim)), jnp.bfloat16)
    k, v = (q[:, :, :, 0] * s for s in (0.5, 2.0))
    got = jax.jit(lambda q, k, v: attention.attention(q, k, v, m))(q, k, v)
    block = attention.block_size(m.attention_block, 16)
    np.testing.assert_array_equal(got, attention.blockwise_attention(q, k, v, block))
    assert capsys.readouterr().err == ""  # probed once
