"""The loss a model gives when it reads its past through a cache: how a model is scored under the
cache it will be served with (``kvcache finetune`` before and after training)."""

from __future__ import annotations

import torch

from ..hf.bridge import use_kvcache_attention
from ..hf.build import make_cache
from ..hf.cache_arg import cache_kwargs
from .chunked import check_arguments, labelled_targets, summed_loss


@torch.no_grad()
def cache_loss(model, input_ids: torch.Tensor, spec: str = "growable", *, chunk: int = 512, labels: torch.Tensor | None = None) -> float:
    """The mean next-token loss of ``input_ids`` ``[B, L]`` fed ``chunk`` tokens per forward pass
    into a cache of ``spec`` (as ``kvcache.prefill`` feeds a prompt), every position's logits read;
    no gradients. ``labels`` as ``chunked_loss`` takes them; this is the loss ``chunked_loss``
    reports for the same arguments."""
    check_arguments(model, input_ids, chunk, labels)
    targets, count = labelled_targets(input_ids, labels)
    cache = make_cache(model, spec)
    total = 0.0
    with use_kvcache_attention(model):
        for start in range(0, input_ids.shape[1], chunk):
            logits = model(input_ids=input_ids[:, start : start + chunk], **cache_kwargs(model, cache), use_cache=True).logits
            total += float(summed_loss(logits, targets[:, start : start + chunk]))
            del logits
    return total / count
