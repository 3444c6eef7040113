"""The pool's eviction: a segmented LRU (``BlockPool(protect=0.5)``, the default) against one plain
LRU (``protect=0``), on one engine serving a few system prompts to many users.

Each request: a system prompt of 8 blocks drawn at random (uniform or Zipf weights, seeded), a
user part of its own (2.5 blocks) and 8 new tokens; 4 requests at a time, 120 in all. The pool holds
4 system prompts and every running request's own blocks. Printed: the share of a system prompt's
tokens found in the pool on its second and later requests, per seed. The model is a tiny random
Llama: which blocks are found depends on the scheduling and the pool, not on the weights.

    python benchmarks/eviction.py
"""

import random

from transformers import LlamaConfig, LlamaForCausalLM

import kvcache.engine.pool_setup as pool_setup
from kvcache import Engine

BLOCK, SYSTEM_BLOCKS, OWN_BLOCKS, NEW, CLIENTS, REQUESTS, HOLD = 16, 8, 3, 8, 4, 120, 4


def model():
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def found_share(net, protect: float, weights: list[float], seed: int) -> float:
    real = pool_setup.BlockPool
    pool_setup.BlockPool = lambda *a, **k: real(*a, **k, protect=protect)
    try:
        engine = Engine(net, block_size=BLOCK, blocks=HOLD * SYSTEM_BLOCKS + CLIENTS * (OWN_BLOCKS + 1), max_seqs=CLIENTS)
    finally:
        pool_setup.BlockPool = real
    rng = random.Random(seed)
    systems = [[3 + s] + random.Random(100 + s).choices(range(3, 256), k=SYSTEM_BLOCKS * BLOCK - 1) for s in range(len(weights))]
    picks = rng.choices(range(len(weights)), weights=weights, k=REQUESTS)
    whole, seen, found, asked, running, i = SYSTEM_BLOCKS * BLOCK, set(), 0, 0, [], 0
    while i < REQUESTS or running:
        while len(running) < CLIENTS and i < REQUESTS:
            own = rng.choices(range(3, 256), k=OWN_BLOCKS * BLOCK - BLOCK // 2)
            handle = engine.submit(systems[picks[i]] + own, max_new_tokens=NEW, eos_token_id=[])
            running.append((handle, picks[i] in seen))
            seen.add(picks[i])
            i += 1
        engine.step()
        for handle, again in [r for r in running if r[0].done]:
            if again:
                asked += whole
                found += min(handle.stats.reused_pool, whole)
        running = [r for r in running if not r[0].done]
    return found / asked


def main() -> None:
    net = model()
    zipf = lambda n: [1 / (k + 1) for k in range(n)]  # noqa: E731
    print("| system prompts (the pool holds 4) | plain LRU (protect=0), per seed | segmented LRU (protect=0.5), per seed |")
    print("|---|---|---|")
    for name, weights in (("4, uniform", [1] * 4), ("5, uniform", [1] * 5), ("6, Zipf", zipf(6)), ("8, Zipf", zipf(8))):
        cells = [", ".join(f"{found_share(net, p, weights, seed):.0%}" for seed in range(3)) for p in (0.0, 0.5)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
