"""The keyword a model takes its cache under: ``cache`` from ``transformers`` 5.24, which renamed
``past_key_values`` in every model's ``forward`` and in ``generate`` (the old name still works
there, with a ``FutureWarning``, until its removal), ``past_key_values`` before.

    logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
    out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=16)

The name is read from the model's own ``forward`` signature, so a model written for either
release (remote code included) gets the one it declares.
"""

from __future__ import annotations

import inspect
from typing import Any

NEW, OLD = "cache", "past_key_values"


def cache_name(model: Any) -> str:
    """``"cache"`` if ``model``'s forward declares it (transformers >= 5.24), else ``"past_key_values"``."""
    forward = getattr(type(model), "forward", None)
    if forward is None:
        return OLD
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read: the long-standing name
        return OLD
    return NEW if NEW in parameters and OLD not in parameters else OLD


def cache_kwargs(model: Any, cache: object) -> dict[str, object]:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)``, ``name`` from ``cache_name``."""
    return {cache_name(model): cache}
