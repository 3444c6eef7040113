"""``kvcache bench gpu``: its code runs at toy sizes on the CPU (``--tiny``; the C++ kernels stand in
for Triton), every contender of every part gives a row with numbers, the kernels agree with SDPA's
answer, and without a CUDA device a real run refuses, saying so; and ``tools/gpu_sweep.py``'s table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvcache.apps.bench import gpu
from kvcache.apps.run_options import RunOptions
from kvcache.errors import KVCacheError


def test_a_tiny_run_gives_every_row_with_numbers_and_the_same_tokens(tmp_path):
    result = gpu.run(RunOptions(tiny=True, progress=False, out=tmp_path))
    rows = result["rows"]
    failed = [r for r in rows if "reason" in r and r["contender"] != "static-compiled"]
    assert not failed, failed
    compiled = [r for r in rows if r["contender"] == "static-compiled"]
    assert compiled and all(r["reason"] == "CUDA graphs need a CUDA device" for r in compiled)
    kernels = {r["contender"] for r in rows if r["part"] == "kernel"}
    assert kernels == {"sdpa", "views", "paged", "paged-int8", "paged-int4", "paged-fp8"}
    steps = [r for r in rows if r["part"] == "step"]
    assert {r["contender"] for r in steps} == {"dynamic", "kvcache", "static", "static-compiled"}
    assert all(r["same_tokens_as_dynamic"] for r in steps if "reason" not in r)
    engine = [r for r in rows if r["part"] == "engine"]
    assert {r["contender"] for r in engine} == {"kvcache-engine", "transformers-generate_batch"}
    assert all(r["tokens_per_s"] > 0 for r in engine)
    assert (tmp_path / "gpu.md").read_text().startswith("GPU suite on cpu")


def test_the_kernel_calls_agree_with_sdpa():
    gen = torch.Generator().manual_seed(0)
    calls = gpu._kernel_calls(torch.device("cpu"), torch.float32, 2, 100, gen)
    reference = calls["sdpa"][0]().reshape(2, gpu.KV_HEADS, -1, gpu.HEAD_DIM)
    for name in ("views", "paged"):
        torch.testing.assert_close(calls[name][0]().reshape(reference.shape), reference, rtol=1e-5, atol=1e-5)
    for name in ("paged-int8", "paged-int4", "paged-fp8"):  # codes: near, not equal
        err = (calls[name][0]().reshape(reference.shape) - reference).abs().max().item()
        assert 0 < err < {"paged-int8": 0.05, "paged-fp8": 0.1, "paged-int4": 0.5}[name], (name, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_real_run_needs_a_cuda_device():
    with pytest.raises(KVCacheError, match="CUDA device"):
        gpu.run(RunOptions(progress=False))


def test_the_launch_sweep_table_gives_bytes_and_the_speed_up_over_float_paged(tmp_path):
    """``tools/gpu_sweep.py``'s table (it runs on a GPU only; its writer is plain): MB read, and each
    row's time over float paged blocks' default launch at the same rows and tokens."""
    spec = importlib.util.spec_from_file_location("gpu_sweep", Path(__file__).resolve().parents[2] / "tools" / "gpu_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    rows = [
        {"batch": 16, "tokens": 4096, "way": "paged", "launch": "64/4/2/-", "ms": 2.0, "bytes": 4e8, "share": 0.5, "default": True, "error": 0.0},
        {"batch": 16, "tokens": 4096, "way": "paged", "launch": "32/4/2/-", "ms": 4.0, "bytes": 4e8, "share": 0.25, "default": False, "error": 0.0},
        {"batch": 16, "tokens": 4096, "way": "paged-int8", "launch": "64/4/1/-", "ms": 1.0, "bytes": 2e8, "share": 0.5, "default": True, "error": 0.0},
        {"batch": 1, "tokens": 1024, "way": "paged-int8", "launch": "64/4/1/-", "reason": "OutOfResources()"},
    ]
    sweep.write(tmp_path, rows, 4e11, gpu_name="a test GPU")
    lines = (tmp_path / "sweep.md").read_text().splitlines()
    assert "| MB read |" in lines[2] and "| x paged float |" in lines[2]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [c[5] for c in cells] == ["400.0", "400.0", "200.0", ""]
    assert [c[7] for c in cells] == ["1.00x", "0.50x", "2.00x", ""]  # no float row at 1 x 1K: no speed-up
    assert json.loads((tmp_path / "sweep.json").read_text())["gpu"] == "a test GPU"
