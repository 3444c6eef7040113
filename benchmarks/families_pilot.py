"""Pilot of the task families (issue 43): how many items of each family SmolLM2-135M-Instruct
answers (greedy, 24 new tokens, fp32, 2 threads) with each cache spec ("full" = DynamicCache).

    python benchmarks/families_pilot.py LENGTH ITEMS SPLIT FAMILY,... [SPEC;SPEC;...]
    python benchmarks/families_pilot.py 2048 6 tuned needle-digits,needle-words,needle-mixed,multi-key,kv-lookup,turn
    python benchmarks/families_pilot.py 2048 10 held-out needle-digits,needle-words,needle-mixed,turn "full;auto:bytes=0.125;snapkv:budget=0.125"

Caches alternate item by item (every spec answers item 0, then item 1, ...).
"""

import sys
import time

import torch

import kvcache
from kvcache.apps import families
from kvcache.models import load

torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)
length, n, split = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
specs = sys.argv[5].split(";") if len(sys.argv) > 5 else ["full"]
t0 = time.time()
for fam in sys.argv[4].split(","):
    found = {spec: 0 for spec in specs}
    for seed in range(n):
        it = families.make_item(tok, fam, length, seed, split)
        ids = torch.tensor([it.prompt_ids])
        for spec in specs:
            kwargs = {} if spec == "full" else kvcache.cache_kwargs(model, kvcache.make_cache(model, spec))
            with torch.inference_mode(), kvcache.use_kvcache_attention(model):
                out = model.generate(ids, max_new_tokens=24, do_sample=False, **kwargs)
            found[spec] += families.score(it, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    print(fam, " ".join(f"{spec}={k}/{n}" for spec, k in found.items()), flush=True)
print("seconds", round(time.time() - t0))
