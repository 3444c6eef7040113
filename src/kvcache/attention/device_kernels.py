"""Which compiled kernels run a decode step, by the tensors' device: the one decision point.

- CPU tensors: the C++ libraries (``native`` for float keys and values and float pool blocks,
  ``fused``/``fused_paged`` for codes);
- CUDA tensors, where the ``triton`` extra is installed: the Triton kernel (``triton_decode``);
- anything else (or a kernel that declines a shape): None, and the caller takes its PyTorch path.

Each function here has the signature and result of the kernels it chooses between. ``kernels_for``
is the decision itself (tests route CPU tensors through Triton's interpreter by replacing it)."""

from __future__ import annotations

import torch

from . import fused, fused_paged, native, triton_decode


def kernels_for(device: torch.device) -> str:
    """``"native"`` (C++) for the CPU, ``"triton"`` for CUDA where Triton is installed, else ``"torch"``."""
    if device.type == "cpu":
        return "native"
    if device.type == "cuda" and triton_decode.available():
        return "triton"
    return "torch"


def decode_views(q, key, value, keep, softcap, scale) -> torch.Tensor | None:
    """``native.decode_attention``: query rows ``[B, Hkv, R, D]`` over views ``[B, Hkv, T, D]``;
    float32 ``[B, Hkv, R, Dv]`` or None."""
    kind = kernels_for(q.device)
    if kind == "native":
        return native.decode_attention(q, key, value, keep, softcap, scale)
    if kind == "triton":
        return triton_decode.decode_views(q, key, value, keep, softcap, scale)
    return None


def paged_decode(q, key_pool, value_pool, tables, lengths, scale) -> torch.Tensor | None:
    """``native.paged_decode`` over float blocks; float32 ``[S, Hkv, R, Dv]`` or None."""
    kind = kernels_for(q.device)
    if kind == "native":
        return native.paged_decode(q, key_pool, value_pool, tables, lengths, scale)
    if kind == "triton":
        return triton_decode.paged_decode(q, key_pool, value_pool, tables, lengths, scale)
    return None


def paged_coded_decode(q, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths,
                       scale, softcap=None) -> torch.Tensor | None:  # fmt: skip
    """``fused_paged.paged_decode_attention`` over coded blocks and open blocks; float32 or None."""
    args = (q, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths, scale, softcap)
    kind = kernels_for(q.device)
    if kind == "native":
        return fused_paged.paged_decode_attention(*args)
    if kind == "triton":
        return triton_decode.paged_coded_decode(*args)
    return None


def token_coded_decode(q, keys, values, bits, tokens, key_group, value_group, scale, softcap=None):
    """``fused.token_decode_attention`` over per-token codes: ``(out, lse)`` float32, or None."""
    args = (q, keys, values, bits, tokens, key_group, value_group, scale, softcap)
    kind = kernels_for(q.device)
    if kind == "native":
        return fused.token_decode_attention(*args)
    if kind == "triton":
        return triton_decode.token_coded_decode(*args)
    return None
