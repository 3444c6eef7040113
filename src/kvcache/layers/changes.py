"""Counting a layer's changes: every mutating call bumps ``changes`` and drops the cached view.

``KVLayer.viewed()`` keeps one ``view()`` between changes (a quantized layer dequantizes its whole
store for it); wrapping the mutating calls of every subclass, rather than asking each override to
remember, is what keeps that cache honest.
"""

from __future__ import annotations

import functools

#: The calls that may change what a layer stores: each of them, in every subclass, bumps ``changes``.
MUTATING = ("update", "attend", "settle", "trim", "reset", "select", "repeat", "reorder", "load_state")


def _counting_changes(method):
    """``method``, bumping ``changes`` and dropping the cached view before it runs (so even a call
    that raised halfway, against the contract, leaves no stale view behind)."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        self.changes += 1
        self._viewed = None
        return method(self, *args, **kwargs)

    counted.counts_changes = True
    return counted


def count_changes(cls: type) -> None:
    """Wrap the mutating calls that ``cls`` defines itself (inherited ones are wrapped already)."""
    for name in MUTATING:
        method = cls.__dict__.get(name)
        if method is not None and not getattr(method, "counts_changes", False):
            setattr(cls, name, _counting_changes(method))
