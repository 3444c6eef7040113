"""Builds and loads the coded decode library (``csrc/coded_decode.cpp``) on first use.

The source has no Python or torch headers: one ``g++ -O3 -fopenmp -shared`` call, a second or two,
into a cache directory (``$KVCACHE_EXTENSION_DIR``, else ``$XDG_CACHE_HOME/kvcache`` or
``~/.cache/kvcache``), named by a hash of the source and the command, so a changed source or
compiler builds anew. The library picks its instruction set at run time (GCC ``target_clones``),
so a cache directory shared by machines with different CPUs stays valid. It is loaded with
``ctypes`` after torch, so its OpenMP calls resolve to the runtime torch already loaded.

``KVCACHE_NO_EXTENSION=1`` turns it off (the pure PyTorch path then runs); so does a failed
build, with one warning that says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "coded_decode.cpp"
DISABLE_ENV = "KVCACHE_NO_EXTENSION"
DIR_ENV = "KVCACHE_EXTENSION_DIR"
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-Wno-psabi"]

_loaded: ctypes.CDLL | None = None
_failed: str | None = None


def disabled() -> bool:
    """True when ``KVCACHE_NO_EXTENSION`` is set to anything but ``""``/``"0"``."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def library() -> ctypes.CDLL | None:
    """The loaded library, building it first if needed; None when disabled or when it cannot build."""
    global _loaded, _failed
    if disabled() or _failed is not None:
        return None
    if _loaded is None:
        try:
            _loaded = _declare(ctypes.CDLL(str(_build())))
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            _failed = str(err)
            warnings.warn(
                f"kvcache: the coded decode library did not build ({_failed.strip()[-500:]}); quantized caches "
                f"decode with the pure PyTorch path (set {DISABLE_ENV}=1 to skip the attempt)",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
    return _loaded


def _cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache"


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (g++ or c++ on PATH, or $CXX)")
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + repr((compiler, _FLAGS, sys.platform)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"coded_decode-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: a concurrent build or load never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if done.returncode:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_coded_key_scores.argtypes = [ptr] * 5 + [i64, i64, i32, i32, i32, i32, i64] + [i64] * 7 + [i64, i32]
    lib.kv_coded_key_scores.restype = i32
    lib.kv_coded_weighted.argtypes = [ptr] * 6 + [i64, i64, i32, i32, i32, i32, i64] + [i64] * 7 + [i64, i32]
    lib.kv_coded_weighted.restype = i32
    lib.kv_coded_max_rows.restype = lib.kv_coded_max_dim.restype = i32
    return lib
