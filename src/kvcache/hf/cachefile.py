"""A ``KVCache`` to and from its file, and on load every check of the file against the model.

``persist`` reads and writes the file and checks what the file alone can contradict; here the
file is held against the model it is loaded for: its configuration (``ModelMismatchError``), the
layers its spec makes on this model (kinds, options), each layer's state (shapes, dtypes, counts,
positions), the layers against each other and the model (tokens seen, heads, head dims, batch,
dtype) and the conversation's token ids (as many as the tokens seen, or one more: the token
``generate`` chose last and never fed back; each within the vocabulary). Nothing is allocated that
the file's size and the model's ``max_position_embeddings`` do not bound.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from .build import make_cache
from .cache import KVCache, token_ids_problem
from ..errors import CacheFileError, CorruptedFileError, ModelMismatchError, SpecError, UnsupportedOperation
from ..persist.fingerprint import config_summary, fingerprint_of, text_config
from ..layers import KVLayer, SlidingLayer, WindowLayer
from ..persist import SavedCache, decode_cache, one_line, read_cache_file, short
from ..layers.registry import layer_class
from .spec import CacheSpec, parse_spec

#: Smallest bound on a spec's sizes (capacity, budget, window, ...): above it, they must not pass
#: the model's ``max_position_embeddings``, so a forged option cannot make a load allocate terabytes.
MIN_SIZE_LIMIT = 2**16


def save_cache(cache: KVCache, path: str | os.PathLike, *, token_ids: Sequence[int] | None = None) -> None:
    """Write ``cache`` (and a conversation's ``token_ids``) to ``path`` atomically; see ``KVCache.save``."""
    cache.save(path, token_ids=token_ids)


def load_cache(path: str | os.PathLike, model: Any, *, device: str | torch.device | None = None) -> KVCache:
    """Load a cache saved by ``KVCache.save`` for ``model`` (a model or its config).

    Tensors go to ``device`` (default: the model's device, else CPU). The token ids saved with the
    cache, if any, are its ``token_ids`` (else None). ``model`` is not changed: a cache with
    bounded layers needs ``kvcache.use_kvcache_attention(model)``, as from ``make_cache``. Raises a
    ``CacheFileError`` subclass naming the file and the problem for truncated, corrupted, forged,
    foreign or other-model files, before changing anything.
    """
    config = text_config(model)  # a wrong `model` is the caller's error, not the file's
    return _load(read_cache_file(str(path)), str(path), model, config, device)


def cache_from_bytes(
    raw: bytes, model: Any, *, name: str, device: str | torch.device | None = None, digest_checked: bool = False
) -> KVCache:
    """``load_cache`` for the bytes of a cache file (a prompt store's entry); ``name`` names it in
    errors. ``digest_checked``: a digest over all of ``raw`` was checked, so the per-tensor
    checksums are not computed again (every other check is made)."""
    config = text_config(model)
    return _load(decode_cache(raw, name, digest_checked=digest_checked), name, model, config, device)


def _load(saved: SavedCache, path: str, model: Any, config: Any, device: str | torch.device | None) -> KVCache:
    if device is None:
        device = next((p.device for p in getattr(model, "parameters", lambda: iter(()))()), torch.device("cpu"))
    try:
        return _build(saved, path, config, model_dtype(model), device)
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError) as e:
        # The checksums passed: a file written by another tool or version, or forged.
        raise CorruptedFileError(f"{path}: the cache metadata cannot be used ({type(e).__name__}: {one_line(e)})") from None


def model_dtype(model: Any) -> torch.dtype | None:
    """The dtype of ``model``'s first floating-point parameter (None for a config)."""
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    return next((p.dtype for p in params() if p.is_floating_point()), None)


def _build(saved: SavedCache, path: str, config: Any, model_dtype: torch.dtype | None, device) -> KVCache:
    summary = config_summary(config)
    if fingerprint_of(saved.config) != fingerprint_of(summary):
        diffs = [f"{k}: file {saved.config.get(k)!r}, model {summary.get(k)!r}" for k in summary if saved.config.get(k) != summary.get(k)]
        raise ModelMismatchError(f"{path}: saved for another model configuration ({one_line('; '.join(diffs) or 'extra fields')})")
    spec, expected = _layout(saved.spec, config, summary, path)
    if len(saved.layers) != len(expected):
        raise CorruptedFileError(f"{path}: the layer table has {len(saved.layers)} layers, this model {len(expected)}")
    stores: list[KVLayer | None] = []
    for i, (state, want) in enumerate(zip(saved.layers, expected)):
        state = _in_order_if_ring(i, state, want, path)
        _check_layer(i, state, want, spec, path)
        if state is None:
            stores.append(None)
            continue
        try:
            want.check_state(state)
        except (ValueError, TypeError) as e:  # shapes (ShapeError), dtypes (DTypeError), counts
            raise CorruptedFileError(f"{path}: layer {i}: {one_line(e)}") from None
        state.tensors = {n: t.to(device) for n, t in state.tensors.items()}
        stores.append(layer_class(state.kind).from_state(state))
    _check_agreement(stores, config, model_dtype, path)
    cache = KVCache(stores, spec, summary, config)
    if saved.token_ids is not None:
        problem = token_ids_problem(saved.token_ids, cache.seen, getattr(config, "vocab_size", None))
        if problem is not None:
            raise CorruptedFileError(f"{path}: the conversation's token ids do not fit the cache: {problem}")
    cache.token_ids = saved.token_ids
    return cache


def _layout(text: str, config: Any, summary: dict[str, Any], path: str) -> tuple[CacheSpec, list[KVLayer | None]]:
    """The spec saved in the file, and the empty layers ``make_cache`` builds with it for this model."""
    try:
        spec = parse_spec(text)
    except SpecError as e:
        raise CorruptedFileError(f"{path}: the saved cache spec is not valid: {one_line(e)}") from None
    positions = summary.get("max_position_embeddings")
    limit = max(positions if type(positions) is int else 0, MIN_SIZE_LIMIT)
    for name, value in spec.options.items():
        if isinstance(value, (int, float)) and not (-limit <= value <= limit):
            raise CorruptedFileError(
                f"{path}: the saved spec {short(text)} asks for {name}={value}; a cache for this model "
                f"(max_position_embeddings {positions}) needs at most {limit}"
            )
    try:
        layout = make_cache(config, spec)
    except UnsupportedOperation:  # a valid spec this model cannot run (a bounded kind on latent attention)
        raise
    except ValueError as e:  # SpecError, or a layer's own check of its options
        raise CorruptedFileError(f"{path}: the saved cache spec {short(text)} does not fit this model: {one_line(e)}") from None
    return spec, layout.kv_layers


def _in_order_if_ring(i: int, state: Any, want: KVLayer | None, path: str) -> Any:
    """A model's sliding layer as files of kvcache <= 0.1.0 hold it beside an unbounded kind: a
    ring of the window (kind ``window``, no sinks), read as the layer this version makes there,
    the window less one in position order (``SlidingLayer``). Anything else is returned as it is."""
    if not (isinstance(want, SlidingLayer) and state is not None and state.kind == WindowLayer.kind):
        return state
    if state.options != {"window": want.window, "sinks": 0, "initial_capacity": state.options.get("initial_capacity")}:
        return state  # not this layer's ring: _check_layer refuses it
    try:
        ring = WindowLayer.from_state(state)
    except (ValueError, TypeError) as e:
        raise CorruptedFileError(f"{path}: layer {i}: {one_line(e)}") from None
    return SlidingLayer.state_of_ring(ring, want.options())


def _check_layer(i: int, state: Any, want: KVLayer | None, spec: CacheSpec, path: str) -> None:
    """Layer ``i``'s kind and options in the file against the layer the spec makes for this model."""
    if want is None or state is None:
        if want is not None or state is not None:
            made = "no cache" if want is None else f"a {want.kind} layer"
            found = "no cache" if state is None else f"a {short(state.kind)} layer"
            raise CorruptedFileError(f"{path}: layer {i} is {found} in the file; this model and spec make {made}")
        return
    options = json.loads(json.dumps(want.options()))
    if state.kind != want.kind or want.spec_options_of(state.options) != want.spec_options_of(options):
        raise CorruptedFileError(
            f"{path}: layer {i} is {short(state.kind)} with options {short(state.options)} in the file; "
            f"spec {str(spec)!r} on this model makes {want.kind!r} with {short(options)}"
        )


def kv_dims(config: Any) -> tuple[Any, Any, Any]:
    """The key/value heads, key head dim and value head dim ``config`` gives its attention layers
    (each as the config has it: a value that is not an int says nothing to check against)."""
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "hidden_size", None) and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return heads, head_dim, getattr(config, "v_head_dim", None) or head_dim


def _check_agreement(stores: list[KVLayer | None], config: Any, model_dtype, path: str) -> None:
    """Layers must agree with each other (tokens seen, batch, dtype) and with the model (heads, head dim, dtype)."""
    live = [(i, s) for i, s in enumerate(stores) if s is not None]
    seen = {s.seen for _, s in live}
    if len(seen) > 1:
        raise CorruptedFileError(f"{path}: the layers disagree on the tokens seen: {', '.join(f'layer {i} {s.seen}' for i, s in live)}")
    shaped = [(i, s.geometry) for i, s in live if s.geometry is not None]
    if not shaped:
        return
    heads, head_dim, value_dim = kv_dims(config)
    batch = shaped[0][1].batch
    for i, g in shaped:
        found = str(g.dtype).removeprefix("torch.")
        if type(heads) is int and g.heads != heads:
            raise CorruptedFileError(f"{path}: layer {i} holds {g.heads} key/value heads, this model has {heads}")
        if type(head_dim) is int and g.key_dim != head_dim:
            raise CorruptedFileError(f"{path}: layer {i} holds keys of head dim {g.key_dim}, this model's is {head_dim}")
        if type(value_dim) is int and g.value_dim != value_dim:
            raise CorruptedFileError(f"{path}: layer {i} holds values of head dim {g.value_dim}, this model's is {value_dim}")
        if g.batch != batch:
            raise CorruptedFileError(f"{path}: layer {i} holds a batch of {g.batch}, layer {shaped[0][0]} of {batch}")
        if g.dtype != shaped[0][1].dtype:
            raise CorruptedFileError(f"{path}: layer {i} holds {found} keys and values, layer {shaped[0][0]} {shaped[0][1].dtype}")
        if model_dtype is not None and g.dtype != model_dtype:
            raise ModelMismatchError(f"{path}: the cache holds {found} keys and values, the model computes in {model_dtype}")
