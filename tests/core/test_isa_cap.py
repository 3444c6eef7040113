"""``KVCACHE_ISA`` caps the instruction set the C++ libraries are built for, so this machine tests
the code a CPU with less would run: the float decode library's tests (dense and paged decode
against SDPA, shared-prefix attention against per-row SDPA), the coded decode library's, its fp8
build's too (against attention over the dequantized keys and values; the fp8 build also under the
generic cap, which reads e4m3 bytes from a table instead of with F16C) and the panel linear library's (against float64
matrix products) pass when they are built for AVX2+FMA (the generic baseline on a CPU without
AVX2), in a fresh process whose extension folder holds only that cap's builds; where the CPU has
AVX-512 BF16, the panel library's and the bfloat16 attention library's bfloat16 tests pass built for
it without AMX, on their ``vdpbf16ps`` kernels.

A cap's folder lies in the libraries' cache (``capped-<isa>`` under ``$KVCACHE_EXTENSION_DIR`` or
``~/.cache/kvcache``), as the uncapped builds do: a library's name hashes its source, headers,
command and CPU flags, so a changed source builds anew there, and an unchanged one is not built
again by every run of the suite (the three capped builds took about 25 of this file's 67 s)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.attention import native, native_build
from kvcache.attention.native_build import ISA_ENV, cpu_flags

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")
#: AVX2+FMA where this CPU has it (the x86 machines without AVX-512), else the generic baseline.
CAPS = ["avx2"] if X86 and {"avx2", "fma"} <= set(cpu_flags().split()) else ["generic"]


def capped_folder(isa: str) -> Path:
    """Where the libraries built under cap ``isa`` go (``native_build``'s cache, one folder a cap)."""
    return native_build._cache_dir() / f"capped-{isa}"


def run(code_or_args: list[str], isa: str, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, ISA_ENV: isa, "KVCACHE_EXTENSION_DIR": str(folder), "OMP_NUM_THREADS": "1"}
    env.pop("KVCACHE_NO_EXTENSION", None)
    return subprocess.run([sys.executable, *code_or_args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("isa", CAPS)
def test_the_kernels_pass_their_tests_built_for_a_capped_isa(isa):
    folder = capped_folder(isa)
    done = run(["-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-W", "error::RuntimeWarning",
                "tests/core/test_native_decode.py", "tests/engine/test_shared_prefix.py", "tests/core/test_panels.py",
                "tests/core/test_fused_coded_decode.py", "tests/core/test_paged_coded_decode.py",
                "tests/core/test_fp8_codes.py", "-k", "not engine"], isa, folder)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("float_decode", "linear", "coded_decode", "coded_decode-kv_fp8"):
        assert list(folder.glob(f"{name}-*.so")), f"the {name} library was not built under the cap"


@pytest.mark.skipif(not X86, reason="the generic x86 build is the one without F16C")
def test_fp8_codes_read_through_the_table_where_the_build_has_no_f16c():
    """The generic x86-64-v2 build has no F16C: the fp8 build reads each byte from its table of
    e4m3 values instead, and passes the same tests."""
    folder = capped_folder("generic")
    done = run(["-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-W", "error::RuntimeWarning",
                "tests/core/test_fp8_codes.py", "-k", "not triton and not generation"], "generic", folder)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(folder.glob("coded_decode-kv_fp8-*.so"))


@pytest.mark.skipif(not X86 or "avx512_bf16" not in cpu_flags().split(), reason="this CPU has no AVX-512 BF16")
def test_the_bfloat16_dot_kernels_pass_their_tests_built_without_amx():
    """Built for AVX-512 BF16 without AMX (a Cooper Lake or Zen 4), the panel linear library and the
    bfloat16 attention library multiply on ``vdpbf16ps`` and pass their bfloat16 tests."""
    code = (
        "import sys, pytest\n"
        "from kvcache.attention import native\n"
        "from kvcache.hf import panels\n"
        "print('kernels:', panels.bf16_kernel(), native.bf16_attention_kernel())\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:randomly', '-p', 'no:cacheprovider', '-W', 'error::RuntimeWarning',\n"
        "                      'tests/core/test_panels.py', 'tests/engine/test_bf16_decode.py',\n"
        "                      'tests/engine/test_paged_prefill.py', '-k', '(bfloat16 or bf16_decode) and not engine']))\n"
    )
    done = run(["-c", code], "avx512bf16", capped_folder("avx512bf16"))
    assert done.returncode == 0 and "kernels: dot dot" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]


def test_an_unknown_isa_warns_and_the_pytorch_path_runs(tmp_path, monkeypatch):
    """In this process, with the libraries' per-process record emptied for the test (and put back
    after it): nothing built, one warning naming the valid caps, and the library reported absent,
    so callers take the PyTorch path."""
    monkeypatch.setenv(ISA_ENV, "avx9000")
    monkeypatch.setenv("KVCACHE_EXTENSION_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHE_NO_EXTENSION", raising=False)
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_failed", {})
    with pytest.warns(RuntimeWarning, match="KVCACHE_ISA='avx9000' is not one of"):
        assert not native.available()
    assert not list(tmp_path.glob("*.so"))


def test_a_changed_header_builds_the_library_anew(tmp_path, monkeypatch):
    """A library's name hashes the headers beside its source (``csrc/simd.h``), so a changed header
    is built and loaded, never an old library built against the header before it."""
    import ctypes

    monkeypatch.setenv("KVCACHE_EXTENSION_DIR", str(tmp_path / "built"))
    source, header = tmp_path / "probe.cpp", tmp_path / "probe.h"
    source.write_text('#include "probe.h"\nextern "C" int probe() { return PROBE; }\n')
    header.write_text("#define PROBE 1\n")
    first = native_build._build(source)
    header.write_text("#define PROBE 2\n")
    second = native_build._build(source)
    assert first != second
    assert ctypes.CDLL(str(first)).probe() == 1 and ctypes.CDLL(str(second)).probe() == 2
    assert native_build._build(source) == second  # unchanged: the same library, not built again
