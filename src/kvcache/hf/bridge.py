"""The bridge to ``transformers``: a per-layer adapter and the ``"kvcache"`` attention registration.

``HFLayer`` wraps one of our storage layers in the interface that ``transformers.Cache`` and the
models call (``update``, ``get_mask_sizes``, ``crop``, ...). The mask ``transformers`` builds from
``get_mask_sizes`` covers absolute positions ``0..seen + query_length - 1``: unbounded layers hold
exactly that past in order, and bounded layers pick its columns at their slots' positions
(``attention.masks``) after ``boolean_mask`` turned it into booleans, here and only here.

``register_attention()`` adds ``"kvcache"`` to the attention implementations (the one documented
piece of global state). ``use_kvcache_attention(model)`` switches a model to it, for good or, as a
context manager, for a block; it then runs ``attend`` for decode steps where it measured faster
(grouped heads; long multi-head caches) and torch's SDPA otherwise, prefill included
(``attention.choice``). Nothing else in the library changes a model's attention implementation.

How the attention finds a bounded layer: transformers calls ``cache.update(k, v, layer_idx)`` and
passes the keys and values it returns to the attention function, which does not receive the cache.
So the keys carry their reader: ``HFLayer.update`` names the own-attention layer on the key tensor
it hands out (``hand_out``: a weak reference under ``READER``), and ``hf_attention_forward`` takes
the layer from the ``key`` it receives (``reading_layer``), only while that layer's pending read
record is the one that handed out this very tensor (identity), so a stale record never applies. A
layer reusing another's keys and values (Gemma 3n / 4) receives the owner's key and so reads the
owner's record. Anything else (a key the model changed, a cache of in-order layers) is plain
attention over the key and value as given. Both steps trace under ``torch.compile``; the
fixed-shape layers' own bridge is ``compiled.FixedHFLayer``.

Design: docs/architecture.md, "The transformers bridge".
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask

from ..attention import attend, fastest_attention
from ..errors import UnsupportedOperation
from ..layers import KVLayer
from .attention_kwargs import AttentionExtras
from .support import NONCAUSAL_FLAG, noncausal_attention

ATTENTION_NAME = "kvcache"

#: The keyword under which a forward pass carries its step down to the attention calls, which hand
#: it the query, keys and values: the engine's (``engine.step.PagedStep``, over its block pool) and
#: a training chunk's (``train.replay.ChunkStep``, over a cache state that gradients reach).
FORWARD_STEP = "kvcache_forward_step"


class ForwardStep(Protocol):
    """What a forward pass carries under ``FORWARD_STEP``: it attends each of the model's attention
    calls itself (writing the new keys and values where it keeps them)."""

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:  # fmt: skip
        """``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, S, D|Dv]`` of ``module``'s call
        (rotary positions applied), ``kwargs`` the model's other attention keywords; returns
        ``[B, S, Hq, Dv]``."""
        ...

#: The one line that fixes a model running another attention, quoted by every error that needs it.
SWITCH_HINT = "kvcache.use_kvcache_attention(model)"


class use_kvcache_attention:
    """Switch ``model`` to the ``"kvcache"`` attention implementation.

    Called plainly, the switch stays (``kvcache.use_kvcache_attention(model)``); used as a context
    manager (``with kvcache.use_kvcache_attention(model): ...``), the model's previous
    implementation comes back when the block ends, also on an error. Bounded caches need it (their
    slots are not the past in order); unbounded ones are faster with it for decode with grouped
    heads. Works on anything with ``set_attn_implementation`` (every ``transformers`` model).

    Blocks on one model may overlap (threads sharing a model, nested blocks): the model is
    switched while any of them runs and the implementation it had before the first comes back
    when the last ends. A plain call holds the switch for good, so no later block undoes it, until
    the model is switched to another implementation by hand: a block after that puts that one back.
    """

    def __init__(self, model) -> None:
        if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
            raise TypeError(
                f"use_kvcache_attention expects a transformers model (with set_attn_implementation), "
                f"got {type(model).__name__}"
            )
        self.model = model
        with _SWITCHED_LOCK:
            held = _SWITCHED.get(model)
            if held is None or model.config._attn_implementation != ATTENTION_NAME:
                # Not switched, or switched away since by someone else: what it runs now is what
                # the blocks from here on put back.
                _SWITCHED[model] = held = _Switched.of(model)
            held.holders += 1
            if model.config._attn_implementation != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)

    def __enter__(self):
        return self.model

    def __exit__(self, *exc) -> None:
        with _SWITCHED_LOCK:
            held = _SWITCHED.get(self.model)
            if held is None:  # exited twice
                return
            held.holders -= 1
            if held.holders == 0:
                del _SWITCHED[self.model]
                held.restore(self.model)


class _Switched:
    """What a switch changed on a model, to put back when the last block on it ends: the
    attention implementation it had and the flags set on its configs (each with its old value)."""

    def __init__(self, previous: str, flags: list[tuple[object, str, object]]) -> None:
        self.previous, self.flags, self.holders = previous, flags, 0

    @classmethod
    def of(cls, model) -> "_Switched":
        """Set the flags a switched ``model`` needs on its configs; the record of what was there."""
        # A model written only for eager attention may rely on eager's additive masks (it adds
        # biases to them, or has no causal flag of its own): it gets those masks (see kvcache_mask).
        flagged = [] if getattr(model, "_supports_sdpa", True) else _configs(model)
        # A model whose attention is not causal: bounded caches refuse it up front (``support.py``).
        noncausal = noncausal_attention(model)
        wanted = [(c, EAGER_MASKS, True) for c in flagged] + [(c, NONCAUSAL_FLAG, noncausal) for c in _configs(model) if noncausal]
        record = cls(model.config._attn_implementation, [(c, name, getattr(c, name, None)) for c, name, _ in wanted])
        for config, name, value in wanted:
            setattr(config, name, value)
        return record

    def restore(self, model) -> None:
        if model.config._attn_implementation != self.previous:
            model.set_attn_implementation(self.previous)
        for config, name, before in self.flags:
            if before is None:
                delattr(config, name)
            else:
                setattr(config, name, before)


#: Models switched now, with what to put back (weak: a model that goes away takes its entry).
_SWITCHED: "weakref.WeakKeyDictionary[object, _Switched]" = weakref.WeakKeyDictionary()
_SWITCHED_LOCK = threading.Lock()


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
    if not args and causal_after_past(**kwargs):
        return None  # a chunk after the past: causal aligned to the end, masked per block (hf_attention_forward)
    mask = sdpa_mask(*args, **kwargs)
    if mask is None and not args and 1 < kwargs.get("q_length", 1) < kwargs.get("kv_length", 1):
        # SDPA's is_causal over a fixed capacity (queries aligned to its start) would read as the
        # end-aligned causal above: such a prefill gets its mask.
        mask = sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
    return mask


def causal_after_past(
    q_length: int = 1,
    kv_length: int = 1,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **_,
) -> bool:
    """Whether the mask asked for is plain causal over keys that are the past in order followed by
    the queries (``kv_length == q_offset + q_length``, no padding, no window): the ``"kvcache"``
    attention then masks by the end-aligned causal rule a block of query rows at a time, so a
    chunked prefill never builds a ``chunk x context`` mask."""
    if not allow_is_causal_skip or mask_function is not causal_mask_function or local_size is not None:
        return False
    if not isinstance(q_offset, int) or kv_offset != 0 or kv_length != q_offset + q_length or q_length < 2:
        return False
    if torch.compiler.is_compiling():
        return False
    return attention_mask is None or bool(attention_mask[:, -kv_length:].all())


def runs_kvcache_attention(config) -> bool:
    """Whether a (text) config selects the ``"kvcache"`` attention implementation."""
    return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


class HFLayer(CacheLayerMixin):
    """One ``transformers`` cache layer backed by a kvcache ``KVLayer`` (``layer``)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, layer: KVLayer, attended_by: int = 1) -> None:  # no super().__init__: keys/values are properties
        self.layer = layer
        #: Attention calls that attend each update of an own-attention layer: its own, plus one per
        #: later layer reusing its keys and values (``cache.kv_attended_by``); passed with every update.
        self.attended_by = attended_by

    def __repr__(self) -> str:
        return f"HFLayer({self.layer!r})"

    @property
    def is_sliding(self) -> bool:
        return self.layer.is_sliding

    @property
    def is_initialized(self) -> bool:
        return self.layer.initialized

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys ``[B, Hkv, L, D]``; one view (one dequantization) per change of the layer."""
        return self.layer.memo_view()[0]

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values ``[B, Hkv, L, Dv]``; one view per change of the layer."""
        return self.layer.memo_view()[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # `early_initialization` passes empty [B, H, 0, D] tensors: an empty append fixes the geometry
        # (and allocates a static layer's buffers up front). No queries come for it: the next update settles it.
        if not self.layer.initialized:
            self.layer.update(key_states[:, :, :0], value_states[:, :, :0])

    def update(self, key_states, value_states, *args, **kwargs):
        if self.layer.needs_own_attention:
            key, value = self.layer.update(key_states, value_states, self.attended_by)
            return hand_out(self.layer, key), value
        return self.layer.update(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.layer.seen

    def get_max_length(self) -> int:
        return getattr(self.layer, "max_length", -1)

    def reset(self) -> None:
        self.layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.layer.trim(crop_count(tokens_to_remove))

    def activate_past_recording(self) -> None:
        """``generate`` calls this before speculative decoding, whose rejected tokens ``crop`` removes:
        a window layer then logs what it overwrites so it can take them back (``layers/rollback.py``)."""
        self.record_past = True

    @property
    def record_past(self) -> bool:
        return self.layer.recording_past

    @record_past.setter
    def record_past(self, on: bool) -> None:  # generate sets it False when it hands the cache back
        self.layer.activate_past_recording(bool(on))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.layer.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.layer.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.layer.select(indices)

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


#: The attribute under which a key tensor handed to the model names (a weak reference) the
#: own-attention layer whose read record it is.
READER = "_kvcache_reader"


def hand_out(layer: KVLayer, key: torch.Tensor) -> torch.Tensor:
    """``key`` (what ``layer``'s update returned), naming ``layer`` as its reader."""
    setattr(key, READER, weakref.ref(layer))
    return key


def reading_layer(key: torch.Tensor) -> KVLayer | None:
    """The own-attention layer whose pending read record handed out ``key`` (``hand_out``), or None:
    none named, or the record already attended (a stale key)."""
    ref = getattr(key, READER, None)
    layer = ref() if ref is not None else None
    if layer is None or layer.pending is None or layer.pending.returned[0] is not key:
        return None
    return layer


def boolean_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' attention mask as booleans (True = attend): an additive float mask counts as
    masked where it is at most half the dtype's lowest value (how transformers writes "masked")."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


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
    """``transformers`` attention interface over kvcache's attention: returns ``[B, Sq, Hq, Dv]``.

    A forward pass that carries a step (a ``FORWARD_STEP`` keyword: the engine's, over its block pool;
    a training chunk's, over a cache state) is attended by that step. A bounded layer's read (found as the module docstring says) is attended by that layer, which
    masks by absolute position and settles; anything else runs ``fastest_attention`` over the key
    and value as given. The model's other keywords (``attention_kwargs``: a logit cap, attention
    sinks, relative-position logits, a sparse indexer's choice) are applied or refused, never
    dropped; a model's per-head masks (``[B, Hq, Sq, T]``) are taken as they come."""
    if dropout and module.training:
        raise UnsupportedOperation("kvcache attention does not apply attention dropout; set the model's attention_dropout to 0 or call model.eval()")
    step: ForwardStep | None = kwargs.pop(FORWARD_STEP, None)
    if step is not None:  # the engine's step (its pool) or a training chunk's (a cache state)
        return step.attend(module, query, key, value, scaling, kwargs), None
    extras = AttentionExtras.from_kwargs(kwargs)
    layer = reading_layer(key)
    if layer is not None:
        if value is not layer.pending.returned[1] or is_causal is False or getattr(module, "is_causal", True) is False:
            raise UnsupportedOperation(
                f"a {layer.kind} layer attends the keys and values it returned, causally; this model's attention "
                f"{'changed the values' if value is not layer.pending.returned[1] else 'is not causal'}; use an unbounded "
                f"kind (growable, static, concat)"
            )
        if extras.indices is not None:
            raise UnsupportedOperation(
                f"a {layer.kind} layer keeps its slots out of position order, so it cannot apply the keys this "
                f"model's sparse indexer chose by index; use an unbounded kind (growable, static, concat)"
            )
        out = layer.attend(
            query, scale=scaling, softcap=extras.softcap, mask=boolean_mask(attention_mask), sinks=extras.sinks, bias=extras.bias
        )
        return out.transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # No mask means plain causal: queries and keys aligned (SDPA's is_causal), or a chunk after the
    # past in order (``causal_after_past``: causal aligned to the end, which ``attend`` does).
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    if extras.changes_mask:  # one explicit mask over the keys as given
        mask = extras.mask_over_keys(attention_mask, query.shape[2], key.shape[2], causal, query.device)
        out = attend(query, key, value, scale=scaling, mask=mask, softcap=extras.softcap, sinks=extras.sinks)
        return out.transpose(1, 2).contiguous(), None
    if causal and key.shape[2] > query.shape[2]:  # a chunk after the past (causal_after_past): blockwise, end-aligned
        out = attend(query, key, value, scale=scaling, causal=True, softcap=extras.softcap, sinks=extras.sinks)
        return out.transpose(1, 2).contiguous(), None
    out = fastest_attention(
        query, key, value, scale=scaling, mask=attention_mask, causal=causal, softcap=extras.softcap, sinks=extras.sinks
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ``attend`` as the ``"kvcache"`` attention implementation; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvcache_mask)
    return ATTENTION_NAME
