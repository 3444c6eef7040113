"""Time of one prompt (SmolLM2, 863 tokens, one new token) through a fresh engine with and without
its prompt tokens scored (prompt_logprobs=1, as echo + logprobs asks), alternating, medians of 5."""
import time, statistics, torch, kvcache
from kvcache.apps.cli_load import load_model
from kvcache.apps import needles
torch.set_num_threads(2)
model, tok = load_model("smollm2"); model.eval()
ctx = needles.make_context(tok, 1024, 0)
prompt = ctx.prefix_ids
t = {"plain": [], "echo": []}
for r in range(5):
    for name, kw in (("plain", {}), ("echo", {"logprobs": 1, "prompt_logprobs": 1})):
        engine = kvcache.Engine(model, "growable", max_bytes=256 * 2**20)
        s = time.perf_counter(); engine.submit(prompt, max_new_tokens=1, **kw).result(); t[name].append(time.perf_counter() - s)
m = {k: statistics.median(v) for k, v in t.items()}
print(len(prompt), "tokens; median s:", {k: round(v, 3) for k, v in m.items()}, "ratio", round(m["echo"] / m["plain"], 3))
