"""``kvcache.Engine.generate_batch`` against vLLM's ``LLM.generate`` (its CPU build) on issue 40's
engine workloads, alternated round by round, each contender alone on the machine.

Workloads (SmolLM2-135M-Instruct fp32, greedy, 32 new tokens, the same token ids for both):

- ``shared``: 16 requests = one shared 1,024-token system prompt + a distinct 64-token turn;
- ``distinct``: 16 distinct ~1,088-token prompts (no shared prefix; mostly prefill);
- ``long``: 8 distinct ~4,096-token prompts.

``--rows`` sets the request count of ``shared`` and ``distinct`` (``long`` takes half as many).

kvcache's one ``Engine`` (``compile=True`` unless ``--eager``; its decode buckets up to ``--rows``
compiled before the first round, as vLLM compiles its own when it starts) and vLLM's one ``LLM``
(one child process for the whole run, idle while kvcache runs) each run every workload with their
prefix caches reset (``reset_prefix_cache``) after the same 2-request warm-up, the two alternating
workload by workload (which goes first alternates too), so that the machine's drifts in speed fall
on both. vLLM runs in its own environment (see ``vllm_bench_serve.py``), configured as its CPU
documentation says for a 2-core machine: both cores bound to its OpenMP threads
(``VLLM_CPU_OMP_THREADS_BIND=0-1``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), prefix caching on,
a 4 GiB KV space (kvcache's pool is given the same bytes, ``max_bytes``), ``dtype=float32`` unless ``--vllm-dtype`` says otherwise (``default``: vLLM's own
choice, bfloat16 on CPUs with avx512_bf16). ``--dtype`` runs kvcache's model in bfloat16 (with
oneDNN capped below AMX where this torch needs it, ``use_safe_isa``, in kvcache's process only).
``--isa avx2`` runs both as a CPU without AVX-512 would: kvcache's libraries built for AVX2
(``KVCACHE_ISA``), torch's kernels, inductor's code, oneDNN and MKL capped at AVX2 in both
processes, and vLLM's ``_C_AVX2`` kernels and AVX2 attention (``vllm_bench_serve.HIDE_AVX512``).

    .venv/bin/python benchmarks/vllm_engine.py --vllm-python /tmp/vllm/bin/python --out DIR [--rounds 3] \\
        [--rows 16] [--workloads shared,distinct,long] [--dtype bfloat16] [--vllm-dtype default] [--eager] [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_bench_serve import AVX2_ENV, VLLM_ENV, vllm_isa_env  # vLLM configured once, for both benchmarks

#: Bytes of K/V each contender holds: vLLM's ``VLLM_CPU_KVCACHE_SPACE`` (GiB), kvcache's pool (``max_bytes``).
KV_SPACE = int(VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"]) << 30

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()

VLLM_SIDE = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, dtype, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=8192, seed=0, **({} if dtype == "default" else {"dtype": dtype}))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    print("READY", str(llm.llm_engine.model_config.dtype).removeprefix("torch."), flush=True)
    for line in sys.stdin:  # one job a line: {"warmup": [...], "prompts": [...], "out": path}
        job = json.loads(line)
        llm.reset_prefix_cache()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["warmup"]], params, use_tqdm=False)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        json.dump({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(job["out"], "w"))
        print("DONE", job["out"], flush=True)
'''


class VLLMWorker:
    """vLLM's one ``LLM`` in a child process of its own environment for the whole run (as kvcache's
    engine is kept): each ``run`` sends one workload and waits for its result; idle between runs."""

    def __init__(self, python: str, scratch: Path, folder: Path, dtype: str, new: int, env: dict[str, str]):
        (scratch / "vllm_side.py").write_text(VLLM_SIDE)
        self.scratch, self.log = scratch, open(scratch / "vllm.log", "w")
        self.proc = subprocess.Popen([python, str(scratch / "vllm_side.py"), str(folder), dtype, str(new)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)  # fmt: skip
        self.dtype = self._wait("READY")

    def _wait(self, marker: str) -> str:
        for line in self.proc.stdout:  # vLLM may print lines of its own here too
            if line.startswith(marker + " "):
                return line.split(" ", 1)[1].strip()
        self.log.flush()
        raise RuntimeError(f"vLLM's worker ended ({self.proc.wait()}): {(self.scratch / 'vllm.log').read_text()[-3000:]}")

    def run(self, prompts: list[list[int]], warmup: list[list[int]], tag: str) -> dict:
        out = self.scratch / f"{tag}.json"
        self.proc.stdin.write(json.dumps({"warmup": warmup, "prompts": prompts, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        self._wait("DONE")
        return json.loads(out.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def text_ids(tokenizer, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return tokenizer(" ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(count)))["input_ids"][:count]


WORKLOADS = ("shared", "distinct", "long")


def workloads(tokenizer, rows: int, seed: int, names: tuple[str, ...] = WORKLOADS) -> dict[str, list[list[int]]]:
    prefix = text_ids(tokenizer, 1024, 1) if "shared" in names else []
    made = {
        "shared": lambda: [prefix + text_ids(tokenizer, 64, 1000 * seed + r) for r in range(rows)],
        "distinct": lambda: [text_ids(tokenizer, 1088, 2000 * seed + r) for r in range(rows)],
        "long": lambda: [text_ids(tokenizer, 4096, 3000 * seed + r) for r in range(max(1, rows // 2))],
    }
    return {name: made[name]() for name in names}


def ours(engine, prompts: list[list[int]], warmup: list[list[int]], new: int) -> dict:
    """One workload through ``engine`` (kept for every round, as vLLM keeps its ``LLM``), after the
    warm-up, its cached prefixes forgotten before the warm-up and before the timed run."""
    engine.reset_prefix_cache()
    engine.generate_batch(warmup, max_new_tokens=new, eos_token_id=[])
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    tokens = engine.generate_batch(prompts, max_new_tokens=new, eos_token_id=[])
    return {"seconds": time.perf_counter() - t0, "tokens": [list(map(int, t)) for t in tokens]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--workloads", default="shared,distinct", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="kvcache's model dtype")
    p.add_argument("--eager", action="store_true", help="kvcache's engine without compile=True")
    p.add_argument("--isa", default="native", choices=("native", "avx2"),
                   help="avx2: both contenders as on a CPU without AVX-512 (every library capped at AVX2)")
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "default"),
                   help="vLLM's dtype; default: what vLLM picks itself (bfloat16 on CPUs with avx512_bf16)")
    args = p.parse_args()
    names = tuple(args.workloads.split(","))
    if unknown := [n for n in names if n not in WORKLOADS]:
        p.error(f"unknown workloads {unknown}; expected some of {', '.join(WORKLOADS)}")
    capped = {**AVX2_ENV, "KVCACHE_ISA": "avx2"}
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in capped.items()):
        # torch reads its caps when it starts (this process imported it already): run again under them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **capped})
    from kvcache.apps.bench.workload import load_model

    model, tokenizer, folder = load_model("smollm2")
    vllm_env = {**os.environ, **VLLM_ENV}  # vLLM's own environment, before any cap of ours
    if args.dtype != "float32":
        import torch

        from kvcache.attention import use_safe_isa

        print(f"half precision on this CPU: {use_safe_isa().describe()}", flush=True)  # (AMX: oneDNN capped)
        model = model.to(getattr(torch, args.dtype))
    from kvcache.apps.bench.common import machine_info, machine_line
    import kvcache

    started = time.perf_counter()
    # the KV space vLLM is given (VLLM_CPU_KVCACHE_SPACE), so that neither side queues for blocks the other has
    engine = kvcache.Engine(model, max_seqs=max(32, args.rows), compile=not args.eager, max_bytes=KV_SPACE)
    engine.warm_up(args.rows)  # vLLM compiles its batch sizes when it starts, too
    print(f"kvcache's engine ({'eager' if args.eager else 'compiled'}) ready in {time.perf_counter() - started:.0f} s", flush=True)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    held = tempfile.TemporaryDirectory()  # vLLM's side, its log and its results: inputs, not results
    scratch = Path(held.name)
    vllm_env.update(vllm_isa_env(args.isa, scratch))
    started = time.perf_counter()
    vllm = VLLMWorker(args.vllm_python, scratch, folder, args.vllm_dtype, args.new, vllm_env)
    print(f"vLLM ({vllm.dtype}) ready in {time.perf_counter() - started:.0f} s", flush=True)
    rows: list[dict] = []
    try:
        for rnd in range(args.rounds):
            prompts = workloads(tokenizer, args.rows, rnd, names)
            warmup = [text_ids(tokenizer, 200, 9000 + rnd + i) for i in range(2)]
            for i, name in enumerate(names):  # contenders alternate workload by workload, first one then the other
                order = ("kvcache", "vllm") if (rnd + i) % 2 == 0 else ("vllm", "kvcache")
                batch = prompts[name]
                jobs = {"kvcache": lambda: ours(engine, batch, warmup, args.new),
                        "vllm": lambda: vllm.run(batch, warmup, f"{name}{rnd}")}
                got = {who: jobs[who]() for who in order}
                (out / f"{name}{rnd}.json").write_text(json.dumps({"order": order, **got}) + "\n")
                a, b = got["kvcache"], got["vllm"]
                tokens = len(batch) * args.new
                row = {"round": rnd, "workload": name, "requests": len(batch), "first": order[0],
                       "kvcache": tokens / a["seconds"], "vllm": tokens / b["seconds"],
                       "agree": sum(x == y for x, y in zip(a["tokens"], b["tokens"]))}  # fmt: skip
                rows.append(row)
                print(f"round {rnd} {name}: kvcache {row['kvcache']:.1f} tokens/s, vLLM {row['vllm']:.1f}, "
                      f"identical {row['agree']}/{row['requests']} ({order[0]} first)", flush=True)  # fmt: skip
    finally:
        vllm.close()
    capped_line = "; both contenders capped at AVX2 (--isa avx2)" if args.isa == "avx2" else ""
    lines = [f"{machine_line(machine_info())}{capped_line}; {args.rounds} rounds, medians, the contenders alternating "
             f"workload by workload; kvcache in {args.dtype} "
             f"({'eager' if args.eager else 'compile=True'}), "
             f"vLLM in {vllm.dtype} (asked: {args.vllm_dtype})", "",
             "| workload | requests | kvcache tokens/s | vLLM tokens/s | kvcache / vLLM | rounds' ratios | identical answers |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in names:
        mine = [r for r in rows if r["workload"] == name]
        k, v = statistics.median(r["kvcache"] for r in mine), statistics.median(r["vllm"] for r in mine)
        agree, asked = sum(r["agree"] for r in mine), sum(r["requests"] for r in mine)
        ratios = ", ".join(f"{r['kvcache'] / r['vllm']:.2f}" for r in mine)
        lines.append(f"| {name} | {mine[0]['requests']} | {k:.1f} | {v:.1f} | {k / v:.2f}x | {ratios} | {agree}/{asked} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "rounds.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
