"""Storage layers: one strategy per module, all behind the contract in ``base.py``."""

from .base import Geometry, KVLayer, LayerState
from .concat import ConcatLayer
from .evicting import EvictingLayer
from .growable import GrowableLayer
from .quantized import QuantizedLayer
from .static import StaticLayer
from .store import SlotStore
from .window import WindowLayer

#: Every layer kind by its name, as used in specs and saved files.
LAYER_KINDS: dict[str, type[KVLayer]] = {
    cls.kind: cls for cls in (ConcatLayer, GrowableLayer, StaticLayer, WindowLayer, EvictingLayer, QuantizedLayer)
}

__all__ = [
    "LAYER_KINDS",
    "ConcatLayer",
    "EvictingLayer",
    "Geometry",
    "GrowableLayer",
    "KVLayer",
    "LayerState",
    "QuantizedLayer",
    "SlotStore",
    "StaticLayer",
    "WindowLayer",
]
