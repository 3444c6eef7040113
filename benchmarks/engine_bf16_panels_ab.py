"""The eager engine in bfloat16 with and without the panel library's bfloat16 kernels, alternated in
one process: 16 requests of a shared 1,024-token prompt + a distinct 64-token turn, SmolLM2 in
bfloat16, 32 new tokens, greedy. "panels" lets ``PackedLinears`` multiply calls of up to
``BF16_PANEL_ROWS`` rows on panels; "oneDNN" sets that limit to 0 (oneDNN at every row count).

    .venv/bin/python benchmarks/engine_bf16_panels_ab.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcache import Engine
from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.workload import load_model
from kvcache.hf import linear_ops, panels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model, _, _ = load_model("smollm2")
    model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 20000, (1024,), generator=gen).tolist()
    prompts = [shared + torch.randint(100, 20000, (64,), generator=gen).tolist() for _ in range(16)]
    kernel = panels.bf16_kernel()
    limits = {"panels": linear_ops.BF16_PANEL_ROWS[kernel], "oneDNN": 0}

    def run(name: str) -> tuple[float, list[list[int]]]:
        linear_ops.BF16_PANEL_ROWS[kernel] = limits[name]
        linear_ops.panel_rows.cache_clear()
        engine = Engine(model, block_size=16, blocks=400, max_seqs=16)
        start = time.perf_counter()
        handles = [engine.submit(q, max_new_tokens=32, eos_token_id=[]) for q in prompts]
        engine.run()
        return time.perf_counter() - start, [h.result() for h in handles]

    print(f"{machine_line(machine_info())}; bfloat16 panel kernel: {kernel}")
    seconds: dict[str, list[float]] = {name: [] for name in limits}
    tokens: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        run("panels")  # warm-up
        for r in range(args.rounds):
            for name in limits:
                elapsed, tokens[name] = run(name)
                seconds[name].append(elapsed)
                print(f"round {r} {name}: {elapsed:.2f} s", flush=True)
    linear_ops.BF16_PANEL_ROWS[kernel] = limits["panels"]
    linear_ops.panel_rows.cache_clear()
    med = {name: statistics.median(s) for name, s in seconds.items()}
    same = sum(a == b for a, b in zip(tokens["panels"], tokens["oneDNN"]))
    print(f"medians: panels {med['panels']:.2f} s, oneDNN {med['oneDNN']:.2f} s, "
          f"{med['oneDNN'] / med['panels']:.2f}x; answers the same: {same}/{len(prompts)}")  # fmt: skip


if __name__ == "__main__":
    main()
