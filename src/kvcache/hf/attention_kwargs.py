"""What a model's attention call passes besides query, key, value and mask, and how the
``"kvcache"`` attention applies each.

``transformers`` models call their attention implementation with keywords of their own: a logit
cap (Gemma 2), learned or per-query attention sinks (gpt-oss, Inkling 2), relative-position
logits added to the scores (Inkling: ``position_bias``), the keys a sparse indexer chose per query
(DeepSeek V3.2, dots3: ``indices``), and bookkeeping that other implementations read (flash
attention's packed-sequence offsets). Every keyword that changes the result is applied here; a
keyword known not to matter here is ignored; any other that carries a tensor is refused, naming
it, instead of being dropped, since a dropped bias or index gives wrong tokens without a word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedOperation

#: Keywords that do not change what the ``"kvcache"`` attention computes: the mask transformers
#: builds already carries the sliding window and the packing of packed sequences (which flash
#: attention reads from ``cu_seq_lens_*``), and the rest are flags for other code.
IGNORED = frozenset(
    {
        "sliding_window", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
        "output_attentions", "output_hidden_states", "output_router_logits", "num_items_in_batch", "deterministic",
        "use_cache", "cache_position", "return_dict", "layer_idx",
    }
)


@dataclass(frozen=True)
class AttentionExtras:
    """The keywords of one attention call that change its result."""

    #: Gemma 2's attention logit cap: ``softcap * tanh(score / softcap)``.
    softcap: float | None = None
    #: One extra logit per query head ``[Hq]`` (``s_aux``), or per query row ``[B|1, Hq, Sq|1, 1]`` (``sinks``).
    sinks: torch.Tensor | None = None
    #: Logits added to the scores, over the keys as the cache returned them: ``[B|1, Hq|1, Sq, T]``.
    bias: torch.Tensor | None = None
    #: The keys each query may attend, chosen by a sparse indexer: ``[B, Sq, k]`` indices into ``T``.
    indices: torch.Tensor | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> AttentionExtras:
        """The extras of an attention call's keywords; ``UnsupportedOperation`` naming a keyword
        that carries a tensor the ``"kvcache"`` attention does not know how to apply."""
        unknown = [
            name for name, value in kwargs.items()
            if name not in IGNORED and name not in _APPLIED and _carries_tensor(value)
        ]
        if unknown:
            raise UnsupportedOperation(
                f"this model's attention passes {', '.join(map(repr, unknown))}, which the 'kvcache' attention does "
                f"not apply (running without it would give wrong tokens); run the model on its own attention: "
                f"make_cache(model) with 'growable', 'static' or 'concat' works there without use_kvcache_attention"
            )
        if kwargs.get("s_aux") is not None and kwargs.get("sinks") is not None:
            raise UnsupportedOperation("this model's attention passes both 's_aux' and 'sinks'; expected one kind of sink")
        sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
        return cls(kwargs.get("softcap"), sinks, kwargs.get("position_bias"), kwargs.get("indices"))

    @property
    def changes_mask(self) -> bool:
        return self.bias is not None or self.indices is not None

    def mask_over_keys(self, mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device) -> torch.Tensor | None:
        """``mask`` (boolean, True = attend, or additive float; None with ``causal``: causal aligned
        to the end) with ``indices`` and ``bias`` folded in, over ``kv_len`` keys in position order:
        ``[B|1, Hq|1, Sq, T]``, float when there is a bias."""
        if mask is None and causal and q_len > 1:
            query_at = torch.arange(q_len, device=device).view(-1, 1) + (kv_len - q_len)
            mask = torch.arange(kv_len, device=device).view(1, -1) <= query_at
        if self.indices is not None:
            chosen = torch.zeros(self.indices.shape[0], 1, q_len, kv_len, dtype=torch.bool, device=self.indices.device)
            chosen.scatter_(-1, self.indices.long().unsqueeze(1), True)
            mask = chosen if mask is None else (mask & chosen if mask.dtype == torch.bool else mask.masked_fill(~chosen, -math.inf))
        if self.bias is not None:
            if mask is None:
                mask = self.bias
            elif mask.dtype == torch.bool:
                mask = self.bias.masked_fill(~mask, -math.inf)
            else:
                mask = self.bias + mask
        return mask


#: The keywords ``AttentionExtras`` applies.
_APPLIED = frozenset({"softcap", "s_aux", "sinks", "position_bias", "indices"})


def _carries_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)
