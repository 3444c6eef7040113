"""float32 linear layers over weights packed into column panels (``csrc/linear.cpp``).

A decode step multiplies a few rows (one per request) by every weight of the model, so its time
is the time to read the weights. The BLAS and oneDNN calls torch makes read them at about half
the memory bandwidth at 1-32 rows on a 2-core CPU. The panel library reads each weight once per
call, as a stream of 16-float panels prefetched ahead, and keeps a tile of rows times panels in
registers. On an Intel Xeon (AVX-512, 2 cores) it multiplies 16 rows by SmolLM2's MLP weights
1.6x as fast as oneDNN on prepacked weights, and 64 rows still 1.1x as fast (docs/benchmarks.md,
"Linear layers at decode sizes").

- ``pack(weight)``: ``[N, K]`` -> panels ``[ceil(N / 16), K, 16]`` (columns past N are zeros);
- ``linear(x, panels, n, bias)``: ``x`` ``[..., K]`` times the weight packed, plus ``bias``:
  ``[..., n]``.

Each output row is summed over K in order whatever the other rows, so a row's result does not
depend on how many rows share the call: a decode step padded to a bucket computes the same
numbers as the same rows alone. Both functions take float32 CPU tensors only and need the library
(``available()``); ``linear_ops.call`` (and its operator ``kvcache::linear``, which a compiled
graph holds) calls ``run`` for calls of up to ``linear_ops.PANEL_ROWS`` rows.
"""

from __future__ import annotations

import ctypes

import torch

from ..attention import native_build

#: Floats a panel is wide (the packed weight's last dimension).
WIDTH = 16


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kv_linear_panel.argtypes, lib.kv_linear_panel.restype = [], i32
    lib.kv_linear_pack.argtypes, lib.kv_linear_pack.restype = [ptr, i64, i64, ptr, i32], None
    lib.kv_linear.argtypes, lib.kv_linear.restype = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32], None
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


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[N, K]`` can be packed: float32, on the CPU, two dimensions."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` float32 on the CPU as panels ``[ceil(N / 16), K, 16]``."""
    lib = _library()
    if lib is None or not fits(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {list(weight.shape)} on {weight.device} "
                         f"(expected float32 [N, K] on the CPU; library available: {lib is not None})")  # fmt: skip
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty((n + WIDTH - 1) // WIDTH, k, WIDTH, dtype=torch.float32)
    lib.kv_linear_pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` float32 times the weight ``[n, K]`` packed as ``panels``, plus ``bias``
    ``[n]`` (None: none): ``[..., n]`` float32."""
    if panels.dim() != 3 or panels.shape[2] != WIDTH or panels.dtype != torch.float32 or not panels.is_contiguous():
        raise ValueError(f"linear: panels must be contiguous float32 [P, K, {WIDTH}] (pack's output); "
                         f"got {panels.dtype} {list(panels.shape)}")  # fmt: skip
    k = panels.shape[1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k or not 0 < n <= panels.shape[0] * WIDTH:
        raise ValueError(f"linear: expected float32 x [..., {k}] on the CPU and 0 < n <= {panels.shape[0] * WIDTH}; "
                         f"got {x.dtype} {list(x.shape)} on {x.device} and n={n}")  # fmt: skip
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"linear: bias must be float32 [{n}] on the CPU, got {bias.dtype} {list(bias.shape)}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the panel linear library is not available (see native_build)")
    return run(x, panels, n, bias)


def run(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` without its checks, for callers that made ``panels`` with ``pack`` from a weight
    ``[n, K]`` and pass float32 CPU ``x`` ``[..., K]`` and ``bias`` (``PackedLinears``; the
    library loaded): the per-call cost of a decode step's two hundred calls."""
    k = panels.shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or rows.stride(0) < k:
        rows = rows.contiguous()
    count = rows.shape[0]
    out = torch.empty(count, n, dtype=torch.float32)
    if count:
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        (_loaded or _load()).kv_linear(
            rows.data_ptr(), count, k, rows.stride(0), panels.data_ptr(), n,
            0 if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)

