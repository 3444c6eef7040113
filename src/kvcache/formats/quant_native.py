"""Per-token quantization of float32 tensors in one native call (``csrc/quantize.cpp``).

The same codes, scales and minimums as the PyTorch path of :func:`kvcache.formats.quant.quantize_per_token`,
bit for bit (the source says how), in one library call instead of some thirty tensor operations: a
decode step codes one token per layer and KV head, where those operations' fixed cost is the whole
cost. None where the library does not run (off, unbuilt, another device or dtype) or the values are
out of range: the caller then runs the PyTorch path, which raises the errors.
"""

from __future__ import annotations

import ctypes

import torch

from ..attention import native_build


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_quantize_per_token.argtypes = [ptr] * 4 + [i64, i32, i32, i32, i32]
    lib.kv_quantize_per_token.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The quantize library, built on first use; None when off or when it cannot build."""
    return native_build.library("quantize", _declare)


def quantize_per_token(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes ``[..., T, D * bits / 8]``, scale and minimum float32 ``[..., T, D / group]`` of float32
    ``x`` ``[..., T, D]`` on the CPU (shapes already checked by the caller), or None (module docstring)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or x.requires_grad or torch.compiler.is_compiling():
        return None
    lib = library()
    if lib is None:
        return None
    dim = x.shape[-1]
    xc = x.detach().contiguous()
    lead = tuple(x.shape[:-1])
    codes = torch.empty(*lead, dim * bits // 8, dtype=torch.uint8)
    scale = torch.empty(*lead, dim // group, dtype=torch.float32)
    minimum = torch.empty_like(scale)
    failed = lib.kv_quantize_per_token(
        xc.data_ptr(), codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), xc.numel() // dim, dim, group, bits, torch.get_num_threads()
    )
    return None if failed else (codes, scale, minimum)
