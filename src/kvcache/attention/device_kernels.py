"""Which compiled kernels run a decode step (and a prompt chunk over pool blocks), by the tensors'
device: the one decision point.

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


def _choose(device: torch.device, native_kernel, triton_kernel):
    """The kernel ``kernels_for(device)`` picks of the two given, or None (the PyTorch path)."""
    kind = kernels_for(device)
    return native_kernel if kind == "native" else triton_kernel if kind == "triton" else None


def decode_views(q, key, value, keep, softcap, scale) -> torch.Tensor | None:
    """``native.decode_attention``: query rows ``[B, Hkv, R, D]`` over views ``[B, Hkv, T, D]``;
    float32 ``[B, Hkv, R, Dv]`` or None."""
    kernel = _choose(q.device, native.decode_attention, triton_decode.decode_views)
    return None if kernel is None else kernel(q, key, value, keep, softcap, scale)


def paged_decode(q, key_pool, value_pool, tables, lengths, scale) -> torch.Tensor | None:
    """``native.paged_decode`` over float blocks; float32 ``[S, Hkv, R, Dv]`` or None."""
    kernel = _choose(q.device, native.paged_decode, triton_decode.paged_decode)
    return None if kernel is None else kernel(q, key_pool, value_pool, tables, lengths, scale)


def paged_prefill(q, key_pool, value_pool, tables, starts, pasts, scale) -> torch.Tensor | None:
    """``native.paged_prefill``: prompt chunks' queries ``[Hkv, N, R, D]`` over float blocks holding
    their past and themselves, causal; float32 ``[Hkv, N, R, Dv]`` or None (no Triton kernel yet:
    CUDA takes the caller's path)."""
    kernel = _choose(q.device, native.paged_prefill, None)
    return None if kernel is None else kernel(q, key_pool, value_pool, tables, starts, pasts, scale)


def paged_coded_decode(q, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths,
                       scale, softcap=None, fp8=False) -> torch.Tensor | None:  # fmt: skip
    """``fused_paged.paged_decode_attention`` over coded blocks and open blocks (``fp8``: e4m3
    codes); float32 or None."""
    kernel = _choose(q.device, fused_paged.paged_decode_attention, triton_decode.paged_coded_decode)
    args = (q, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths, scale, softcap)
    return None if kernel is None else kernel(*args, fp8=fp8)


def token_coded_decode(q, keys, values, bits, tokens, key_group, value_group, scale, softcap=None, fp8=False):
    """``fused.token_decode_attention`` over per-token codes: ``(out, lse)`` float32, or None."""
    kernel = _choose(q.device, fused.token_decode_attention, triton_decode.token_coded_decode)
    return None if kernel is None else kernel(q, keys, values, bits, tokens, key_group, value_group, scale, softcap, fp8=fp8)


def quantized_decode(q, keys, values, bits, value_group, coded_keys, coded_values, exact_keys, exact_values, seen, scale,
                     softcap=None, fp8=False) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A quantized layer's whole decode step in one call (``triton_decode.quantized_decode``):
    ``(out, lse)`` float32, or None: on the CPU the layer's reader splits the step itself over the
    C++ library."""
    kernel = _choose(q.device, None, triton_decode.quantized_decode)
    args = (q, keys, values, bits, value_group, coded_keys, coded_values, exact_keys, exact_values, seen, scale, softcap)
    return None if kernel is None else kernel(*args, fp8=fp8)
