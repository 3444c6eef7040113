"""The registry of cache kinds: the one table that says which kinds exist.

``LAYERS`` lists every layer class by the kind its saved files name; the spec kinds are what those
classes serve (``options.DeclaredKind.spec_kinds``): their own kind, or for ``EvictingLayer`` one
kind per eviction policy of ``policies.POLICIES``. Parsing (``spec.py``), ``make_cache``, error
messages, ``--help`` and loading a saved file all read these two tables; nothing else lists kinds,
and nothing is registered by importing a module, so every kind exists in every process that
imported ``kvcache``.

A kind defined outside the package is added by an explicit call, ``register_layer(cls)`` or
``register_policy(cls)``, and taken back by ``unregister_layer`` / ``unregister_policy``.

Design: docs/architecture.md, "The kinds: one table".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .adaptive import AdaptiveLayer
from .auto import AutoLayer
from .auto_heads import AutoHeadsLayer
from .concat import ConcatLayer
from .evicting import EvictingLayer
from .growable import GrowableLayer
from .quantized import QuantizedLayer
from .sliding import SlidingLayer
from .static import StaticLayer
from .window import WindowLayer
from .options import Option
from .policies import POLICIES, Policy

#: Layer kind (as saved in files) -> its class. ``SlidingLayer`` serves no spec kind: ``make_cache``
#: places it on a model's own sliding-window layers.
LAYERS: dict[str, type] = {
    cls.kind: cls
    for cls in (GrowableLayer, StaticLayer, WindowLayer, QuantizedLayer, EvictingLayer, AdaptiveLayer, AutoLayer, AutoHeadsLayer, ConcatLayer,
                SlidingLayer)
}


@dataclass(frozen=True)
class SpecKind:
    """A kind a cache spec can name: the layer class that serves it and the arguments it fixes."""

    name: str
    layer: type
    #: Constructor arguments the kind itself sets (``EvictingLayer``'s ``policy``).
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, Option]:
        return self.layer.kind_options(self.fixed)

    @property
    def required(self) -> tuple[str, ...]:
        return self.layer.required_options

    def build(self, options: Mapping[str, Any], buffers: Any = None) -> Any:
        """An empty layer of this kind from a spec's checked options (python-only ones excluded);
        ``buffers``: a caller-owned ``(keys, values)`` pair, for kinds that take one."""
        return self.layer.from_options({**self.fixed, **options}, buffers)


def layer_class(kind: Any) -> type | None:
    """The class of a saved layer kind, or None for a kind the table does not have."""
    return LAYERS.get(kind) if isinstance(kind, str) else None


def spec_kinds() -> dict[str, SpecKind]:
    """Every kind a spec can name, in listing order (``spec_order``), read from the tables at the
    time of asking (so a kind registered later is a spec kind at once)."""
    out: dict[str, SpecKind] = {}
    for cls in sorted(LAYERS.values(), key=lambda c: c.spec_order):
        for name, fixed in cls.spec_kinds().items():
            out[name] = SpecKind(name, cls, dict(fixed))
    return out


def spec_kind(name: Any) -> SpecKind | None:
    return spec_kinds().get(name) if isinstance(name, str) else None


# ---- kinds from outside the package: explicit calls ---------------------------------------------


def register_layer(cls: type) -> None:
    """Add a layer class (a ``KVLayer`` subclass naming its ``kind``) to ``LAYERS``: its kind and
    the spec kinds it serves exist from now on, in this process. A kind or spec kind another
    class already has is refused (``TypeError``), changing nothing."""
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__qualname__} must name a non-empty string kind of its own, got {kind!r}")
    if kind in LAYERS and LAYERS[kind] is not cls:
        raise TypeError(f"layer kind {kind!r} is already registered by {LAYERS[kind].__qualname__}; {cls.__qualname__} cannot take it")
    taken = sorted(set(cls.spec_kinds()) & {n for n, k in spec_kinds().items() if k.layer is not cls})
    if taken:
        raise TypeError(f"spec kind {taken[0]!r} is already served by another class; {cls.__qualname__} cannot take it")
    LAYERS[kind] = cls


def unregister_layer(kind: str) -> None:
    """Take a layer kind added by ``register_layer`` out again (a built-in kind is refused)."""
    _unregister(LAYERS, _BUILT_IN_LAYERS, kind, "layer kind")


def register_policy(cls: type[Policy]) -> None:
    """Add an eviction policy (a ``Policy`` subclass naming its ``name``): from now on it is an
    eviction spec kind (``"<name>:budget=N"``) and saved files may name it. A name another policy
    or spec kind has is refused (``TypeError``), changing nothing."""
    name = cls.__dict__.get("name")
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or not isinstance(name, str) or not name:
        raise TypeError(f"register_policy takes a Policy subclass naming a non-empty string name, got {cls!r}")
    if name in POLICIES and POLICIES[name] is not cls:
        raise TypeError(f"eviction policy {name!r} is already registered by {POLICIES[name].__qualname__}")
    if name not in POLICIES and name in spec_kinds():
        raise TypeError(f"{name!r} is already a cache kind; choose another name for the policy")
    POLICIES[name] = cls


def unregister_policy(name: str) -> None:
    """Take a policy added by ``register_policy`` out again (a built-in policy is refused)."""
    _unregister(POLICIES, _BUILT_IN_POLICIES, name, "eviction policy")


def _unregister(table: dict, built_in, name: str, what: str) -> None:
    if name in built_in:
        raise ValueError(f"{what} {name!r} is built in and cannot be unregistered")
    table.pop(name, None)


_BUILT_IN_LAYERS = frozenset(LAYERS)
_BUILT_IN_POLICIES = frozenset(POLICIES)
