"""What the ``auto`` kinds chose, per layer of a cache (for reports: ``kvcache eval --frontier``)."""

from __future__ import annotations

from typing import Any

from .auto import AutoLayer
from .auto_heads import AutoHeadsLayer


def mix_of(cache: Any) -> list[dict[str, Any] | None]:
    """Per layer of ``cache`` the ``auto`` or ``auto-heads`` layer's choice (storage, slots, tokens
    seen then, and the estimate of each storage weighed), None for other layers or one that has not
    chosen."""
    out: list[dict[str, Any] | None] = []
    for layer in cache.kv_layers:
        c = layer.choice if isinstance(layer, (AutoLayer, AutoHeadsLayer)) else None
        if c is None:
            out.append(None)
            continue
        out.append({"storage": c.storage, "slots": c.slots, "seen": c.seen,
                    "estimates": {e.storage: {"slots": e.slots, "dropped": e.dropped, "coding": e.coding} for e in c.estimates}})  # fmt: skip
    return out
