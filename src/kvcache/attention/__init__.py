"""Attention over cache stores: one kernel (``kernel``) over tensor views or block readers
(``readers``), masks from absolute positions (``masks``), the read record a layer's update keeps
and the function that attends it (``reads``), and the SDPA-or-``attend`` choice (``choice``, whose thresholds live there)."""

from . import fused
from .choice import fastest_attention, prefer_attend
from .kernel import DECODE_ROWS, WEIGHTS, attend, attend_weighted, group_heads, group_sinks, softmax
from .masks import CAUSAL, Visibility, VisibilityRule, position_rows
from .readers import BlockReader
from .reads import Reads, attend_reads

__all__ = [
    "CAUSAL",
    "DECODE_ROWS",
    "WEIGHTS",
    "BlockReader",
    "Reads",
    "Visibility",
    "VisibilityRule",
    "attend",
    "attend_reads",
    "attend_weighted",
    "fastest_attention",
    "fused",
    "group_heads",
    "group_sinks",
    "position_rows",
    "prefer_attend",
    "softmax",
]
