"""The loss a model gives when it reads its past through a cache: how a model is scored under the
cache it will be served with (``kvcache finetune`` before and after training)."""

from __future__ import annotations

import torch

from ..build import make_cache
from ..hf import use_kvcache_attention
from .chunked import IGNORE, check_arguments, shifted


@torch.no_grad()
def cache_loss(model, input_ids: torch.Tensor, spec: str = "growable", *, chunk: int = 512, labels: torch.Tensor | None = None) -> float:
    """The mean next-token loss of ``input_ids`` ``[B, L]`` fed ``chunk`` tokens per forward pass
    into a cache of ``spec`` (as ``kvcache.prefill`` feeds a prompt), every position's logits read;
    no gradients. ``labels`` as ``chunked_loss`` takes them; this is the loss ``chunked_loss``
    reports for the same arguments."""
    check_arguments(model, input_ids, chunk, labels, "replay")
    targets = shifted(input_ids if labels is None else labels)
    count = int((targets != IGNORE).sum())
    if count == 0:
        raise ValueError("no position has a label: every target is -100 (the last position has none of its own)")
    cache = make_cache(model, spec)
    total = 0.0
    with use_kvcache_attention(model):
        for start in range(0, input_ids.shape[1], chunk):
            logits = model(input_ids=input_ids[:, start : start + chunk], past_key_values=cache, use_cache=True).logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            part = targets[:, start : start + chunk]
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), part.flatten(), ignore_index=IGNORE, reduction="sum"))
            del logits
    return total / count
