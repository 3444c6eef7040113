"""Helpers shared by the model-level tests."""

import contextlib
import functools

import torch

from kvcache.tiny import _DEFAULT_ATTN, tiny_model


@functools.lru_cache(maxsize=None)
def model_for(family: str, **overrides):
    return tiny_model(family, **overrides)


def prompt(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Random token ids in [3, 256): no pad, bos or eos."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def layer_fingerprint(layer) -> tuple:
    """Everything observable about a layer but its content: what a failed call must leave as it was."""
    k, v = layer.view()
    return (
        layer.initialized,
        layer.length,
        layer.seen,
        layer.capacity,
        layer.nbytes,
        layer.reallocations,
        layer.geometry,
        None if k is None else (k.data_ptr(), tuple(k.shape), v.data_ptr(), tuple(v.shape)),
    )


@contextlib.contextmanager
def hf_attention(model):
    """Run ``model`` with Hugging Face's own attention (sdpa, or eager for gemma2) inside the block.

    ``make_cache`` switches models with bounded layers to the ``"kvcache"`` attention; references
    must not run on our code.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation(_DEFAULT_ATTN.get(model.config.model_type, "sdpa"))
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
