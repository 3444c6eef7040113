"""Bounded prefill: a long prompt through the model a chunk at a time, with one of our caches.

::

    cache = kvcache.make_cache(model, "h2o:budget=1024")
    logits = kvcache.prefill(model, ids[:, :-1], cache, chunk=512)   # [B, V]
    with kvcache.use_kvcache_attention(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

One forward pass over a whole prompt makes every layer hold all ``S`` keys and values at once,
whatever the cache keeps afterwards. Fed ``chunk`` tokens at a time, a bounded layer (window,
eviction) holds at most its budget plus one chunk: each chunk attends the kept slots and its own
tokens, then the layer keeps its budget. The ``"kvcache"`` mask function builds no mask for a
plain causal chunk after the past (``hf.kvcache_mask``), and the attention builds none either: its
rows attend the past with no mask and their own keys causally, merged exactly
(``attention/causal.py``), so a plain causal chunk makes no ``chunk x context`` tensor; a bounded
layer makes its masks by position (a window, padding) a block of query rows at a time.

``transformers``' own ``generate(..., prefill_chunk_size=N)`` feeds the prompt the same way and
works with these caches (inside ``use_kvcache_attention``); ``prefill`` is the same loop without
generating, with a progress bar and a hook after every chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .bridge import use_kvcache_attention
from .cache import KVCache
from .cache_arg import cache_kwargs


def prefill(
    model,
    ids: torch.Tensor,
    cache: KVCache,
    *,
    chunk: int = 512,
    attention_mask: torch.Tensor | None = None,
    progress: bool = False,
    after_chunk: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Append ``ids`` ``[B, S]`` to ``cache`` through ``model``, ``chunk`` tokens per forward pass.

    Runs under ``use_kvcache_attention(model)`` (the model's attention comes back after) and
    without autograd. ``attention_mask``: Hugging Face's 2-D padding mask ``[B, seen + S]`` over
    the cache's tokens and these (1 = attend), as ``generate`` takes it; each chunk gets its
    columns up to the chunk's end, and the position ids ``generate`` would give (a left-padded
    row's first real token is position 0), so a prefill here and ``generate`` agree. ``progress``: a tqdm bar over the tokens. ``after_chunk(done)``
    runs after every chunk with the tokens of ``ids`` done so far (to watch ``cache.nbytes``).

    Returns the logits of the last position, ``[B, V]``: the next token's distribution. To go on
    with ``generate``, prefill all tokens but the last and pass the whole prompt to ``generate``
    (it feeds only the tokens the cache has not seen). Raises, changing nothing, for a ``chunk``
    below 1, ``ids`` that are not a non-empty 2-D tensor of token ids, a cache that is not a
    ``KVCache`` or a mask of the wrong shape.
    """
    _check(ids, cache, chunk, attention_mask)
    from tqdm.auto import tqdm

    batch, length = ids.shape
    seen = cache.seen
    positions = None if attention_mask is None else mask_positions(attention_mask)
    logits = None
    with torch.no_grad(), use_kvcache_attention(model), tqdm(total=length, unit="tok", disable=not progress) as bar:
        for start in range(0, length, chunk):
            stop = min(length, start + chunk)
            kwargs = {}
            if attention_mask is not None:  # generate's positions: a padded row's real tokens count from 0
                kwargs = {"attention_mask": attention_mask[:, : seen + stop], "position_ids": positions[:, seen + start : seen + stop]}
            out = model(input_ids=ids[:, start:stop], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1, **kwargs)
            logits = out.logits[:, -1]
            del out  # the chunk's hidden states go before the next chunk comes
            bar.update(stop - start)
            if after_chunk is not None:
                after_chunk(stop)
    return logits


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s position ids ``[B, T]`` for a left-padded 2-D mask: real tokens count from 0
    (pads get 0; they are masked out)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def check_chunk(chunk: object) -> None:
    """Raise ``ValueError`` unless ``chunk`` is a whole number of tokens >= 1."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number of tokens >= 1, got {chunk!r}")


def check_token_ids(ids: object, name: str, shape: str) -> None:
    """Raise ``ValueError`` unless ``ids`` is a 2-D integer tensor (``name`` and ``shape`` say what was expected)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        got = f"a {ids.dim()}-D {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be token ids {shape} (a 2-D integer tensor), got {got}")


def _check(ids, cache, chunk, attention_mask) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"prefill expects a kvcache.KVCache (kvcache.make_cache(model, spec)), got {type(cache).__name__}; "
            "for transformers' own caches use model.generate(..., prefill_chunk_size=N)"
        )
    check_chunk(chunk)
    check_token_ids(ids, "ids", "[B, S]")
    if ids.shape[1] == 0:
        raise ValueError(f"ids must hold at least one token, got shape {tuple(ids.shape)}")
    if attention_mask is not None:
        expected = (ids.shape[0], cache.seen + ids.shape[1])
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != expected:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(
                f"attention_mask must be [B, seen + S] = {list(expected)} (the cache's {cache.seen} tokens and "
                f"these {ids.shape[1]}), got {got}"
            )
