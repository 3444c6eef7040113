"""Pilot of the task families (issue 43): how many items of each family SmolLM2-135M-Instruct
answers with the full cache (greedy, 24 new tokens, fp32, 2 threads).

    python benchmarks/families_pilot.py LENGTH ITEMS SPLIT FAMILY,...
    python benchmarks/families_pilot.py 2048 6 tuned needle-digits,needle-words,needle-mixed,multi-key,kv-lookup,turn
"""

import sys, time, torch
from kvcache.models import load
from kvcache.apps import families
torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)
length = int(sys.argv[1]); n = int(sys.argv[2]); split = sys.argv[3]
t0=time.time()
for fam in sys.argv[4].split(","):
    ok = 0; outs=[]
    for seed in range(n):
        it = families.make_item(tok, fam, length, seed, split)
        ids = torch.tensor([it.prompt_ids])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        good = families.score(it, text); ok += good
        outs.append((it.answer, text.strip()[:30], good, len(it.prompt_ids)))
    print(fam, f"{ok}/{n}", outs[:3], flush=True)
print("s", round(time.time()-t0))
