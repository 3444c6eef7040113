"""Issue 43: the decode step over rotated slot codes against plain ones. SmolLM2, one 4,096-token
task-family prompt prefilled into ``snapkv:budget=0.25,storage=S``, then 32 decode steps; S
alternates between int4 and int4h for 7 rounds; the median ms a step of rounds 2-7.

    python benchmarks/rotated_speed.py
"""
import time, torch, kvcache, statistics
from kvcache.apps import families
from kvcache.models import load
torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)
ids = families.make_item(tok, "needle-words", 4096, 0, "tuned").prompt_ids
res = {}
for rnd in range(7):
    for st in ("int4", "int4h"):
        cache = kvcache.make_cache(model, f"snapkv:budget=0.25,storage={st}")
        with torch.inference_mode(), kvcache.use_kvcache_attention(model):
            model(torch.tensor([ids]), **kvcache.cache_kwargs(model, cache), use_cache=True)
            t0 = time.perf_counter()
            for t in range(32):
                model(torch.tensor([[ids[t]]]), **kvcache.cache_kwargs(model, cache), use_cache=True)
            res.setdefault(st, []).append((time.perf_counter() - t0) / 32 * 1000)
for st, v in res.items(): print(st, "median ms/step", round(statistics.median(v[1:]), 2), [round(x, 1) for x in v])
