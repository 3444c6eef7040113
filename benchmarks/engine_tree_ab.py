"""One timing of the engine for one checkout, to compare two trees in one run: SmolLM2 fp32, 8
prompts of 1K random tokens, 32 new tokens each, all submitted at once; prints JSON (total and
decode seconds, decode tokens/s, the tokens).

    git worktree add /tmp/old <commit>
    for round in 1 2; do for tree in /tmp/old /path/to/kvcache; do
        PYTHONPATH=$tree/src .venv/bin/python benchmarks/engine_tree_ab.py "snapkv:budget=0.25"
    done; done

(``PYTHONPATH`` puts that tree's ``kvcache`` before the installed one.)
"""
import json
import sys
import time

import torch

from kvcache import Engine, models


def main(spec: str) -> None:
    model, tok = models.load("smollm2")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (1024,), generator=gen).tolist() for _ in range(8)]
    engine = Engine(model, spec, max_bytes=1 << 30, max_seqs=8)
    engine.generate_batch(prompts[:1], max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    hs = [engine.submit(p, max_new_tokens=32, eos_token_id=[]) for p in prompts]
    out = [h.result() for h in hs]
    total = time.perf_counter() - start
    first = max(h.stats.first_token for h in hs)
    decode = max(h.stats.finished for h in hs) - first
    print(json.dumps({"spec": spec, "tree": __import__("kvcache").__file__, "total_s": total, "decode_s": decode,
                      "decode_tok_s": 8 * 31 / decode, "tokens": out}))


if __name__ == "__main__":
    main(sys.argv[1])
