"""kvcache's torch operators (``torch.ops.kvcache.*``), declared through torch's library API.

Each operator is a schema, one Python kernel for every backend (``CompositeExplicitAutograd``: the
arguments may be dense or oneDNN tensors) and a fake implementation for tracing (the output's
shape and dtype). ``torch.library.custom_op`` would declare the same, but wraps every call in
Python checks that cost 15-30 µs a call on a 2-core Xeon against 4-5 µs here
(docs/benchmarks.md), and a compiled decode step makes some 240 such calls. None of these
operators has a gradient: they serve inference, and a call inside autograd gets none.

Registering is global to the process: the callers (``graph_ops.register``,
``linear_ops.register``) do it once each, on first use, never at import.
"""

from __future__ import annotations

from typing import Callable

import torch

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
