"""A process writing and reading a shared prompt store (``test_store_sharing``):
``store_worker.py LOCATION CHUNK SEED``; prints ``bad entries N``."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: helpers

import kvcache  # noqa: E402
from helpers import model_for  # noqa: E402
from test_store_sharing import PROMPTS  # noqa: E402

location, chunk, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
model = model_for("llama")
store = kvcache.PromptStore(location, chunk=chunk)
for ids in PROMPTS[seed:] + PROMPTS[:seed]:
    store.prefill(model, ids)
    store.cache_for(model, ids)
print(f"bad entries {store.stats.bad_entries}")
