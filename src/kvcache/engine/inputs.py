"""The checks of what a caller hands the engine: a prompt's token ids, end-of-sequence ids, sizes."""

from __future__ import annotations

import torch


def prompt_ids(input_ids: object, vocab: int | None) -> list[int]:
    """``input_ids`` (a list, a 1-D tensor or a ``[1, S]`` tensor of token ids) as a list, each
    checked against the vocabulary's size ``vocab`` (None: unknown)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be token ids [S] or [1, S], got a {input_ids.dtype} tensor of shape {list(input_ids.shape)}")
        input_ids = input_ids.tolist()
    try:
        prompt = [int(t) for t in input_ids]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"input_ids must be a sequence of token ids, got {type(input_ids).__name__}") from None
    if not prompt:
        raise ValueError("input_ids is empty: a request needs at least one prompt token")
    bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    return prompt


def eos_ids(eos: object) -> frozenset[int]:
    """``eos`` (a token id, a list of them, a tensor or None) as a set of token ids."""
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, int):
        return frozenset([eos])
    try:
        return frozenset(int(t) for t in eos)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}") from None


def positive(name: str, value: object) -> int:
    """``value`` if it is a positive integer, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
