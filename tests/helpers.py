"""Helpers shared by the model-level tests."""

import contextlib
import functools
import math

import torch

from kvcache.tiny import _DEFAULT_ATTN, PAD_TOKEN_ID, tiny_model


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


# ---- field checks for benchmark JSON ----------------------------------------------------------


def positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def nonneg_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def boolean(x) -> bool:
    return isinstance(x, bool)


def text(x) -> bool:
    return isinstance(x, str) and bool(x)


def positive_list(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(positive_number(v) for v in x)


# ---- generation ---------------------------------------------------------------------------------


def left_padded(lengths: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for prompts of the given lengths."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = prompt(n, seed=seed + row)[0]
        mask[row, width - n :] = 1
    return ids, mask


def assert_same_tokens(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs reference {tuple(ref.shape)}"
    if not torch.equal(ours, ref):
        rows, cols = (ours != ref).nonzero(as_tuple=True)
        raise AssertionError(
            f"{what}: tokens differ from DynamicCache, first at row {rows[0].item()} "
            f"column {cols[0].item()}\nours: {ours.tolist()}\nref:  {ref.tolist()}"
        )
