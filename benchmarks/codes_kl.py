"""Issue 43: what a slot storage's coding costs the next-token distribution. Each spec's cache is
filled with a task-family prompt (``needle-words`` and ``turn``, seeds ``0..N-1`` of SPLIT) but its
last 48 tokens, which are then fed one at a time through it (teacher forcing); KL divergence and
top-1 agreement of each step's next-token distribution against the full cache's, averaged.
Comparing specs that keep the same tokens (``snapkv:budget=0.25,storage=int4`` against
``...,storage=int4h`` and ``snapkv:budget=0.25``) isolates the codes.

    python benchmarks/codes_kl.py LENGTH N SPLIT "SPEC;SPEC..."
"""

import sys

import torch

import kvcache
from kvcache.apps import families
from kvcache.models import load

TAIL = 48
torch.set_num_threads(2)
model, tok = load("smollm2", progress=False)


def log_probs(spec: str, ids: list[int]) -> torch.Tensor:
    """``[TAIL, vocab]``: the next-token log-probabilities after ``ids[:-TAIL]``, then after each
    of the tail's tokens but the last, through a fresh ``spec`` cache."""
    cache = kvcache.make_cache(model, spec)
    out = []
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        step = model(torch.tensor([ids[:-TAIL]]), **kvcache.cache_kwargs(model, cache), use_cache=True)
        out.append(step.logits[0, -1])
        for t in ids[-TAIL:-1]:
            step = model(torch.tensor([[t]]), **kvcache.cache_kwargs(model, cache), use_cache=True)
            out.append(step.logits[0, -1])
    return torch.stack(out).float().log_softmax(-1)


length, n, split, specs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(";")
found: dict[str, list[tuple[float, float]]] = {}
for seed in range(n):
    for family in ("needle-words", "turn"):
        ids = families.make_item(tok, family, length, seed, split).prompt_ids
        ref = log_probs("growable", ids)
        for spec in specs:
            lp = log_probs(spec, ids)
            kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
            top1 = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
            found.setdefault(spec, []).append((kl, top1))
print(f"{split}, {length} tokens, {n} seeds x 2 families, {TAIL} steps each")
print("| spec | KL (nats) | top-1 |")
print("|---|---|---|")
for spec, v in found.items():
    print(f"| `{spec}` | {sum(a for a, _ in v) / len(v):.3f} | {sum(b for _, b in v) / len(v):.1%} |")
