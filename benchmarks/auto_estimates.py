"""What `auto` weighs on the task families (issue 43): per layer and storage, the attention mass
dropped and the coding error of what is kept (``Choice.estimates``), after one prompt at each byte
budget; mean over layers and items. Shows whether coding error or dropped mass dominates: mixed
precision inside a layer can only win back coding error. Also the gap between int8's and int4's
dropped mass per layer: with ``tolerance`` and ``margin=m`` a layer keeps int8 where it is at most
``m``.

    python benchmarks/auto_estimates.py LENGTH ITEMS SPLIT FAMILY,... BUDGET,... [KIND;KIND...]

KIND: ``auto`` and ``auto-heads`` by default; options after a comma (``auto,rule=attention``).
"""

import sys
from collections import defaultdict

import torch

import kvcache
from kvcache.apps import families
from kvcache.layers import mix_of
from kvcache.models import load

torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)
length, n, split = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fams, budgets = sys.argv[4].split(","), [float(b) for b in sys.argv[5].split(",")]
kinds = sys.argv[6].split(";") if len(sys.argv) > 6 else ["auto", "auto-heads"]
for kind in kinds:
    name, _, extra = kind.partition(",")
    for b in budgets:
        sums = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # storage -> dropped, coding, slots share, count
        chosen = defaultdict(int)
        gaps = []  # per layer: int8's dropped mass less int4's
        for fam in fams:
            for seed in range(n):
                it = families.make_item(tok, fam, length, seed, split)
                cache = kvcache.make_cache(model, f"{name}:bytes={b}" + (f",{extra}" if extra else ""))
                with torch.inference_mode(), kvcache.use_kvcache_attention(model):
                    model(torch.tensor([it.prompt_ids]), **kvcache.cache_kwargs(model, cache), use_cache=True)
                for m in mix_of(cache):
                    chosen[m["storage"]] += 1
                    weighed = m["estimates"]
                    if "int8" in weighed and "int4" in weighed:
                        gaps.append(weighed["int8"]["dropped"] - weighed["int4"]["dropped"])
                    for storage, e in m["estimates"].items():
                        s = sums[storage]
                        s[0] += e["dropped"]; s[1] += e["coding"]; s[2] += e["slots"] / m["seen"]; s[3] += 1
        print(f"{kind} bytes={b}: chose {dict(chosen)}")
        for storage, (d, c, share, k) in sums.items():
            print(f"  {storage:5s} slots/seen {share / k:.3f}  dropped {d / k:.4f}  coding {c / k:.4f}  total {(d + c) / k:.4f}")
        if gaps:
            g = torch.tensor(gaps)
            quartiles = " / ".join(f"{q:.4f}" for q in g.quantile(torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])).tolist())
            shares = "  ".join(f"<={m:g}: {(g <= m).float().mean().item():.0%}" for m in (0.005, 0.01, 0.02, 0.03, 0.05))
            print(f"  int8 - int4 dropped, per layer: p10/p25/p50/p75/p90 {quartiles};  layers within  {shares}")
