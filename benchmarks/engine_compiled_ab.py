"""``Engine(compile=True)`` against the same engine eager, on ``vllm_engine.py``'s shared-prefix
workload (16 requests: a 1,024-token system prompt + a distinct 64-token turn, 32 new tokens,
SmolLM2-135M-Instruct fp32, greedy), alternated round by round in one process.

Both engines live for the whole run; each round resets their prefix caches, runs the same
2-request warm-up, resets again and times ``generate_batch``. The compiled engine's buckets up to
16 rows are compiled first (``warm_up``, timed apart). Prints tokens/s, the steps that ran
compiled, whether both gave the same tokens, and per engine the median time of its decode and
prompt steps (the last round, step by step).

    .venv/bin/python benchmarks/engine_compiled_ab.py [--rounds 2] [--rows 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_engine import text_ids, workloads

import kvcache
from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.workload import load_model


def timed_steps(engine: kvcache.Engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]], list[tuple[float, bool]]]:
    """Seconds for ``prompts`` through ``engine``, their tokens, and each step's (seconds, whether
    every row decoded one token: as many tokens as requests running, none waiting)."""
    handles = [engine.submit(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
    steps = []
    started = time.perf_counter()
    while True:
        tokens, running, waiting = engine.stats.forward_tokens, engine.running_count, engine.waiting_count
        t = time.perf_counter()
        if not engine.step():
            break
        steps.append((time.perf_counter() - t, not waiting and engine.stats.forward_tokens - tokens == running))
    return time.perf_counter() - started, [h.result() for h in handles], steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args()
    print(machine_line(machine_info()))
    model, tokenizer, _ = load_model("smollm2")
    started = time.perf_counter()
    compiled = kvcache.Engine(model, max_seqs=max(32, args.rows), compile=True)
    compiled.warm_up(args.rows)
    print(f"compiled buckets up to {args.rows} rows: {time.perf_counter() - started:.0f} s, {compiled.graph.graphs} graphs")
    engines = {"eager": kvcache.Engine(model, max_seqs=max(32, args.rows)), "compiled": compiled}
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        prompts = workloads(tokenizer, args.rows, rnd, ("shared",))["shared"]
        warmup = [text_ids(tokenizer, 200, 9000 + rnd + i) for i in range(2)]
        tokens = {}
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            engine.generate_batch(warmup, max_new_tokens=args.new, eos_token_id=[])
            engine.reset_prefix_cache()
            seconds, tokens[name], steps = timed_steps(engine, prompts, args.new)
            speeds[name].append(len(prompts) * args.new / seconds)
            decode, prompt = [s for s, d in steps if d], [s for s, d in steps if not d]
            print(f"round {rnd} {name}: {speeds[name][-1]:.1f} tokens/s; {len(decode)} decode steps, median "
                  f"{1000 * statistics.median(decode):.0f} ms ({engine.stats.compiled_steps} compiled so far); "
                  f"{len(prompt)} steps with prompt tokens, {sum(prompt):.2f} s in all", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"]))
        print(f"round {rnd}: the same tokens for {same}/{len(prompts)} requests", flush=True)
    e, c = statistics.median(speeds["eager"]), statistics.median(speeds["compiled"])
    print(f"medians: eager {e:.1f} tokens/s, compiled {c:.1f} ({c / e:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
