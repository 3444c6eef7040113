"""The block formats the engine's pool holds, chosen by a cache spec (``kvcache.hf.spec``):

- ``"growable"``: full-precision blocks in the model's dtype (``formats.FullPrecision``);
- ``"quantized:bits=8"`` (or 4, 2; ``group_size`` = channels per value group, default 64 or the
  value head dim if smaller; ``codes=fp8``: e4m3 codes, 8 bits): coded blocks (``formats.Codes``, keys per channel over the block) with
  one full-precision open block per running request. The kind's ``residual`` is not an option here: the open block is the
  engine's exact residual (between 1 and ``block_size`` recent tokens).
- a bounded kind (``"window:window=1024,sinks=4"``, ``"h2o:budget=256"``, ``"snapkv:budget=0.25"``,
  ``"adakv:..."``, ``"auto:bytes=0.125"``, ``storage=`` on any): full-precision blocks for prompts;
  each request's context, once its prompt is computed (a window's from its first chunk), lives in
  a cache of that kind of its own (``compression.py``), whose bytes it holds in the pool's blocks.

``make_pool`` sizes the pool from ``blocks`` or ``max_bytes`` (everything the pool allocates counts:
coded blocks, scales and the open blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedOperation
from ..formats import Codes, Format, FullPrecision
from ..formats.blocks import block_bytes
from ..hf.spec import CacheSpec, parse_spec
from ..layers.quantized import CODES
from ..persist.fingerprint import AmbiguousGlobalPerLayerAttributeError, text_config
from .pool import BlockPool


@dataclass(frozen=True)
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    window: int | None


def engine_spec(spec: str | CacheSpec) -> CacheSpec:
    """``spec`` parsed (``SpecError`` for a malformed one), or ``UnsupportedOperation`` for an
    option the engine's coded pool does not take (which kinds it serves, ``compression.py`` says)."""
    parsed = parse_spec(spec)
    if parsed.kind == "quantized" and "residual" in parsed.options:
        raise UnsupportedOperation(
            "the engine keeps each request's unfilled last block exact (its residual, 1 to block_size tokens); "
            "drop the residual option"
        )
    return parsed


def make_pool(
    spec: CacheSpec, geometry: PoolShape, block_size: int, blocks: int | None, max_bytes: int | None, max_seqs: int
) -> BlockPool:
    """The pool for ``spec`` (from ``engine_spec``): ``blocks`` blocks, or as many as ``max_bytes``
    holds, or by default enough for ``max_seqs`` requests of 1,024 tokens."""
    g = geometry
    shape = (g.layers, g.kv_heads, block_size, g.head_dim, g.head_dim)
    tails = 0
    format: Format = FullPrecision(g.dtype)
    if spec.kind == "quantized":
        codes = spec.options.get("codes", "int")
        if codes not in CODES:
            raise ValueError(f"codes must be one of {CODES} (integer or e4m3 codes), got {codes!r}")
        fp8 = codes == "fp8"
        bits = int(spec.options.get("bits", 8 if fp8 else 4))
        format = Codes(bits, int(spec.options.get("group_size", min(64, g.head_dim))), key_block=block_size, fp8=fp8)
        tails = max(max_seqs, 2)
    per_block = block_bytes(format, *shape, g.dtype if format.exact else torch.float32)
    fixed = tails * block_bytes(FullPrecision(torch.float32), *shape, torch.float32)
    blocks = _block_count(blocks, max_bytes, per_block, fixed, max_seqs, block_size)
    return BlockPool(*shape[:2], g.head_dim, block_size, blocks, g.dtype, g.device, format=format, tails=tails)


def _block_count(blocks: int | None, max_bytes: int | None, per_block: int, fixed: int, max_seqs: int, block_size: int) -> int:
    if blocks is not None and max_bytes is not None:
        raise ValueError("give the pool's size as blocks or as max_bytes, not both")
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        count = (max_bytes - fixed) // per_block
        if count < 1:
            raise ValueError(
                f"max_bytes={max_bytes} holds no block of {per_block} bytes"
                + (f" beside the {fixed} bytes of open blocks (one per max_seqs request)" if fixed else "")
            )
        return count
    if blocks is None:
        return max_seqs * -(-1024 // block_size)
    return blocks


def pool_shape(model: Any) -> PoolShape:
    """The pool's shape for ``model``, or ``UnsupportedOperation`` saying why the engine cannot serve it."""
    if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"Engine expects a transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedOperation("the engine serves decoder-only models; this one is an encoder-decoder")
    if model.training:
        raise UnsupportedOperation("the model is in training mode (dropout on): call model.eval() before serving it")
    config = text_config(model)
    if getattr(config, "kv_lora_rank", None) is not None:
        raise UnsupportedOperation("the engine's blocks hold keys and values; this model caches latents (multi-head latent attention)")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise UnsupportedOperation("this model attends in chunks (attention_chunk_size), which the engine does not apply")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    others = kinds - {"full_attention", "sliding_attention"}
    if others:
        raise UnsupportedOperation(
            f"this model has {', '.join(sorted(others))} layers; the engine serves models whose layers all attend "
            "over keys and values (full or sliding-window attention)"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" not in kinds and getattr(config, "layer_types", None) is not None:
        window = None
    try:
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or (heads and config.hidden_size // heads)
    except AmbiguousGlobalPerLayerAttributeError as e:  # a per-layer head_dim (Gemma 4)
        raise UnsupportedOperation(f"the engine's pool has one shape for every layer; this model's differ ({e})") from None
    if not heads:
        raise UnsupportedOperation(f"this model ({config.model_type}) has no attention heads in its config; the engine serves attention models")
    try:
        parameter = next(model.parameters())
    except StopIteration:
        raise TypeError("the model has no parameters") from None
    return PoolShape(config.num_hidden_layers, kv_heads, head_dim, parameter.dtype, parameter.device, window)
