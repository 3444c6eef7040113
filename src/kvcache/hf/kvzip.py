"""KVzip's scores as its paper computes them (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", Sec. 3 and its public code).

The context is reconstructed chunk by chunk: for each chunk of up to ``chunk`` context tokens the
model reads a request to repeat it (the first chunk: the context; later ones: the part starting
with the previous chunk's last ``overlap`` tokens), the chat template's end of the user turn and
opening of the assistant's, then the chunk's own tokens, after the whole context in the cache. A
context slot's score is the largest weight any query of its chunk's pass pays it, the weights taken
over only the attention ``sinks`` (the cache's first tokens), the chunk's own slots and the pass's
own tokens (causally), so that a chunk is scored as if it were the whole context; the query heads
of a KV head share their maximum. The sinks score 1 (always kept); context slots before ``start``
(the chat template's opening) score 0.

``scoring.repeat_scores``, the project's first reading, took each weight over the whole context
and summed a group's query heads, so slots far from a long context's repetition scored low: the
difference this module makes (``tests/hf/test_kvzip.py`` checks these scores against HF's eager
attention renormalised over those keys, as the equations have it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import scoring
from .bridge import use_kvcache_attention
from .cache import KVCache
from .cache_arg import cache_kwargs

#: Records every query row of a pass (``attention.weights``' ``"queries:N"``, N beyond any pass).
ALL_QUERIES = "queries:1048576"
#: The paper's chunk of context tokens reconstructed at once, the previous chunk's tokens quoted
#: to say where a later chunk starts, and the first tokens always kept (attention sinks).
CHUNK, OVERLAP, SINKS = 2048, 8, 4
FIRST_REQUEST = "\n\nRepeat the context above exactly."
LATER_REQUEST = "\n\nRepeat the part of the context above exactly, starting with"


@dataclass(frozen=True)
class Chunk:
    """One reconstruction pass: it scores context slots ``[first, stop)`` and feeds ``ids``."""

    first: int
    stop: int
    ids: list[int]


def chunks(tokenizer: Any, context_ids: list[int], start: int, chunk: int = CHUNK, overlap: int = OVERLAP) -> list[Chunk]:
    """The reconstruction passes of ``context_ids`` from ``start`` on (the tokens before it, the
    chat template's opening, are not reconstructed): per chunk the request, the end of the user
    turn and the assistant's opening (from the tokenizer's chat template), then the chunk."""
    if not 0 <= start < len(context_ids):
        raise ValueError(f"start must be a context position, got {start} for {len(context_ids)} tokens")
    suffix = _turn_end(tokenizer)
    out = []
    for first in range(start, len(context_ids), chunk):
        stop = min(first + chunk, len(context_ids))
        if first == start:
            request = _ids(tokenizer, FIRST_REQUEST)
        else:
            request = _ids(tokenizer, LATER_REQUEST) + context_ids[max(start, first - overlap) : first]
        out.append(Chunk(first, stop, request + suffix + context_ids[first:stop]))
    return out


def _turn_end(tokenizer: Any) -> list[int]:
    """What the chat template puts between a user turn's text and the assistant's reply."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _ids(tokenizer, "\n")
    mark = "\x00END\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    return _ids(tokenizer, text.split(mark, 1)[1])


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def scores(model: Any, cache: KVCache, passes: list[Chunk], sinks: int = SINKS) -> list[torch.Tensor | None]:
    """KVzip's score of every slot of ``cache`` (a ``scoring.recording_cache`` recording
    :data:`ALL_QUERIES`, holding the context): each pass of ``passes`` run after the context and
    taken out again (the cache is left as it was). Per layer float32 ``[B, Hkv, T]`` (None: no
    cache there); see the module docstring."""
    context = cache.seen
    out: list[torch.Tensor | None] = [None] * len(cache.kv_layers)
    try:
        with use_kvcache_attention(model):
            for p in passes:
                if not 0 <= p.first < p.stop <= context:
                    raise ValueError(f"a pass scores slots [{p.first}, {p.stop}) outside the context's {context}")
                ids = torch.tensor([p.ids], device=model.device).expand(_batch(cache), -1)
                model(ids, **cache_kwargs(model, cache), use_cache=True)
                for i, layer in enumerate(cache.kv_layers):
                    if layer is None:
                        continue
                    got = _chunk_scores(layer.recorded[ALL_QUERIES], layer.view()[0], p, context, sinks)
                    if out[i] is None:
                        out[i] = got.new_zeros(*got.shape[:2], context)
                        out[i][..., : min(sinks, context)] = 1.0
                    out[i][..., p.first : p.stop] = got
                cache.crop(-(cache.seen - context))
    finally:
        if cache.seen > context:
            cache.crop(-(cache.seen - context))
    return out


def _batch(cache: KVCache) -> int:
    layer = next(s for s in cache.kv_layers if s is not None)
    return layer.view()[0].shape[0]


def _chunk_scores(queries: torch.Tensor, keys: torch.Tensor, p: Chunk, context: int, sinks: int) -> torch.Tensor:
    """Scores ``[B, Hkv, stop - first]`` of one pass: ``queries`` ``[B, Hkv, group, Q, D]`` (scaled),
    ``keys`` ``[B, Hkv, context + Q, D]`` (the context, then the pass's own)."""
    q_len = queries.shape[3]
    s = min(sinks, p.first)
    chosen = torch.cat([keys[:, :, :s], keys[:, :, p.first : p.stop], keys[:, :, context : context + q_len]], dim=2).float()
    logits = torch.einsum("bhgqd,bhkd->bhgqk", queries.float(), chosen)
    own = torch.ones(q_len, q_len, dtype=torch.bool, device=keys.device).tril()
    logits[..., chosen.shape[2] - q_len :] = logits[..., chosen.shape[2] - q_len :].masked_fill(~own, float("-inf"))
    weights = logits.softmax(dim=-1)[..., s : s + p.stop - p.first]
    return weights.amax(dim=(2, 3))


@torch.inference_mode()
def compress_context(
    model: Any, tokenizer: Any, context_ids: list[int], spec: str, start: int, chunk: int = CHUNK, sinks: int = SINKS
) -> KVCache:
    """A cache of ``spec`` (a ``kvzip`` kind: ``"kvzip:budget=0.3"``) holding ``context_ids``
    (one sequence) compressed by KVzip's scores (:func:`scores` over :func:`chunks` from ``start``,
    the end of the chat template's opening). Any question may follow (fork it per question)."""
    cache = scoring.recording_cache(model, (ALL_QUERIES,))
    ids = torch.tensor([context_ids], device=model.device)
    with use_kvcache_attention(model):
        for first in range(0, ids.shape[1], chunk):
            model(ids[:, first : first + chunk], **cache_kwargs(model, cache), use_cache=True)
    got = scores(model, cache, chunks(tokenizer, context_ids, start, chunk), sinks)
    return scoring.compress(model, spec, scoring.keys_values(cache), {scoring.KVZIP_MODE: got})
