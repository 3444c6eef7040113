"""kvcache's torch operators (``torch.ops.kvcache.*``), declared through torch's library API.

Each operator is a schema, one Python kernel for every backend (``CompositeExplicitAutograd``: the
arguments may be dense or oneDNN tensors) and a fake implementation for tracing (the output's
shape and dtype). ``torch.library.custom_op`` would declare the same, but wraps every call in
Python checks that cost 15-30 µs a call on a 2-core Xeon against 4-5 µs here
(docs/benchmarks.md), and a compiled decode step makes some 240 such calls. None of these
operators has a gradient: they serve inference, and a call inside autograd gets none.

Registering is global to the process: the callers (``graph_ops.register``,
``linear_ops.register``) do it once each, on first use, never at import.

Where it builds (torch 2.10 or later, a C++ compiler, the libraries on), ``native()`` loads
``csrc/step_ops.cpp``: C++ kernels for the CPU of ``kvcache::paged_decode`` and
``kvcache::paged_decode_lse`` (which then take CPU calls instead of the Python kernels) and the
operator ``kvcache::panel_linear``, about 2 µs a call against 20-25 µs through Python. Its
kernels call the other libraries' entry points, handed to it by the callers that register the
operators (``graph_ops.register``: ``kv_step_ops_bind_decode``; ``linear_ops.native_panels``:
``kv_step_ops_bind_linear``); an operator whose entry points were not handed raises.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from . import native_build

#: The namespace's one library object, made on the first ``define`` (it must outlive its operators).
_library: list[torch.library.Library] = []


def define(name: str, schema: str, kernel: Callable, fake: Callable) -> torch._ops.OpOverloadPacket:
    """Declare ``kvcache::name`` with ``schema`` (the argument list and result, as in
    ``"(Tensor x, int n) -> Tensor"``), ``kernel`` and ``fake``; return ``torch.ops.kvcache.name``."""
    if not _library:
        _library.append(torch.library.Library("kvcache", "FRAGMENT"))
    _library[0].define(name + schema)
    _library[0].impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvcache::{name}")(fake)
    return getattr(torch.ops.kvcache, name)


#: Oldest torch whose stable C ABI ``csrc/step_ops.cpp`` is written for.
NATIVE_TORCH = (2, 10)


@functools.cache
def native() -> ctypes.CDLL | None:
    """The C++ operator kernels (``csrc/step_ops.cpp``), built and loaded once (loading registers
    them); None where they cannot be (an older torch, no compiler, the libraries off)."""
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < NATIVE_TORCH:
        return None
    return native_build.library("step_ops", _declare, torch_abi=True)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kv_step_ops_bind_linear.argtypes, lib.kv_step_ops_bind_linear.restype = [ptr, ptr], None
    lib.kv_step_ops_bind_decode.argtypes, lib.kv_step_ops_bind_decode.restype = [ptr, ptr, i64, i64, i64], None
    return lib


def address(function: ctypes._CFuncPtr | None) -> int | None:
    """The entry point of a loaded library's ``function`` (None for None), for the bind calls."""
    return None if function is None else ctypes.cast(function, ctypes.c_void_p).value
