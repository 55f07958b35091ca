"""The tests' persistent compilation cache, one directory shared by every process of a
run (issue #56 item 3): the pytest-xdist workers (they inherit the controller's
``JAX_COMPILATION_CACHE_DIR``, tests/conftest.py), the child processes of the crash and
multi-process tests, and CI's legs one after another (the slow suite starts with the
default run's programs).

JAX 0.10's cache (``jax._src.lru_cache.LRUCache``) without a size limit takes no lock and
writes an entry in place (``Path.write_bytes``): a process reading it meanwhile reads a
truncated entry (zlib refuses it: a warning and a compile), and two processes writing
one key at once can leave a mixed one that every later run warns about and compiles
anew. :func:`write_entries_whole` makes this process's writes whole: a temporary file,
then a rename. (With a size limit, ``jax_compilation_cache_max_size``, JAX locks the
directory for every read and write and, for every write, reads the access time of
every entry to evict: the quadratic cost that made the 2026-11-26 trial of a shared,
limited cache slower. The tests' cache has no limit: .pytest_cache is the user's to
clear.)
"""

from __future__ import annotations

import os
import threading


def write_entries_whole() -> bool:
    """Patches JAX's unlimited cache to write each entry to a temporary file and rename
    it into place; False (nothing patched) where JAX's cache is not the one this was
    written against."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cache = getattr(lru_cache, "LRUCache", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if cache is None or suffix is None or not hasattr(cache, "put"):
        return False
    if getattr(cache.put, "writes_whole", False):
        return True
    put = cache.put

    def whole_put(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not key:
            return put(self, key, value)  # locked by JAX itself
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return None
        tmp = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(value)
        os.replace(tmp, path)  # another process's same key: either whole entry
        return None

    whole_put.writes_whole = True
    cache.put = whole_put
    return True
