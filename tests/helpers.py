"""Helpers shared by the tests (core, hf and apps)."""

import contextlib
import importlib.util
import math
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvcache
from kvcache.apps.tiny import _DEFAULT_ATTN, PAD_TOKEN_ID, tiny_model
from kvcache.attention.half_precision import HalfPrecision, half_precision_support


def dtypes_here(*dtypes: torch.dtype) -> tuple[torch.dtype, ...]:
    """``dtypes`` less bfloat16 and float16 on a CPU where half-precision matmul crashes even with
    oneDNN capped (conftest skips the tests that take them as parameters; property tests that draw
    a dtype draw from this)."""
    if half_precision_support().status is not HalfPrecision.BROKEN:
        return dtypes
    return tuple(d for d in dtypes if d not in (torch.bfloat16, torch.float16))


#: The tiny models tests share, by (family, overrides): a test that changes one must put it back
#: (conftest checks their attention implementation after every test).
SHARED_MODELS: dict[tuple, object] = {}


def model_for(family: str, **overrides):
    key = (family, tuple(sorted(overrides.items())))
    if key not in SHARED_MODELS:
        SHARED_MODELS[key] = tiny_model(family, **overrides)
    return SHARED_MODELS[key]


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
    """Run ``model`` with Hugging Face's own attention (sdpa, or eager for gemma2) inside the block:
    references must not run on our code, whatever the model was switched to before."""
    before = model.config._attn_implementation
    model.set_attn_implementation(_DEFAULT_ATTN.get(model.config.model_type, "sdpa"))
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


#: Logits of our attention against Hugging Face's, float32. ``attend`` and SDPA sum the same
#: products in another order (blocked matmuls, their own softmax reductions), so attention outputs
#: differ by a few ulps (float32 eps = 1.2e-7) and four layers of norms and the LM head amplify
#: that: the largest difference measured on the tiny models is 1.5e-5 (CPU, torch 2.13). 1e-4 leaves
#: headroom for other CPUs' BLAS kernels and stays far below the logit gaps greedy decoding turns
#: on; the contract itself, equal argmax and equal tokens, is checked exactly.
LOGITS_TOL = {"rtol": 1e-4, "atol": 1e-4}

#: How close the coded decode library comes to float32 attention over the dequantized codes: on
#: x86 its kernels round each key block's ``q * scale`` and each span's ``weights * scale`` to 16-bit
#: integers (``csrc/coded_decode.cpp``: ``key_scores_words``, ``weighted_words``), 2^-16 of the
#: largest term where float32 products keep 2^-24 (``test_coded_dots.py`` checks those bounds).
CODED_TOL = {"rtol": 1e-3, "atol": 1e-3}


def attention_for(model, cache):
    """The attention a run with ``cache`` uses, as a context manager: our caches run as the README
    recommends (inside ``kvcache.use_kvcache_attention``), references on Hugging Face's own."""
    if isinstance(cache, kvcache.KVCache):
        return kvcache.use_kvcache_attention(model)
    return hf_attention(model)


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


#: The repository's root folder (README, pyproject.toml, tools/).
ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    """The script ``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder(TorchDispatchMode):
    """Records every aten op with the shapes, sizes and storages of its tensor outputs and inputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.ops.append(
            (
                str(func),
                [(tuple(t.shape), t.numel(), t.untyped_storage().data_ptr()) for t in outs],
                [t.untyped_storage().data_ptr() for t in ins],
            )
        )
        return out
