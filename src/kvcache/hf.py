"""The bridge to ``transformers``: a per-layer adapter and the ``"kvcache"`` attention registration.

``HFLayer`` wraps one of our storage layers in the interface that ``transformers.Cache`` and the
models call (``update``, ``get_mask_sizes``, ``crop``, ...). Our storage returns keys in order, the
kept past then the new tokens, so the mask ``transformers`` builds from ``get_mask_sizes`` is
``kv_length = length + query_length`` starting at absolute position ``seen - length``.

``register_attention()`` adds ``"kvcache"`` to the attention implementations (the one documented
piece of global state). ``use_kvcache_attention(model)`` switches a model to it, for good or, as a
context manager, for a block; it then runs ``attend`` for decode steps where it measured faster
(grouped heads; long multi-head caches) and torch's SDPA otherwise, prefill included. Nothing
else in the library changes a model's attention implementation.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import eager_mask, sdpa_mask

import torch.nn.functional as F

from .attention import _DECODE_ROWS as DECODE_ROWS
from .attention import attend
from .errors import UnsupportedOperation
from .layers import KVLayer

ATTENTION_NAME = "kvcache"

#: The one line that fixes a model running another attention, quoted by every error that needs it.
SWITCH_HINT = "kvcache.use_kvcache_attention(model)"


class use_kvcache_attention:
    """Switch ``model`` to the ``"kvcache"`` attention implementation.

    Called plainly, the switch stays (``kvcache.use_kvcache_attention(model)``); used as a context
    manager (``with kvcache.use_kvcache_attention(model): ...``), the model's previous
    implementation comes back when the block ends, also on an error. Bounded caches need it (their
    slots are not the past in order); unbounded ones are faster with it for decode with grouped
    heads. Works on anything with ``set_attn_implementation`` (every ``transformers`` model).
    """

    def __init__(self, model) -> None:
        if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
            raise TypeError(
                f"use_kvcache_attention expects a transformers model (with set_attn_implementation), "
                f"got {type(model).__name__}"
            )
        self.model = model
        self.previous = model.config._attn_implementation
        # A model written only for eager attention may rely on eager's additive masks (it adds
        # biases to them, or has no causal flag of its own): it gets those masks (see kvcache_mask).
        self.flagged = [] if getattr(model, "_supports_sdpa", True) else _configs(model)
        self.flags_before = [getattr(c, EAGER_MASKS, None) for c in self.flagged]
        for config in self.flagged:
            setattr(config, EAGER_MASKS, True)
        if self.previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)

    def __enter__(self):
        return self.model

    def __exit__(self, *exc) -> None:
        if self.model.config._attn_implementation != self.previous:
            self.model.set_attn_implementation(self.previous)
        for config, before in zip(self.flagged, self.flags_before):
            if before is None:
                delattr(config, EAGER_MASKS)
            else:
                setattr(config, EAGER_MASKS, before)


#: Set on the configs of a switched model that does not support SDPA: its masks are eager's.
EAGER_MASKS = "_kvcache_eager_masks"


def _configs(model) -> list:
    """The model's config and its text (decoder) config, once each."""
    out = [model.config]
    text = model.config.get_text_config(decoder=True)
    return out if text is model.config else [*out, text]


def kvcache_mask(*args, **kwargs):
    """The ``"kvcache"`` mask function: SDPA's (boolean, skipped where ``is_causal`` does the job),
    or eager's additive float masks for models that support only eager attention, which may add
    their own biases to the mask or rely on it for causality (bigbird_pegasus, DeepSeek-V4)."""
    if getattr(kwargs.get("config"), EAGER_MASKS, False):
        return eager_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)


def runs_kvcache_attention(config) -> bool:
    """Whether a (text) config selects the ``"kvcache"`` attention implementation."""
    return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


class HFLayer(CacheLayerMixin):
    """One ``transformers`` cache layer backed by a ``KVLayer`` store."""

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, store: KVLayer) -> None:  # no super().__init__: keys/values are properties
        self.store = store

    def __repr__(self) -> str:
        return f"HFLayer({self.store!r})"

    @property
    def is_sliding(self) -> bool:
        return self.store.is_sliding

    @property
    def is_initialized(self) -> bool:
        return self.store.initialized

    @property
    def keys(self) -> torch.Tensor | None:
        return self.store.view()[0]

    @property
    def values(self) -> torch.Tensor | None:
        return self.store.view()[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # `early_initialization` passes empty [B, H, 0, D] tensors: an empty append fixes the geometry
        # (and allocates a static layer's buffers up front).
        if not self.store.initialized:
            self.store.update(key_states[:, :, :0], value_states[:, :, :0])
            if self.store.needs_own_attention:
                self.store.skip_attention()  # no queries come for an empty append

    def update(self, key_states, value_states, *args, **kwargs):
        store = self.store
        if not store.needs_own_attention:
            return store.update(key_states, value_states)
        if store.awaiting_attention:
            raise UnsupportedOperation(
                f"a {store.kind} cache layer needs the 'kvcache' attention implementation, and the last "
                f"forward pass attended without it; call {SWITCH_HINT} first"
            )
        keys, values = store.update(key_states, value_states)
        keys.kvcache_layer = store  # hf_attention_forward hands the queries to the store
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.store.needs_own_attention:
            # Bounded stores mask by each slot's absolute position: ask for every column.
            return self.store.seen + query_length, 0
        return self.store.length + query_length, self.store.seen - self.store.length

    def get_seq_length(self) -> int:
        return self.store.seen

    def get_max_length(self) -> int:
        return getattr(self.store, "max_length", -1)

    def reset(self) -> None:
        self.store.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.store.trim(crop_count(tokens_to_remove))

    def activate_past_recording(self) -> None:
        """``generate`` calls this before speculative decoding, whose rejected tokens ``crop`` removes:
        a window layer then logs what it overwrites so it can take them back (``layers/rollback.py``)."""
        self.record_past = True

    @property
    def record_past(self) -> bool:
        return getattr(self.store, "journal", None) is not None

    @record_past.setter
    def record_past(self, on: bool) -> None:  # generate sets it False when it hands the cache back
        if hasattr(self.store, "activate_past_recording"):
            self.store.activate_past_recording(bool(on))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select(indices)

    def offload(self) -> None:
        raise UnsupportedOperation("kvcache layers do not support offloading to CPU")

    def prefetch(self) -> None:
        raise UnsupportedOperation("kvcache layers do not support offloading to CPU")


def crop_count(tokens_to_remove: int) -> int:
    """Hugging Face ``crop`` semantics: a negative count removes that many tokens, 0 does nothing.

    Returns the number of tokens to trim. A positive count (the old "crop to this length") is
    refused, as ``transformers`` 5 refuses it.
    """
    n = int(tokens_to_remove)
    if n > 0:
        raise ValueError(
            f"crop({n}): pass a negative number of tokens to remove (e.g. crop(-{n})); "
            "cropping to an absolute length is not supported, as in transformers 5"
        )
    return -n


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention interface over ``attend``: returns ``[B, Sq, Hq, Dv]``.

    Learned attention sinks (``s_aux``, ``[Hq]``: gpt-oss and others) go to ``attend``, which SDPA
    cannot do; a model's per-head masks (``[B, Hq, Sq, T]``) are taken as they come."""
    if dropout and module.training:
        raise UnsupportedOperation("kvcache attention is for inference: dropout is not supported")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    store = getattr(key, "kvcache_layer", None)
    if store is not None:  # a bounded layer: it knows its slots' positions
        out = store.attend(query, scale=scaling, softcap=softcap, mask=attention_mask, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    group = query.shape[1] // key.shape[1]
    kv_bytes = key.numel() * key.element_size() + value.numel() * value.element_size()
    if softcap is not None or sinks is not None or prefer_attend(query.shape[2], group, key.shape[2], kv_bytes):
        out = attend(query, key, value, scale=scaling, mask=attention_mask, causal=causal, softcap=softcap, sinks=sinks)
    else:
        # Prefill: torch's fused kernel is the faster one here. transformers passes no mask only
        # when the pattern is plain causal with queries and keys aligned, so is_causal is right.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal, enable_gqa=group > 1
        )
    return out.transpose(1, 2).contiguous(), None


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


def register_attention() -> str:
    """Register ``attend`` as the ``"kvcache"`` attention implementation; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvcache_mask)
    return ATTENTION_NAME
