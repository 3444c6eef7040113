"""Storage layers: one strategy per module, all behind the contract in ``base.py``.

Which kinds exist is the table in ``registry.py``; importing this package registers nothing.
"""

from .adaptive import AdaptiveLayer
from .auto import AutoLayer, slot_bytes
from .byte_budget import fp32_bytes
from .auto_heads import AutoHeadsLayer
from .base import KVLayer
from .checks import Geometry
from .state import LayerState
from .concat import ConcatLayer
from .evicting import EvictingLayer
from .growable import GrowableLayer
from .mix import mix_of
from .quantized import QuantizedLayer, StoreReader
from .sliding import SlidingLayer
from .static import StaticLayer
from .store import SlotStore
from .tiers import mean_slot_bytes, mixed_parts
from .window import WindowLayer

__all__ = [
    "AdaptiveLayer",
    "AutoHeadsLayer",
    "AutoLayer",
    "ConcatLayer",
    "EvictingLayer",
    "Geometry",
    "GrowableLayer",
    "KVLayer",
    "LayerState",
    "QuantizedLayer",
    "SlidingLayer",
    "SlotStore",
    "StaticLayer",
    "StoreReader",
    "WindowLayer",
    "fp32_bytes",
    "mean_slot_bytes",
    "mix_of",
    "mixed_parts",
    "slot_bytes",
]
