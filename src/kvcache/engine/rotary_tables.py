"""A compiled step's rotary tables computed once, not inside every layer.

A model's rotary embedding module (``LlamaRotaryEmbedding`` and its kin) turns the step's
positions into ``cos`` and ``sin`` ``[1, T, D]``, and every layer rotates its queries and keys by
them. Inductor inlines a pointwise result into each loop that reads it unless it judges the
result costly to recompute, and on the CPU it counts exponentials, logarithms, sigmoid and tanh as
costly, not cosine and sine. So a compiled step recomputed both tables inside every layer's
rotation, and inside the loop that writes the keys into their slots, which inductor runs on one
thread: for a 2,048-token SmolLM2 prompt step in bfloat16 that loop took 1.05 ms a layer, 0.51 ms
once the tables were computed once (torch's profiler, 9 steps).

``RotaryTables(model, kept).active()`` passes each table a rotary module returns through ``kept``
(``kvcache::kept``, a copy the compiler cannot see into), so the compiled graph holds each table
as one buffer. Inside the block the modules' ``forward`` is an instance attribute; after it, the
class's again. The values are unchanged (a copy), so the step's tokens are too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s rotary embedding modules: those whose class name ends in ``RotaryEmbedding``."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


class RotaryTables:
    """The rotary modules of ``model`` with their tables passed through ``kept`` while ``active``."""

    def __init__(self, model: torch.nn.Module, kept: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.kept = kept
        # one wrapper a module, made once: a compiled graph is traced through these same functions
        self._forwards = {m: self._wrapped(m) for m in rotary_modules(model)}

    def _wrapped(self, module: torch.nn.Module) -> Callable[..., Any]:
        own = type(module).forward.__get__(module)
        kept = self.kept

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = own(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(kept(t) if isinstance(t, torch.Tensor) else t for t in out)
            return out

        return forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside the block each rotary module's tables come out through ``kept``. A module with
        an instance-level ``forward`` of someone else's is left alone."""
        swapped = []
        try:
            for module, forward in self._forwards.items():
                if "forward" in module.__dict__:
                    continue
                module.forward = forward
                swapped.append(module)
            yield
        finally:
            for module in swapped:
                del module.forward
