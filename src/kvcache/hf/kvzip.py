"""KVzip as its paper has it (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with
Context Reconstruction", Sec. 3, and its public code).

Scores. The context is reconstructed chunk by chunk: for each chunk of up to ``chunk`` context
tokens the model reads a request to repeat it (the first chunk: the context; later ones: the part
starting with the previous chunk's last ``overlap`` tokens), the chat template's end of the user
turn and opening of the assistant's, then the chunk's own tokens, after the whole context in the
cache. A context slot's score is the largest weight any query of its chunk's pass pays it, the
weights taken over only the sinks (everything before the context: the chat template's opening and
system prompt), the chunk's own slots and the pass's own tokens (causally), so that a chunk is
scored as if it were the whole context; the query heads of a KV head share their maximum.

Choice. One threshold over every layer's and KV head's context slots keeps the ``ratio`` share
with the highest scores (the paper's pair level: layers and heads keep different counts;
``level="head"``, its uniform variant, keeps the same share in every head). The sinks are always
kept, and so is whatever follows the context (a question, its answer): the compressed cache grows.

Cache. Each layer is an ``adakv`` flat store (slots of any head in one run, a head id a slot)
holding its kept slots as ``compressed`` slots beside a budget of ``room`` tokens a head: the
question and answer that follow are appended, nothing is evicted until they pass ``room`` tokens
(then Ada-KV's rule applies). It saves and loads as any cache (``compressed`` is each layer's
count), and a fork serves each question.

Plain ``kvzip:budget=N`` in ``generate`` cannot do this (a layer cannot make the model repeat the
context, nor see the other layers' scores): it scores by the prompt's own queries (docs/kinds.md).
``tests/hf/test_kvzip.py`` checks the scores against HF's eager attention renormalised over those
keys, as the equations have it, and the choice and cache against direct references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import scoring
from ..layers.adaptive import AdaptiveLayer
from ..layers.state import LayerState
from .bridge import use_kvcache_attention
from .build import make_cache
from .cache import KVCache
from .cache_arg import cache_kwargs

#: Records every query row of a pass (``attention.weights``' ``"queries:N"``, N beyond any pass).
ALL_QUERIES = "queries:1048576"
#: The paper's chunk of context tokens reconstructed at once, and the previous chunk's tokens quoted
#: to say where a later chunk starts.
CHUNK, OVERLAP = 2048, 8
#: Tokens a head of the compressed cache takes after the context before Ada-KV's rule evicts.
ROOM = 64
#: The choices across slots: one threshold over the whole cache, or the same share in every head.
LEVELS = ("pair", "head")
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
def scores(model: Any, cache: KVCache, passes: list[Chunk], sinks: int | None = None) -> list[torch.Tensor | None]:
    """KVzip's score of every slot of ``cache`` (a ``scoring.recording_cache`` recording
    :data:`ALL_QUERIES`, holding the context): each pass of ``passes`` run after the context and
    taken out again (the cache is left as it was). ``sinks``: the first slots, in every pass's
    softmax and scored 1 (default: those before the first pass's chunk). Per layer float32
    ``[B, Hkv, T]`` (None: no cache there); see the module docstring."""
    context = cache.seen
    sinks = passes[0].first if sinks is None and passes else (sinks or 0)
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


def opening(tokenizer: Any, context_ids: list[int]) -> int:
    """How many of ``context_ids``' first tokens are the chat template's opening (the system prompt
    and the start of the user's turn), which KVzip keeps and does not reconstruct; 0 where they do
    not start with it or the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return 0
    mark = "\x00CONTEXT\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False)
    head = _ids(tokenizer, text.split(mark, 1)[0])
    return len(head) if head and context_ids[: len(head)] == head else 0


def select(scores: list[torch.Tensor | None], ratio: float, start: int, level: str = "pair") -> list[torch.Tensor | None]:
    """The slots kept, per layer a bool mask ``[B, Hkv, T]``: of the context slots ``[start, T)``,
    the ``ratio`` share with the highest ``scores`` (per layer float ``[B, Hkv, T]``), counted over
    every layer and head (``level="pair"``: one threshold, so layers and heads keep different
    counts) or in each head (``"head"``); every slot before ``start`` is kept. Ties at the
    threshold are kept."""
    _check_choice(ratio, level)
    live = [s for s in scores if s is not None]
    if not live or not 0 <= start < live[0].shape[-1]:
        raise ValueError(f"start must be a context position, got {start} for {live[0].shape[-1] if live else 0} slots")
    if level == "pair":
        context = torch.cat([s[..., start:].reshape(s.shape[0], -1) for s in live], dim=1)  # [B, L * Hkv * (T - start)]
        threshold = context.topk(max(1, int(context.shape[1] * ratio)), dim=1).values[:, -1].view(-1, 1, 1)
    out = []
    for s in scores:
        if s is None:
            out.append(None)
            continue
        if level == "head":
            threshold = s[..., start:].topk(max(1, int((s.shape[-1] - start) * ratio)), dim=-1).values[..., -1:]
        mask = s >= threshold
        mask[..., :start] = True
        out.append(mask)
    return out


def _check_choice(ratio: float, level: str) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio is the share of the context kept, in (0, 1], got {ratio!r}")
    if level not in LEVELS:
        raise ValueError(f"level is one of {', '.join(LEVELS)}, got {level!r}")


def kept_cache(
    model: Any, past: list[tuple[torch.Tensor, torch.Tensor] | None], masks: list[torch.Tensor | None],
    scores: list[torch.Tensor | None] | None = None, room: int = ROOM,
) -> KVCache:
    """A cache holding the slots ``masks`` keep (per layer ``[1, Hkv, T]``) of ``past`` (per layer
    keys and values ``[1, Hkv, T, D]``): ``adakv`` layers of budget ``room``, each holding its kept
    slots as ``compressed`` ones (module docstring), scored by ``scores`` (per layer ``[1, Hkv, T]``;
    default 0) should Ada-KV's rule evict after ``room``. One sequence; every attention layer cached."""
    plain = _flat_cache(model, room)
    layers: list[Any] = []
    for i, (layer, pair, mask) in enumerate(zip(plain.kv_layers, past, masks)):
        score = None if scores is None else scores[i]
        if layer is None:
            layers.append(None)
            continue
        if pair is None or mask is None:
            raise ValueError(f"layer {i}: no keys, values or mask for an attention layer")
        keys, values = pair
        if keys.shape[0] != 1 or mask.shape != keys.shape[:3]:
            raise ValueError(f"layer {i}: one sequence's keys [1, Hkv, T, D] and a mask [1, Hkv, T], got {tuple(keys.shape)} and {tuple(mask.shape)}")
        head, position = mask[0].nonzero(as_tuple=True)  # head-major, positions ascending
        slots = {
            **layer.storage.encode(keys[0, head, position][None, None], values[0, head, position][None, None]),
            "positions": position.to(torch.int32)[None, None],
            "heads": head.to(torch.int16)[None, None],
            "scores": (score[0, head, position].float() if score is not None else torch.zeros(head.numel(), device=keys.device))[None, None],
            "head_lengths": mask[0].sum(-1, dtype=torch.long)[None],
        }
        options = {**layer.options(), "compressed": head.numel()}
        layers.append(AdaptiveLayer.from_state(LayerState(layer.kind, options, keys.shape[2], slots)))
    return KVCache(layers, plain.spec, plain.config_summary, plain.attention_config, dict(plain.others))


@dataclass(frozen=True)
class Scored:
    """A context's keys and values (per layer ``[1, Hkv, T, D]``), KVzip's scores of its slots (per
    layer ``[1, Hkv, T]``) and where the context starts: what any number of choices is made from."""

    past: list[tuple[torch.Tensor, torch.Tensor] | None]
    scores: list[torch.Tensor | None]
    start: int

    def compressed(self, model: Any, ratio: float, level: str = "pair", room: int = ROOM) -> KVCache:
        """A cache holding the ``ratio`` share of the context :func:`select` keeps at ``level``."""
        return kept_cache(model, self.past, select(self.scores, ratio, self.start, level), self.scores, room)


def _flat_cache(model: Any, room: int) -> KVCache:
    """An empty cache of ``adakv`` layers of budget ``room`` for ``model``; ``ValueError`` for a
    model with layers of another kind (sliding windows), whose context KVzip does not choose."""
    plain = make_cache(model, f"adakv:budget={room},floor=0")
    other = sorted({layer.kind for layer in plain.kv_layers if layer is not None and not isinstance(layer, AdaptiveLayer)})
    if other:
        raise ValueError(f"KVzip chooses over every layer of the cache; this model has {other} layers (sliding windows)")
    return plain


@torch.inference_mode()
def score_context(model: Any, tokenizer: Any, context_ids: list[int], *, start: int | None = None, chunk: int = CHUNK) -> Scored:
    """Prefill ``context_ids`` (one sequence: the chat template's opening, then the context) and
    score its slots (:func:`scores` over :func:`chunks`). ``start``: where the context begins
    (default: after the template's opening, :func:`opening`). The model runs over it twice."""
    start = opening(tokenizer, context_ids) if start is None else start
    if not 0 <= start < len(context_ids):
        raise ValueError(f"start must be a context position, got {start} for {len(context_ids)} tokens")
    _flat_cache(model, ROOM)  # a model KVzip cannot serve is refused before it runs
    cache = scoring.recording_cache(model, (ALL_QUERIES,))
    ids = torch.tensor([context_ids], device=model.device)
    with use_kvcache_attention(model):
        for first in range(0, ids.shape[1], chunk):
            model(ids[:, first : first + chunk], **cache_kwargs(model, cache), use_cache=True)
    return score_recorded(model, tokenizer, cache, context_ids, start, chunk)


def score_recorded(
    model: Any, tokenizer: Any, cache: KVCache, context_ids: list[int], start: int, chunk: int = CHUNK
) -> Scored:
    """:func:`score_context` for a ``scoring.recording_cache`` already holding ``context_ids`` and
    recording :data:`ALL_QUERIES` (among other modes, for a harness that scores other kinds too)."""
    got = scores(model, cache, chunks(tokenizer, context_ids, start, chunk, OVERLAP))
    return Scored(scoring.keys_values(cache), got, start)


def compress_context(
    model: Any, tokenizer: Any, context_ids: list[int], ratio: float, *, start: int | None = None, level: str = "pair",
    room: int = ROOM, chunk: int = CHUNK,
) -> KVCache:
    """KVzip: a cache holding ``context_ids`` (one sequence: the chat template's opening, then the
    context) compressed to ``ratio`` of its context slots, for any question that follows (fork it
    per question): :func:`score_context`, then :meth:`Scored.compressed` at ``level`` with ``room``.
    Bad arguments are refused before the model runs."""
    _check_choice(ratio, level)
    return score_context(model, tokenizer, context_ids, start=start, chunk=chunk).compressed(model, ratio, level, room)
