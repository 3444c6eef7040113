"""Builds and loads the project's small C++ libraries (``csrc/*.cpp``) on first use.

The sources have no Python or torch headers: one ``g++ -O3 -march=native -fopenmp -shared`` call,
a second or two, into a cache directory (``$KVCACHE_EXTENSION_DIR``, else ``$XDG_CACHE_HOME/kvcache``
or ``~/.cache/kvcache``), named by a hash of the source, the command and this CPU's instruction-set
flags, so a changed source, compiler or CPU builds anew. A library is loaded with ``ctypes`` after
torch, so its OpenMP calls resolve to the runtime torch already loaded.

``KVCACHE_NO_EXTENSION=1`` turns every library off (the pure PyTorch paths then run); so does a
failed build, with one warning that says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
DISABLE_ENV = "KVCACHE_NO_EXTENSION"
DIR_ENV = "KVCACHE_EXTENSION_DIR"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-Wno-psabi"]

_loaded: dict[str, ctypes.CDLL] = {}
_failed: dict[str, str] = {}


def disabled() -> bool:
    """True when ``KVCACHE_NO_EXTENSION`` is set to anything but ``""``/``"0"``."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def library(name: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL]) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.cpp``, with its functions' types set by ``declare``;
    None when disabled or when it cannot build (warned once)."""
    if disabled() or name in _failed:
        return None
    if name not in _loaded:
        try:
            _loaded[name] = declare(ctypes.CDLL(str(_build(CSRC / f"{name}.cpp"))))
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            _failed[name] = str(err)
            warnings.warn(
                f"kvcache: the {name} library did not build ({_failed[name].strip()[-500:]}); the pure PyTorch "
                f"path runs instead (set {DISABLE_ENV}=1 to skip the attempt)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
    return _loaded[name]


def _cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache"


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (``-march=native`` code runs only where they hold)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(source_path: Path) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (g++ or c++ on PATH, or $CXX)")
    source = source_path.read_bytes()
    tag = hashlib.sha256(source + repr((compiler, _FLAGS, sys.platform, _cpu_flags())).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: a concurrent build or load never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(source_path), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
