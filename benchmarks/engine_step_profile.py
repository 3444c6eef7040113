"""Where an engine step's time goes, on issue 40's shared-prefix workload.

16 requests = one shared 1,024-token system prompt + a distinct 64-token turn, 32 new tokens,
greedy, SmolLM2-135M-Instruct fp32, ``kvcache.Engine`` with its defaults. Prints wall-clock per
step kind (steps that carry prompt chunks, decode-only steps) and, for one decode-only step of all
16 rows, torch's profiler table by operator, grouped into phases: linear layers, attention (the
engine's paged step), the LM head, the rest.

    .venv/bin/python benchmarks/engine_step_profile.py [--rows 16] [--prefix 1024] [--turn 64]

``--compile-breaks`` measures the same rounds with the model's forward under ``torch.compile``
(inductor, ``dynamic=True``, weights frozen, the engine's packed linears off: inductor packs its
own) and the ``"kvcache"`` attention left out of the graph (``torch._dynamo.disable``): what
compiling the step gives before the attention is a graph operator. The first round includes
the compilation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import kvcache
from kvcache.apps.bench.common import machine_info, machine_line
from kvcache.apps.bench.workload import load_model


def workload(tokenizer, rows: int, prefix: int, turn: int) -> list[list[int]]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    text = " ".join(words[i % len(words)] for i in range(prefix * 2))
    shared = tokenizer(text)["input_ids"][:prefix]
    out = []
    for r in range(rows):
        own = tokenizer(" ".join(f"{words[(r * 7 + i) % len(words)]}{r}" for i in range(turn)))["input_ids"][:turn]
        out.append(shared + own)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--turn", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--compile-breaks", action="store_true")
    args = p.parse_args()
    model, tokenizer, _ = load_model(args.model)
    if args.compile_breaks:
        import torch._inductor.config
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS["kvcache"] = torch._dynamo.disable(ALL_ATTENTION_FUNCTIONS["kvcache"])
        torch._inductor.config.freezing = True
        model.forward = torch.compile(model.forward, dynamic=True)
    prompts = workload(tokenizer, args.rows, args.prefix, args.turn)
    print(machine_line(machine_info()))

    for rnd in range(2):  # the first round warms up (kernels built, allocator primed)
        engine = kvcache.Engine(model, max_seqs=max(32, args.rows), pack_linears=not args.compile_breaks)
        handles = [engine.submit(ids, max_new_tokens=args.new) for ids in prompts]
        prefill, decode = [], []
        started = time.perf_counter()
        while True:
            decoding_only = all(h._request.computed >= len(h._request.prompt) for h in handles if not h.done)
            t0 = time.perf_counter()
            if not engine.step():
                break
            (decode if decoding_only else prefill).append(time.perf_counter() - t0)
        total = time.perf_counter() - started
        tokens = sum(len(h.tokens) for h in handles)
        print(f"round {rnd}: {tokens} tokens in {total:.2f} s = {tokens / total:.1f} tokens/s; "
              f"{len(prefill)} steps with prompt chunks {sum(prefill):.2f} s; {len(decode)} decode-only steps "
              f"{sum(decode):.2f} s (median {1000 * statistics.median(decode):.0f} ms)")  # fmt: skip

    # one decode-only step of every row, profiled
    engine = kvcache.Engine(model, max_seqs=max(32, args.rows), pack_linears=not args.compile_breaks)
    handles = [engine.submit(ids, max_new_tokens=args.new) for ids in prompts]
    while any(h._request.computed < len(h._request.prompt) for h in handles):
        engine.step()
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(f"profiled decode step: {1000 * wall:.0f} ms wall")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
