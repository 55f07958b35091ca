"""The host optimizer's native Adam/AdamW kernel: built on first use, cached, optional.

XLA's CPU backend runs optax's AdamW over a slab as three loop fusions and a cast, about
46 bytes of memory traffic per parameter where one pass needs 30; the update is memory
bound, so that is most of its time. ``csrc/adam.cc`` is the one pass, an XLA FFI custom
call (the way DeepSpeed ships a C++ CPU Adam). It is compiled here with the system's C++
compiler against the FFI headers jaxlib ships, once per machine, source and jaxlib
version, into ``$HETJAX_CACHE`` (default ``~/.cache/hetjax``), and registered with JAX.

``optimizer.host_kernel`` chooses: ``auto`` (the default) uses the kernel for adam and
adamw when it builds and falls back to optax with a warning when it does not (no
compiler); ``native`` requires it; ``optax`` never uses it. Speed: ``python -m
hetjax.bench optimizer`` (README). Moments in float32 or bfloat16 (``TARGET``), or in
int8 blocks (``TARGET_INT8``: each block dequantized, updated and requantized in the one
pass, ``moments.py``'s code bit for bit; tests/test_state_dtype.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np

from hetjax.config import NATIVE_OPTIMIZERS
from hetjax.optimizer.moments import Int8Blocks
from hetjax.state_format import INT8_BLOCK, KindFormat, StateFormat
from hetjax.types import MASTER

TARGET = "hetjax_adam"
TARGET_INT8 = "hetjax_adam_int8"  # the same pass over int8 moments (``moments.py``)
SOURCE = Path(__file__).parent / "csrc" / "adam.cc"
# -ffp-contract=off: every multiply and add rounds as written, so mu and nu are optax's
# formulas evaluated in float32 op by op (bit for bit, tests/test_native.py); GCC would
# otherwise fuse one product of each sum into an FMA of its own choosing.
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
]


class NativeKernelError(RuntimeError):
    """The native kernel could not be built or loaded; the message says why."""


# /proc/cpuinfo's fields that name the CPU and its features: x86's "model name" and
# "flags"; Arm's (a GH200's Grace) "CPU implementer/architecture/variant/part/revision"
# and "Features" (it has no "model name" or "flags").
CPUINFO_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture")
CPUINFO_FIELDS += ("CPU variant", "CPU part", "CPU revision")


def _cpu_signature(text: str | None = None) -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags, from
    ``/proc/cpuinfo`` (or ``text``), on x86 and Arm alike."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor()
    lines = {ln for ln in text.splitlines() if ln.split(":")[0].strip() in CPUINFO_FIELDS}
    return "\n".join(sorted(lines)) or platform.processor()


def cache_dir() -> Path:
    """``$HETJAX_CACHE/native``, else ``~/.cache/hetjax/native``; where that cannot be
    written (a read-only home), a per-user directory under the system's temp dir."""
    chosen = os.environ.get("HETJAX_CACHE")
    if chosen:
        return Path(chosen) / "native"
    home = Path.home() / ".cache" / "hetjax" / "native"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"hetjax-{os.getuid()}" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> Path:
    import jax

    compiler = _compiler()
    if compiler is None:
        raise NativeKernelError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode()):
        key.update(part)
    key.update(f"{jax.__version__} {platform.machine()} {_cpu_signature()}".encode())
    lib = cache_dir() / f"libhetjax_adam-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside its final name and renamed: a concurrent build (another process)
    # or an interrupted one never leaves a half-written library under that name.
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeKernelError(
                f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
            )
        os.replace(out, lib)
    return lib


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """Builds (or finds in the cache) and registers the kernel, returning the library;
    raises :class:`NativeKernelError` saying why when it cannot."""
    import jax

    lib = _build()
    try:
        handle = ctypes.cdll.LoadLibrary(str(lib))
    except OSError as e:
        raise NativeKernelError(f"loading {lib}: {e}") from e
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.HetjaxAdam), platform="cpu")
    capsule = jax.ffi.pycapsule(handle.HetjaxAdamInt8)
    jax.ffi.register_ffi_target(TARGET_INT8, capsule, platform="cpu")
    f = handle.HetjaxAdamHost
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    f.argtypes = [p, p, p, ctypes.c_int, p, i64, ctypes.c_int, p, ctypes.c_float, i64, i64, i64,
                  ctypes.c_int, p, ctypes.c_int]  # fmt: skip
    f.restype = ctypes.c_int
    f = handle.HetjaxAdamInt8Host
    f.argtypes = [p, p, p, p, p, p, i64, ctypes.c_int, p, ctypes.c_float, i64, i64, i64,
                  ctypes.c_int, p, ctypes.c_int]  # fmt: skip
    f.restype = ctypes.c_int
    return handle


KINDS = (MASTER, "mu", "nu")  # the kernel's state operands, in this order

# The kernel's codes of the dtypes it takes (``kind_of`` in ``csrc/adam.cc``): the
# compute-dtype params it writes, the gradient pages it reads, and the moments it
# updates (mu and nu, one dtype; the master is float32), or int8 blocks of
# ``INT8_BLOCK`` elements (``moments.py``): a state format of other dtypes is refused here.
_OUT_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}
_GRAD_KINDS = {"float32": 0, "bfloat16": 1}
_STATE_KINDS = {"float32": 0, "bfloat16": 1}


def refusal(state: StateFormat) -> str | None:
    """Why the kernel cannot update state in the format ``state`` (None: it can): it
    updates ``master``, ``mu`` and ``nu``, each in a dtype it has a code for."""
    if state.kinds != list(KINDS):
        return f"the native kernel updates the state kinds {list(KINDS)}, not {state.kinds}"
    moments = [state.kind(k) for k in KINDS[1:]]
    int8 = KindFormat(np.int8, block_size=INT8_BLOCK)
    known = lambda f: f == int8 or (not f.block_size and f.dtype.name in _STATE_KINDS)
    if not all(known(f) for f in moments) or moments[0] != moments[1]:
        return (
            f"the native kernel updates moments in one of {', '.join(_STATE_KINDS)} or int8 "
            f"blocks of {INT8_BLOCK}, not "
            f"{state.describe()}"
        )
    return None


def host_update(
    slabs: dict[str, np.ndarray],
    grad: list[np.ndarray],
    coef: np.ndarray,
    weight_decay: float,
    num_decay: int,
    out: np.ndarray,
    page_elems: int,
) -> None:
    """The kernel's pass over host buffers, in place, outside XLA: ``slabs`` (``master``
    float32, ``mu`` and ``nu`` in one dtype the kernel updates: writable, one size) are
    updated,
    ``out`` (the same size, the compute dtype) receives the new params. ``grad`` is the
    gradient as pages of one size covering the slab (float32 or bfloat16, each
    contiguous; one page: a flat slab), read where they are. ``coef`` as the FFI call's
    operand. Releases the GIL while it runs (ctypes). int8 moments: ``mu`` and ``nu``
    each :class:`~hetjax.optimizer.moments.Int8Blocks` of numpy arrays (codes int8,
    ``nu``'s bytes unsigned; scales float32, blocks of ``INT8_BLOCK`` from each page's
    first element: ``moments.py``)."""
    n = out.size
    if isinstance(slabs["mu"], Int8Blocks):
        _host_update_int8(slabs, grad, coef, weight_decay, num_decay, out, page_elems)
        return
    arrays = [slabs[k] for k in KINDS]
    state_kind = _STATE_KINDS.get(arrays[1].dtype.name)
    if (
        state_kind is None
        or arrays[0].dtype != np.float32
        or arrays[2].dtype != arrays[1].dtype
        or any(a.size != n or not a.flags.writeable for a in arrays)
    ):
        raise ValueError(
            f"host_update: master (float32), mu and nu (one dtype the kernel updates: "
            f"{', '.join(_STATE_KINDS)}) must be writable and of one size, not "
            + ", ".join(f"{k} {a.size} {a.dtype}" for k, a in zip(KINDS, arrays, strict=True))
        )
    state = (*(a.ctypes.data for a in arrays), state_kind)
    _call(load().HetjaxAdamHost, state, grad, coef, weight_decay, num_decay, out, page_elems)


def _host_update_int8(slabs, grad, coef, weight_decay, num_decay, out, page_elems) -> None:
    """:func:`host_update` with int8 moments (each codes and scales)."""
    n = out.size
    blocks = n // page_elems * -(-page_elems // INT8_BLOCK)
    p, m, v = (slabs[k] for k in KINDS)
    arrays = [(p, np.float32, n), (m.codes, np.int8, n), (m.scales, np.float32, blocks),
              (v.codes, np.int8, n), (v.scales, np.float32, blocks)]  # fmt: skip
    if any(
        not isinstance(a, np.ndarray) or a.dtype != d or a.size != size or not a.flags.writeable
        or not a.flags.c_contiguous
        for a, d, size in arrays
    ):  # fmt: skip
        raise ValueError(
            f"host_update: master (float32), mu and nu int8 blocks (codes int8, {blocks} "
            f"float32 scales) of {n} elements, writable and contiguous, not "
            + ", ".join(f"{a.size} {a.dtype}" for a, _, _ in arrays)
        )
    state = tuple(a.ctypes.data for a, _, _ in arrays)
    _call(load().HetjaxAdamInt8Host, state, grad, coef, weight_decay, num_decay, out, page_elems)


def _call(kernel, state, grad, coef, weight_decay, num_decay, out, page_elems) -> None:
    """One of the host entry points on ``state`` (its pointers and codes) and the rest
    of :func:`host_update`'s operands, checked."""
    n = out.size
    kind = _GRAD_KINDS.get(grad[0].dtype.name)
    grad_page = grad[0].size
    if (
        kind is None
        or any(g.dtype != grad[0].dtype or g.size != grad_page for g in grad)
        or not all(g.flags.c_contiguous for g in grad)
        or grad_page * len(grad) != n
    ):
        raise ValueError(
            f"host_update: the gradient must be contiguous float32 or bfloat16 pages of one "
            f"size covering {n} elements, not {len(grad)} of {grad_page} {grad[0].dtype}"
        )
    coef = np.ascontiguousarray(coef, np.float32)
    if n % page_elems:
        raise ValueError(f"host_update: {n} elements, pages of {page_elems}")
    base = out.ctypes.data
    pointers = (ctypes.c_void_p * (n // page_elems))(
        *range(base, base + n * out.itemsize, page_elems * out.itemsize)
    )
    grad_pointers = (ctypes.c_void_p * len(grad))(*(g.ctypes.data for g in grad))
    done = kernel(
        *state, grad_pointers, grad_page, kind, coef.ctypes.data,
        weight_decay, n, num_decay, page_elems, _OUT_KINDS[out.dtype.name], pointers,
        os.cpu_count() or 1,
    )  # fmt: skip
    if done != 0:
        raise ValueError(f"host_update: the kernel refused its operands (code {done})")


@functools.lru_cache(maxsize=1)
def _auto_available() -> bool:
    try:
        load()
    except (NativeKernelError, OSError) as e:
        warnings.warn(
            f"hetjax: the native Adam kernel is not used ({e}); optax runs instead", stacklevel=3
        )
        return False
    return True


def use_native(
    choice: str, optimizer: str, platform_name: str, state: StateFormat | None = None
) -> bool:
    """Whether an optimizer over state on ``platform_name`` runs the native kernel:
    ``choice`` is ``optimizer.host_kernel``, ``optimizer`` the optimizer's name (the
    config allows ``native`` for adam and adamw only). The kernel is the host's: state
    cached on a GPU (``offload.optimizer_device_stages``) is updated by optax there.
    ``state``: the optimizer's state format, where known; one the kernel cannot update
    (:func:`refusal`) runs optax, and with ``native`` raises ``NativeKernelError``."""
    if choice == "optax" or optimizer not in NATIVE_OPTIMIZERS or platform_name != "cpu":
        return False
    refused = refusal(state) if state is not None else None
    if refused is not None:
        if choice == "native":
            raise NativeKernelError(refused)
        return False
    if choice == "native":
        load()
        return True
    return _auto_available()
