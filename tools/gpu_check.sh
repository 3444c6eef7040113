#!/usr/bin/env bash
# The prepared GPU check (issue 42), for a lent CUDA machine: no network, a small working tree, an
# image with torch, triton and transformers but maybe not pytest (tools/gpu_wheels.sh fetches the
# wheels it lacks into tools/wheels, which travels with the tree). Runs, within about 10 minutes:
#   1. the device line and versions                      -> $OUT/env.txt
#   2. every cuda-marked test (the Triton kernels compiled on the device against PyTorch, and the
#      library's device paths end to end)                 -> $OUT/tests.txt
#   3. tools/gpu_sweep.py (the kernel's launches, SDPA)     -> $OUT/sweep.{json,md}
#   4. kvcache bench gpu --quick (may not finish)          -> $OUT/gpu.{json,md}, $OUT/bench.log
# OUT defaults to benchmarks/results/gpu (the device tool sets $OUT to the folder that comes back).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONDONTWRITEBYTECODE=1
if ! python -c "import pytest" 2>/dev/null && [ -d tools/wheels ]; then
  pip install -q --no-index --find-links tools/wheels pytest >"$OUT/pip.txt" 2>&1
fi
if ! python -c "from transformers.cache_utils import DummyLayer" 2>/dev/null && ls tools/wheels/transformers-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps tools/wheels/{transformers,huggingface_hub,httpx2,httpcore2,truststore}-*.whl >>"$OUT/pip.txt" 2>&1
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('transformers', transformers.__version__)"
  python -c "import triton; print('triton', triton.__version__)" 2>&1
  git log --oneline -1 2>/dev/null
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 150 python -m pytest -q -p no:randomly -p no:cacheprovider -m cuda -rs \
  tests/core/test_triton_decode.py tests/core/test_triton_route.py >"$OUT/tests.txt" 2>&1
echo "tests: rc=$? $(tail -1 "$OUT/tests.txt")"
timeout 150 python tools/gpu_sweep.py >"$OUT/sweep.log" 2>&1
echo "sweep: rc=$? (see $OUT/sweep.md)"
timeout 330 python -m kvcache bench gpu --quick --out "$OUT" >"$OUT/bench.log" 2>&1
echo "bench: rc=$? (see $OUT/bench.log, $OUT/gpu.md)"
tail -5 "$OUT/bench.log"
