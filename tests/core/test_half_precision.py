"""The half-precision check (kvcache.attention.half_precision), its use by the CLI and by this suite's conftest.

A CPU whose oneDNN AMX kernels kill bfloat16 matmul cannot be summoned here, so the probe's test
hook (``KVCACHE_HALF_PROBE_FAULT``) stands in for one: ``uncapped`` kills the probe unless oneDNN is
capped, ``always`` kills it either way, with a real SIGILL in the child. The capped probe otherwise
runs real half-precision matmuls, which work on every machine this suite supports (that is what the
cap is for).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.apps.cli import main
from kvcache.attention.half_precision import FAULT_ENV, ISA_ENV, SAFE_ISA, HalfPrecision, half_precision_support, use_safe_isa

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fault(monkeypatch):
    """Set the hook; the cap is cleared for the test and whatever it was comes back afterwards."""
    monkeypatch.delenv(ISA_ENV, raising=False)

    def set_fault(kind: str) -> None:
        monkeypatch.setenv(FAULT_ENV, kind)

    return set_fault


def test_a_cpu_that_needs_the_cap_is_found_and_use_safe_isa_sets_it(fault):
    fault("uncapped")
    found = half_precision_support()
    assert found.status is HalfPrecision.NEEDS_ISA_CAP
    assert "SIGILL" in found.detail and f"{ISA_ENV}={SAFE_ISA}" in found.describe()
    assert use_safe_isa() == found
    assert os.environ[ISA_ENV] == SAFE_ISA


def test_a_cpu_where_nothing_helps_is_broken_and_nothing_is_set(fault):
    fault("always")
    found = use_safe_isa()
    assert found.status is HalfPrecision.BROKEN
    assert "killed by SIGILL" in found.describe() and "use float32" in found.describe()
    assert ISA_ENV not in os.environ


def test_a_cap_the_user_set_is_probed_as_it_is(fault, monkeypatch):
    fault("always")
    monkeypatch.setenv(ISA_ENV, "AVX2")
    found = use_safe_isa()
    assert found.status is HalfPrecision.BROKEN
    assert f"with {ISA_ENV}=AVX2" in found.detail
    assert os.environ[ISA_ENV] == "AVX2"


@pytest.mark.half_precision
def test_a_working_cpu_reads_as_working():
    found = half_precision_support()  # this process runs half-precision tests: it works here
    assert found.status is HalfPrecision.WORKS and found.detail == ""


def generate(*extra: str) -> list[str]:
    return ["generate", "--prompt", "The cat", "--max-new-tokens", "2", *extra]


def test_cli_refuses_half_precision_where_it_would_crash(fault, capsys):
    fault("always")
    assert main(generate("--dtype", "bfloat16")) == 2
    err = capsys.readouterr().err
    assert "kvcache: error: --model" in err and "in bfloat16" in err and "--dtype float32" in err
    assert ISA_ENV not in os.environ


def test_cli_caps_onednn_and_says_so_where_the_cap_helps(fault, capsys):
    fault("uncapped")
    assert main(generate("--dtype", "float16")) == 0
    err = capsys.readouterr().err
    assert "kvcache: note: " in err and f"{ISA_ENV}={SAFE_ISA}; set for this run" in err
    assert os.environ[ISA_ENV] == SAFE_ISA


def test_cli_in_float32_does_not_probe(fault, capsys):
    fault("always")  # a probe would refuse: float32 never asks
    assert main(generate("--dtype", "float32")) == 0
    assert "half" not in capsys.readouterr().err


def test_suite_skips_half_precision_tests_with_the_reason_where_nothing_helps():
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV} | {FAULT_ENV: "always"}
    tests = ("test_bf16_inputs", "test_empty_query_and_empty_keys_like_sdpa")
    selected = [f"tests/core/test_attention.py::{name}" for name in tests]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-rs", *selected],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    assert "half precision: bfloat16/float16 matmul crashes on this CPU (killed by SIGILL)" in out  # header
    assert "1 passed, 1 skipped" in out
    assert "SKIPPED [1] tests/core/test_attention.py" in out and "use float32" in out
