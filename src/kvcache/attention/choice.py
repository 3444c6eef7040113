"""The SDPA-or-``attend`` choice for keys and values in order (unbounded caches, no cache).

``attend`` reads K/V once per KV head and wins decode steps where that matters; torch's fused
SDPA wins prefill and small decode calls. ``fastest_attention`` picks per call from the
measurements below (``kvcache bench attention``); bounded layers always take ``attend``.
(Inside ``attend``, which path runs, SDPA, the C++ decode or blockwise, is ``kernel.route``'s choice.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernel import DECODE_ROWS, attend

#: Below this many cached tokens, torch's SDPA is faster than ``attend`` for plain multi-head
#: decode on the CPU (``kvcache bench attention``: at 1K, 106% vs 55% of read bandwidth; from 4K
#: on, ``attend`` is level or ahead).
MHA_ATTEND_FROM = 4096

#: With grouped heads ``attend`` wins once the keys and values it reads outweigh its fixed cost
#: per call (about 45 us on a 2-core CPU): SDPA's grouped path is faster below about this many
#: bytes of keys + values per call and falls far behind above (measured, B=1 decode, fp32:
#: 2 KV heads x 32 at 1K tokens (0.5 MiB) SDPA 37 us vs attend 67 us; at 16K (8 MiB) 521 vs
#: 366 us; 8 KV heads x 128 with 4 query heads each at 4K (32 MiB) 14.1 ms vs 1.1 ms).
GQA_ATTEND_FROM_BYTES = 6 * 2**20


def prefer_attend(q_len: int, group: int, kv_len: int, kv_bytes: int | None = None) -> bool:
    """Whether ``attend`` is the faster choice for this call (decode shapes), per the benchmarks.
    ``kv_bytes``: bytes of the keys and values the call reads (None: assume large)."""
    if q_len * group > DECODE_ROWS:
        return False
    if group > 1:
        return kv_bytes is None or kv_bytes >= GQA_ATTEND_FROM_BYTES
    return kv_len >= MHA_ATTEND_FROM


#: The keywords the SDPA path knows how to pass on (softcap and sinks only as None); a call with
#: any other goes to ``attend``, which takes it or raises its ``TypeError``.
_SDPA_OPTIONS = frozenset({"scale", "mask", "causal", "softcap", "sinks"})


def fastest_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> torch.Tensor:
    """``attend(query, key, value, **options)``'s result ``[B, Hq, Sq, Dv]`` from whichever of
    ``attend`` and torch's SDPA is faster for these shapes; softcap and sinks need ``attend``.
    ``causal`` as in SDPA's ``is_causal`` (queries and keys aligned) when SDPA runs."""
    group = query.shape[1] // key.shape[1]
    kv_bytes = key.numel() * key.element_size() + value.numel() * value.element_size()
    sdpa_can = options.keys() <= _SDPA_OPTIONS and options.get("softcap") is None and options.get("sinks") is None
    if not sdpa_can or prefer_attend(query.shape[2], group, key.shape[2], kv_bytes):
        return attend(query, key, value, **options)
    mask, scale, causal = options.get("mask"), options.get("scale"), options.get("causal", False)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=group > 1)
