"""A process writing and reading a shared prompt store (``test_store_sharing`` forks it):
``work(location, chunk, seed)`` prints ``bad entries N``."""

import torch

import kvcache
from helpers import model_for


def work(location: str, chunk: int, seed: int, prompts: list[torch.Tensor]) -> None:
    torch.set_num_threads(1)
    model = model_for("llama")
    store = kvcache.PromptStore(location, chunk=chunk)
    for ids in prompts[seed:] + prompts[:seed]:
        store.prefill(model, ids)
        store.cache_for(model, ids)
    print(f"bad entries {store.stats.bad_entries}")
