"""Bytes held for backward by chunked replay with a fixed h2o budget of 1,024 tokens (SmolLM2, LoRA rank 8, chunks of 256), at 2K, 4K and 8K tokens: `python benchmarks/train_fixed_budget.py` (needs ".[train]")."""
from kvcache.apps.bench import train as bt
from kvcache.apps.bench.rss import PeakRSS
from kvcache.apps.cli_load import load_model
from kvcache.apps.finetune import adapt, documents

bt.CONTENDERS["replay h2o 1024"] = ("h2o:budget=1024", "replay")
model, tok = load_model("smollm2", dtype="float32")
model = adapt(model, 8).train()
doc = documents(tok, 8192, "train", 1, 0)[0]
peak = PeakRSS()
for n in (2048, 4096, 8192):
    m = bt.measure(model, bt.step_of(model, "replay h2o 1024", doc[:, :n], 256), peak)
    print(n, {k: round(v / 2**20, 1) for k, v in m.items()}, "MiB")
