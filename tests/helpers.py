"""Helpers shared by the model-level tests."""

import functools

import torch

from kvcache.tiny import tiny_model


@functools.lru_cache(maxsize=None)
def model_for(family: str, **overrides):
    return tiny_model(family, **overrides)


def prompt(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Random token ids in [3, 256): no pad, bos or eos."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)
