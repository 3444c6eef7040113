"""Builds and loads the project's small C++ libraries (``csrc/*.cpp``) on first use.

The sources have no Python or torch headers (but ``step_ops.cpp``, on torch's stable C ABI,
``torch_abi``): one ``g++ -O3 -march=native -fopenmp -shared`` call
(``-march`` as ``KVCACHE_ISA`` says, below),
a second or two, into a cache directory (``$KVCACHE_EXTENSION_DIR``, else ``$XDG_CACHE_HOME/kvcache``
or ``~/.cache/kvcache``), named by a hash of the source, the headers beside it (``csrc/*.h``), the
command and this CPU's instruction-set flags, so a changed source, header, compiler or CPU builds anew. A library is loaded with ``ctypes`` after
torch, so its OpenMP calls resolve to the runtime torch already loaded.

A source may be built more than once with macros defined (``library(..., defines=...)``): the coded
library's fp8 build is ``coded_decode.cpp`` with ``KV_FP8``, a library of its own.

``KVCACHE_NO_EXTENSION=1`` turns every library off (the pure PyTorch paths then run); so does a
failed build, with one warning that says why.

``KVCACHE_ISA`` caps the instruction set the libraries are built for, so that a machine with
AVX-512 can build, test and time the code another CPU would run: ``native`` (the default, every
extension this CPU has), ``avx512bf16`` (Cooper Lake: x86-64-v4 with AVX-512 BF16, no AMX),
``avx512`` (x86-64-v4: AVX-512 F/BW/CD/DQ/VL), ``avx2`` (x86-64-v3: AVX2,
FMA), ``generic`` (x86-64-v2 on x86, Armv8-A NEON on Arm). A cap this CPU cannot run, or an unknown
name, fails the build (one warning; the PyTorch paths run).
"""

from __future__ import annotations

import ctypes
import functools
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
ISA_ENV = "KVCACHE_ISA"
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-Wno-psabi"]
#: ``KVCACHE_ISA`` -> (the -march of x86-64, of Arm, the CPU flags it needs on x86).
_ISAS: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {
    "native": ("native", "native", ()),
    "avx512bf16": ("cooperlake", None, ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16")),
    "avx512": ("x86-64-v4", None, ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    "avx2": ("x86-64-v3", None, ("avx2", "fma")),
    "generic": ("x86-64-v2", "armv8-a", ()),
}

_loaded: dict[str, ctypes.CDLL] = {}
_failed: dict[str, str] = {}


def disabled() -> bool:
    """True when ``KVCACHE_NO_EXTENSION`` is set to anything but ``""``/``"0"``."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def library(
    name: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL], torch_abi: bool = False, defines: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.cpp``, with its functions' types set by ``declare``;
    None when disabled or when it cannot build (warned once). ``torch_abi``: the source uses
    torch's stable C ABI (``torch/csrc/stable``) and links torch's own libraries; loading it
    registers the operator kernels it declares. ``defines``: macros defined for this build (each
    set of them a library of its own)."""
    key = "+".join((name, *defines))
    if disabled() or key in _failed:
        return None
    if key not in _loaded:
        try:
            _loaded[key] = declare(ctypes.CDLL(str(_build(CSRC / f"{name}.cpp", torch_abi, defines))))
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            _failed[key] = str(err)
            warnings.warn(
                f"kvcache: the {key} library did not build ({_failed[key].strip()[-500:]}); the pure PyTorch "
                f"path runs instead (set {DISABLE_ENV}=1 to skip the attempt)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
    return _loaded[key]


def _cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache"


def _cpuinfo_line(*keys: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of ``keys``, or None (none, or no file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """This CPU's instruction-set flags (``-march=native`` code runs only where they hold)."""
    return _cpuinfo_line("flags", "Features") or platform.processor() or platform.machine()


@functools.cache
def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``), or "" where /proc/cpuinfo says none."""
    line = _cpuinfo_line("vendor_id")
    return "" if line is None else line.split(":", 1)[1].strip()


def isa() -> str:
    """The instruction set the libraries are built for: ``KVCACHE_ISA``, else ``"native"``."""
    return os.environ.get(ISA_ENV, "").strip().lower() or "native"


def _march() -> str:
    """The ``-march=`` flag for ``isa()``; RuntimeError for a name not known or a cap this CPU
    cannot run."""
    name = isa()
    if name not in _ISAS:
        raise RuntimeError(f"{ISA_ENV}={name!r} is not one of {', '.join(_ISAS)}")
    x86, arm, needs = _ISAS[name]
    on_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    arch = x86 if on_x86 else arm
    if arch is None:
        raise RuntimeError(f"{ISA_ENV}={name} is an x86 instruction set; this machine is {platform.machine()}")
    flags = set(cpu_flags().split())
    missing = [f for f in needs if f not in flags]
    if missing:
        raise RuntimeError(f"{ISA_ENV}={name} needs CPU flags this CPU lacks: {', '.join(missing)}")
    return f"-march={arch}"


def _torch_flags() -> list[str]:
    """The include, link and load-path flags of a library on torch's stable C ABI, for the torch
    this process runs."""
    import torch

    root = Path(torch.__file__).resolve().parent
    lib = root / "lib"
    return [f"-I{root / 'include'}", f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]


def _torch_version() -> str:
    """The version of the torch this process runs (part of a torch-ABI library's tag)."""
    import torch

    return torch.__version__


def _build(source_path: Path, torch_abi: bool = False, defines: tuple[str, ...] = ()) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (g++ or c++ on PATH, or $CXX)")
    flags = [*_FLAGS, _march(), *(f"-D{d}" for d in defines)]
    # The headers beside the sources (simd.h) count as part of each: a changed header builds anew.
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    built_for = (compiler, flags, sys.platform, cpu_flags())
    extra = _torch_flags() if torch_abi else []
    if torch_abi:  # another torch builds anew
        built_for += (extra, _torch_version())
    tag = hashlib.sha256(source + repr(built_for).encode()).hexdigest()[:16]
    stem = "-".join((source_path.stem, *(d.lower() for d in defines)))
    target = _cache_dir() / f"{stem}-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: a concurrent build or load never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        # the torch flags after the source: the linker resolves left to right
        done = subprocess.run([compiler, *flags, str(source_path), "-o", tmp, *extra], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
