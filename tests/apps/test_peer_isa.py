"""``benchmarks/vllm_engine.py --isa avx2``: the peer's processes see a CPU without AVX-512.

vLLM picks its kernels by ``torch.cpu.get_capabilities``; the ``sitecustomize`` that
``vllm_bench_serve.vllm_isa_env`` writes must hide every AVX-512 and AMX flag from that map in a
new Python process and leave every other flag as the CPU reports it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_bench_serve.py"
PROBE = "import json, torch.cpu; print(json.dumps({k: v for k, v in torch.cpu.get_capabilities().items()}))"


def _bench_module():
    spec = importlib.util.spec_from_file_location("vllm_bench_serve_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _capabilities(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATEN_CPU_CAPABILITY")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_native_adds_nothing(tmp_path):
    assert _bench_module().vllm_isa_env("native", tmp_path) == {}
    assert list(tmp_path.iterdir()) == []


def test_avx2_hides_avx512_and_amx_only(tmp_path):
    bench = _bench_module()
    env = bench.vllm_isa_env("avx2", tmp_path)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    plain, capped = _capabilities({}), _capabilities(env)
    assert plain.keys() == capped.keys()
    hidden = [k for k in plain if k.startswith(("avx512", "amx", "avx10"))]
    assert all(capped[k] is False for k in hidden)
    assert all(capped[k] == plain[k] for k in plain if k not in hidden)
