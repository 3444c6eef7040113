"""Linear layers over weights packed into column panels (``csrc/linear.cpp``), float32 or bfloat16.

A decode step multiplies a few rows (one per request) by every weight of the model, so its time
is the time to read the weights. The BLAS and oneDNN calls torch makes read them at about half
the memory bandwidth at 1-32 rows on a 2-core CPU. The panel library reads each weight once per
call, as a stream of 16-float panels prefetched ahead, and keeps a tile of rows times panels in
registers. On an Intel Xeon (AVX-512, 2 cores) it multiplies 16 rows by SmolLM2's MLP weights
1.6x as fast as oneDNN on prepacked weights, and 64 rows still 1.1x as fast (docs/benchmarks.md,
"Linear layers at decode sizes").

- ``pack(weight)``: ``[N, K]`` -> panels ``[ceil(N / 16), K, 16]`` of its dtype (columns past N
  are zeros);
- ``linear(x, panels, n, bias)``: ``x`` ``[..., K]`` times the weight packed, plus ``bias``:
  ``[..., n]``, all of the panels' dtype.

In bfloat16 the weights stream at half the bytes and K must be even. Where the CPU has AVX-512
BF16, a panel holds k in pairs (``[K/2, 16, 2]``, opaque to callers) and one ``vdpbf16ps`` adds two
products to each of 16 float32 sums, or, where it also has AMX and K is a multiple of 32, one tile
multiply adds a block of 16 rows x 32 k x 16 columns (``bf16_kernel()`` says which); elsewhere
each weight is widened to float32 as it is loaded (AVX-512; with narrower vectors the library takes
no bfloat16). Either way the products are exact in float32, the sums run in float32 and each
output is rounded to bfloat16 once, after the bias, as oneDNN does on bfloat16 weights.

Each output row is summed over K in order whatever the other rows, so a row's result does not
depend on how many rows share the call: a decode step padded to a bucket computes the same
numbers as the same rows alone. Both functions take float32 or bfloat16 CPU tensors and need the
library (``available()``); ``linear_ops.call`` (and its operator ``kvcache::linear``, which a
compiled graph holds) calls ``run`` for calls of up to ``linear_ops.panel_rows(dtype, K)`` rows.
"""

from __future__ import annotations

import ctypes

import torch

from ..attention import native_build

#: Columns a panel is wide (the packed weight's last dimension).
WIDTH = 16

#: The dtypes the library multiplies in.
DTYPES = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_linear_panel.argtypes, lib.kv_linear_panel.restype = [], i32
    lib.kv_linear_pack.argtypes, lib.kv_linear_pack.restype = [ptr, i64, i64, ptr, i32], None
    for name in ("kv_linear", "kv_linear_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32], None
    lib.kv_linear_pack_bf16.argtypes, lib.kv_linear_pack_bf16.restype = [ptr, i64, i64, ptr, i32], None
    lib.kv_linear_bf16_kernel.argtypes, lib.kv_linear_bf16_kernel.restype = [], i32
    if lib.kv_linear_panel() != WIDTH:
        raise RuntimeError(f"the linear library's panels are {lib.kv_linear_panel()} floats wide, not {WIDTH}")
    return lib


def _library() -> ctypes.CDLL | None:
    return native_build.library("linear", _declare)


_loaded: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    """The library for ``run``, looked up once (``run``'s callers checked that it loads)."""
    global _loaded
    _loaded = _library()
    if _loaded is None:
        raise RuntimeError("the panel linear library is not available (see native_build)")
    return _loaded


def available() -> bool:
    """Whether the panel library is built and on (building it now if needed)."""
    return _library() is not None


def bf16_kernel() -> str:
    """How the library multiplies in bfloat16 here: ``"amx"`` (AMX tiles: the CPU has them, the OS
    granted this process their use, asked on the first call, and ``$ONEDNN_MAX_CPU_ISA`` does not
    cap oneDNN below AMX), ``"dot"`` (AVX-512 BF16's ``vdpbf16ps``), ``"widen"`` (float32 FMAs on
    widened weights, AVX-512) or ``"none"`` (narrower vectors, where the library does not take
    bfloat16; ``fits`` refuses it); RuntimeError without the library."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the panel linear library is not available (see native_build)")
    return ("none", "widen", "dot", "amx")[lib.kv_linear_bf16_kernel() + 1]


def entries() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """The library's float32 and bfloat16 linear entry points (``kv_linear``, ``kv_linear_bf16``),
    for the C++ operator that calls them (``linear_ops.native_panels``); RuntimeError without it."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the panel linear library is not available (see native_build)")
    return lib.kv_linear, lib.kv_linear_bf16


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[N, K]`` can be packed here: the library available, and the weight
    float32, or bfloat16 with K even where the library takes bfloat16 (``bf16_kernel()``), on the
    CPU."""
    if weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.dim() != 2 or not available():
        return False
    return weight.dtype == torch.float32 or (weight.shape[1] % 2 == 0 and bf16_kernel() != "none")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32 or bfloat16, on the CPU) as panels ``[ceil(N / 16), K, 16]``
    of its dtype."""
    lib = _library()
    if lib is None or not fits(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {list(weight.shape)} on {weight.device} "
                         f"(expected float32 [N, K], or bfloat16 with K even where the library takes it, on the CPU; "
                         f"library available: {lib is not None})")  # fmt: skip
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty((n + WIDTH - 1) // WIDTH, k, WIDTH, dtype=w.dtype)
    pack_fn = lib.kv_linear_pack if w.dtype == torch.float32 else lib.kv_linear_pack_bf16
    pack_fn(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` times the weight ``[n, K]`` packed as ``panels``, plus ``bias`` ``[n]``
    (None: none): ``[..., n]``; every tensor of the panels' dtype (float32 or bfloat16)."""
    if panels.dim() != 3 or panels.shape[2] != WIDTH or panels.dtype not in DTYPES or not panels.is_contiguous():
        raise ValueError(f"linear: panels must be contiguous float32 or bfloat16 [P, K, {WIDTH}] (pack's output); "
                         f"got {panels.dtype} {list(panels.shape)}")  # fmt: skip
    k, dtype = panels.shape[1], panels.dtype
    if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != k or not 0 < n <= panels.shape[0] * WIDTH:
        raise ValueError(f"linear: expected {str(dtype).removeprefix('torch.')} x [..., {k}] on the CPU and 0 < n <= {panels.shape[0] * WIDTH}; "
                         f"got {x.dtype} {list(x.shape)} on {x.device} and n={n}")  # fmt: skip
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or bias.device.type != "cpu"):
        raise ValueError(f"linear: bias must be {str(dtype).removeprefix('torch.')} [{n}] on the CPU, got {bias.dtype} {list(bias.shape)}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the panel linear library is not available (see native_build)")
    return run(x, panels, n, bias)


def run(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` without its checks, for callers that made ``panels`` with ``pack`` from a weight
    ``[n, K]`` and pass CPU ``x`` ``[..., K]`` and ``bias`` of the panels' dtype (``PackedLinears``;
    the library loaded): the per-call cost of a decode step's two hundred calls."""
    k = panels.shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) < k:
        rows = rows.contiguous()
    count = rows.shape[0]
    out = torch.empty(count, n, dtype=panels.dtype)
    if count:
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        lib = _loaded or _load()
        (lib.kv_linear if panels.dtype == torch.float32 else lib.kv_linear_bf16)(
            rows.data_ptr(), count, k, rows.stride(0), panels.data_ptr(), n,
            0 if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)

