"""``python -m hetjax.launch`` process set-up: glibc allocator settings."""

import json
import os
import platform
import subprocess
import sys

import pytest

from hetjax.allocator import MALLOC_ENV

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


def _tune(**env) -> tuple[dict, dict]:
    """tune_malloc in a fresh interpreter (it changes the process's allocator): what
    it applied and the variables it leaves for child processes."""
    code = (
        "import json, os; from hetjax.allocator import MALLOC_ENV, tune_malloc; "
        "print(json.dumps([tune_malloc(), {k: os.environ.get(k) for k in MALLOC_ENV}]))"
    )
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "HETJAX_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    applied, exported = json.loads(out.stdout)
    return applied, exported


@glibc
def test_tune_malloc_applies_the_bench_settings_and_user_variables_win():
    applied, exported = _tune()
    assert applied == exported == MALLOC_ENV
    applied, exported = _tune(MALLOC_ARENA_MAX="4")
    assert "MALLOC_ARENA_MAX" not in applied and exported["MALLOC_ARENA_MAX"] == "4"
    assert exported["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    applied, exported = _tune(HETJAX_MALLOC="0")
    assert applied == {} and set(exported.values()) == {None}
