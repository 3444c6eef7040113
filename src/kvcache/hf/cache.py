"""The model-level cache: one storage layer per transformer layer, as a ``transformers.Cache``.

``build.make_cache`` makes one for a model; ``cachefile.load_cache`` loads one from a file that
``KVCache.save`` wrote. It goes straight into ``model.generate(..., past_key_values=cache)`` or a
plain forward loop.

Design: docs/architecture.md, "The transformers bridge".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DummyLayer

from . import foreign
from ..errors import ShapeError, UnsupportedOperation
from ..persist.fingerprint import fingerprint_of
from .foreign import ForeignLayers
from .compiled import hf_layer
from .bridge import SWITCH_HINT, crop_count, runs_kvcache_attention
from ..layers.base import check_kv
from ..layers import KVLayer, LayerState
from ..persist import SavedCache, encode_cache, write_cache_file
from .spec import CacheSpec
from .support import switched_refusal


@dataclass
class CacheSnapshot:
    """An in-process copy of a cache's content, for ``KVCache.restore``."""

    states: list[LayerState | None]
    #: Copies of Hugging Face's layers (or linear states) that the cache keeps for non-attention layers.
    others: dict[int, tuple[str, Any]] = field(default_factory=dict)


class KVCache(ForeignLayers, Cache):
    """A ``transformers.Cache`` whose layers are kvcache storage layers.

    ``kv_layers[i]`` is layer i's ``KVLayer`` (None for layers that keep no cache, or no K/V of
    kvcache's). ``others[i] = (layer_type, layer)`` holds Hugging Face's own layer for layers that
    are not plain attention (linear attention, conv, mamba, indexed attention; see ``foreign``), or
    the linear state of a hybrid layer. Everything
    ``generate`` uses is here: ``get_seq_length``, ``get_mask_sizes``, ``crop``, ``reorder_cache``,
    ``batch_repeat_interleave``, ``batch_select_indices``, ``reset``.
    """

    #: The conversation's token ids a loaded file was saved with (``save(path, token_ids=...)``);
    #: None for a cache made here, or loaded from a file without them. Appends do not change it.
    token_ids: list[int] | None = None

    def __init__(
        self,
        kv_layers: list[KVLayer | None],
        spec: CacheSpec,
        config_summary: dict[str, Any] | None = None,
        attention_config: PretrainedConfig | None = None,
        others: dict[int, tuple[str, Any]] | None = None,
    ) -> None:
        self.kv_layers = list(kv_layers)
        self._set_others(others or {})
        self.spec = spec
        self.config_summary = config_summary
        #: The (text) config of the model this cache was made for: own-attention layers check, before
        #: anything is written, that it selects the "kvcache" attention.
        self.attention_config = attention_config
        self._live = [s for s in self.kv_layers if s is not None]
        # Fixed for the cache's life (the layers are never swapped), and read on every forward pass.
        #: The layers whose attention must read their update's record (``layers/own_attention.py``).
        self.own_attention_layers = [s for s in self._live if s.needs_own_attention]
        self._own_attention_kinds = sorted({s.kind for s in self.own_attention_layers})
        #: Per layer, the attention calls that attend each of its updates (``kv_attended_by``): its
        #: bridge passes them to an own-attention layer with every update.
        self.attended_by = kv_attended_by(attention_config, len(self.kv_layers))
        # Only fixed-capacity kinds can refuse an append; the others need no check per step.
        self._can_refuse = [s for s in self._live if type(s).check_append is not KVLayer.check_append]
        self._first_live = next((i for i, s in enumerate(self.kv_layers) if s is not None), -1)
        self._first_state = min(([self._first_live] if self._first_live >= 0 else []) + list(self.linear), default=-1)
        super().__init__(layers=[
            hf_layer(s, self.attended_by[i]) if s is not None else self._slot_layer(i, DummyLayer()) for i, s in enumerate(self.kv_layers)
        ])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Append to layer ``layer_idx``. Before the first layer of a forward pass writes, every
        layer is asked whether the new tokens fit, so a full static layer raises before any layer
        has changed (layers stay in step)."""
        # A compiled forward pass skips the checks: they read Python counts that would be baked into
        # the graph (the fixed-shape layers it compiles for refuse an overflow in index_copy_).
        if layer_idx == self._first_live and key_states is not None and not torch.compiler.is_compiling():
            self.check_attention()
            self._check_attended()
            for layer in self._can_refuse:
                layer.check_append(key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def extend(self, past: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Append keys/values computed elsewhere (e.g. another cache's ``[(keys, values), ...]``,
        ``[B, Hkv, S, D]`` per layer, None for layers without a cache), with no attention pass:
        own-attention layers settle at once, keeping what their policy keeps without attention scores."""
        foreign.refuse("extend", self.other_kinds, "extend works on caches whose layers are all attention (or dummy)")
        if len(past) != len(self.kv_layers):
            raise ShapeError(f"extend: expected one (keys, values) per layer ({len(self.kv_layers)}), got {len(past)}")
        for layer, pair in zip(self.kv_layers, past):
            if (layer is None) != (pair is None):
                raise ShapeError("extend: layers without a cache need None, the others a (keys, values) pair")
            if layer is not None:
                check_kv(*pair, layer.geometry)  # every layer checked before any changes
                layer.check_append(pair[0].shape[2])
        for layer, pair in zip(self.kv_layers, past):
            if layer is not None:
                layer.update(*pair)
                layer.settle()

    def _check_attended(self) -> None:
        """Raise, changing nothing, if an own-attention layer's last update went unattended through the model:
        its attention did not run the "kvcache" implementation (or did not get the keys the layer
        handed out), so it did not mask by position. (``extend`` and direct use settle instead.)"""
        for layer in self.own_attention_layers:
            if layer.unattended:
                raise UnsupportedOperation(
                    f"a {layer.kind} cache layer needs the 'kvcache' attention implementation, and the last "
                    f"forward pass attended without it; call {SWITCH_HINT} first; the cache is unchanged"
                )

    @property
    def needs_kvcache_attention(self) -> bool:
        """Whether a layer attends its own slots (window, eviction kinds, quantized), so the model must
        run the ``"kvcache"`` attention."""
        return bool(self._own_attention_kinds)

    def check_attention(self) -> None:
        """Raise, changing nothing, if an own-attention layer would be attended by another implementation
        than ``"kvcache"`` (read from the config of the model the cache was made for)."""
        config = self.attention_config
        if config is None or not self._own_attention_kinds:
            return
        if not runs_kvcache_attention(config):
            raise UnsupportedOperation(
                f"this cache has layers ({', '.join(self._own_attention_kinds)}) that need the 'kvcache' attention "
                f"implementation, and the model runs {config._attn_implementation!r}; call {SWITCH_HINT} "
                f"(or use it as a context manager around generate) first; the cache is unchanged"
            )
        refusal = switched_refusal(config)  # what the switch found in the model's modules
        if refusal is not None:
            raise UnsupportedOperation(
                f"this cache has layers ({', '.join(self._own_attention_kinds)}) that attend their own slots, which cannot serve this model: "
                f"{refusal}; use an unbounded kind ('growable', 'static', 'concat'); the cache is unchanged"
            )

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values across all layers, and for the state of Hugging
        Face's layers kept for non-attention layers."""
        return sum(s.nbytes for s in self._live) + self.others_nbytes

    @property
    def reallocations(self) -> int:
        """Store allocations across all layers (the first allocation of each counts)."""
        return sum(s.reallocations for s in self._live)

    @property
    def seen(self) -> int:
        """Tokens appended so far: the position of the next token."""
        return int(self.get_seq_length())

    @property
    def fingerprint(self) -> str | None:
        return None if self.config_summary is None else fingerprint_of(self.config_summary)

    # ---- rollback, snapshots, forks -------------------------------------------------------

    def crop(self, tokens_to_remove: int) -> None:
        """Hugging Face semantics: ``crop(-n)`` removes the last n tokens; ``crop(0)`` does nothing.

        Raises, changing nothing, if any layer cannot remove them (more than stored, or tokens a
        sliding window already dropped).
        """
        n = crop_count(tokens_to_remove)
        for i, (kind, layer) in self.others.items():
            foreign.check_crop(layer, kind, i, n)
        for layer in self._live:
            layer.check_trim(n)
        for layer in self._live:
            layer.trim(n)
        for _, layer in self.others.values():
            foreign.crop(layer, n)

    def snapshot(self) -> CacheSnapshot:
        """A copy of the content that ``restore`` brings back bit-exactly."""
        others = {i: (kind, foreign.clone(layer)) for i, (kind, layer) in self.others.items()}
        return CacheSnapshot([None if s is None else s.state().clone() for s in self.kv_layers], others)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Put back the content of ``snapshot`` (taken from this cache or one of the same layout)."""
        if len(snapshot.states) != len(self.kv_layers):
            raise ShapeError(f"snapshot has {len(snapshot.states)} layers, this cache {len(self.kv_layers)}")
        for i, (layer, state) in enumerate(zip(self.kv_layers, snapshot.states)):
            if (layer is None) != (state is None) or (layer is not None and layer.kind != state.kind):
                raise ShapeError(
                    f"snapshot layer {i} is {getattr(state, 'kind', None)!r}, "
                    f"this cache's is {getattr(layer, 'kind', None)!r}"
                )
            if layer is not None:
                layer.check_state(state)
        theirs = {i: kind for i, (kind, _) in snapshot.others.items()}
        if theirs != self.other_kinds:
            raise ShapeError(f"snapshot has non-attention layers {theirs}, this cache {self.other_kinds}")
        for layer, state in zip(self.kv_layers, snapshot.states):
            if layer is not None:
                layer.load_state(state)
        self._set_others({i: (kind, foreign.clone(layer)) for i, (kind, layer) in snapshot.others.items()})
        for i in self.others:
            self.layers[i] = self._slot_layer(i, self.layers[i])

    def fork(self) -> KVCache:
        """An independent copy: appending to one never changes the other."""
        forked = [None if s is None else s.fork() for s in self.kv_layers]
        others = {i: (kind, foreign.clone(layer)) for i, (kind, layer) in self.others.items()}
        return KVCache(forked, self.spec, self.config_summary, self.attention_config, others)

    def save(self, path: str | os.PathLike, *, token_ids: Sequence[int] | None = None) -> None:
        """Write this cache to one safetensors file (atomically: a failed save keeps the old file).

        ``token_ids``: for a conversation, its tokens: the ``seen`` ones the cache holds, and
        optionally one more (the token ``generate`` chose last and never fed back); loading gives
        them back as ``token_ids``. Raises, writing nothing, for ids that do not fit.
        """
        write_cache_file(path, self._saved(token_ids))

    def to_bytes(self, *, token_ids: Sequence[int] | None = None) -> bytes:
        """The bytes ``save`` would write (a prompt store's entry); ``load_cache``'s checks read them
        back with ``cachefile.cache_from_bytes``."""
        return encode_cache(self._saved(token_ids))

    def _saved(self, token_ids: Sequence[int] | None) -> SavedCache:
        foreign.refuse(
            "save",
            self.other_kinds,
            "saving works for caches whose layers are all attention (or dummy); keep an in-memory copy with "
            "cache.snapshot() or cache.fork() instead",
        )
        if token_ids is not None:
            token_ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
            vocab = (self.config_summary or {}).get("vocab_size")
            problem = token_ids_problem(token_ids, self.seen, vocab)
            if problem is not None:
                raise ValueError(f"cannot save token_ids: {problem}")
        states = [None if s is None else s.state() for s in self.kv_layers]
        return SavedCache(str(self.spec), self.config_summary, states, token_ids)

    def __repr__(self) -> str:
        return f"KVCache(spec={str(self.spec)!r}, seen={self.seen}, nbytes={self.nbytes}, layers={len(self.kv_layers)})"


def kv_attended_by(config: PretrainedConfig | None, n_layers: int) -> list[int]:
    """How many attention calls read each layer's keys and values in a forward pass: 1, or for a
    layer whose K/V later layers reuse (Gemma 3n / 4: ``kv_sharing_modes`` "store", read by the
    "reuse" layers of its type, which keep no cache), 1 plus those layers."""
    modes = getattr(config, "kv_sharing_modes", None)
    types = getattr(config, "layer_types", None)
    if not modes or types is None or len(modes) != n_layers:
        return [1] * n_layers
    return [
        1 + sum(m == "reuse" and t == types[i] for m, t in zip(modes, types)) if mode == "store" else 1
        for i, mode in enumerate(modes)
    ]


def token_ids_problem(ids: list[Any], seen: int, vocab: Any) -> str | None:
    """What is wrong with a conversation's token ids for a cache of ``seen`` tokens, or None.

    They must be ints in ``[0, vocab)`` (when ``vocab`` is an int), as many as ``seen``, or one
    more: the token ``generate`` chose last and never fed back."""
    if not all(type(t) is int and t >= 0 for t in ids):
        bad = next(t for t in ids if not (type(t) is int and t >= 0))
        return f"expected integers >= 0, got {bad!r}"
    if not seen <= len(ids) <= seen + 1:
        return f"{len(ids)} token ids for a cache of {seen} tokens (expected {seen}, or {seen + 1} with the last generated token)"
    if type(vocab) is int and ids and max(ids) >= vocab:
        return f"token id {max(ids)} is outside the model's vocabulary ({vocab})"
    return None
