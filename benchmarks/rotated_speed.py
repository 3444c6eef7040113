"""Issue 43: the decode step over rotated slot codes against plain ones. SmolLM2, one 4,096-token
task-family prompt prefilled into ``snapkv:budget=0.25,storage=S``, then 32 decode steps; S
alternates between int4 and int4h for 7 rounds; the median ms a step of rounds 2-7.

    python benchmarks/rotated_speed.py
"""

import statistics
import time

import torch

import kvcache
from kvcache.apps import families
from kvcache.models import load

ROUNDS, STEPS = 7, 32
torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)
ids = families.make_item(tok, "needle-words", 4096, 0, "tuned").prompt_ids
ms: dict[str, list[float]] = {}
for _ in range(ROUNDS):
    for storage in ("int4", "int4h"):
        cache = kvcache.make_cache(model, f"snapkv:budget=0.25,storage={storage}")
        with torch.inference_mode(), kvcache.use_kvcache_attention(model):
            model(torch.tensor([ids]), **kvcache.cache_kwargs(model, cache), use_cache=True)
            start = time.perf_counter()
            for t in ids[:STEPS]:
                model(torch.tensor([[t]]), **kvcache.cache_kwargs(model, cache), use_cache=True)
            ms.setdefault(storage, []).append((time.perf_counter() - start) / STEPS * 1000)
for storage, times in ms.items():
    print(storage, "median ms/step", round(statistics.median(times[1:]), 2), [round(x, 1) for x in times])
