"""Attention over cache stores: one kernel (``kernel``) over tensor views or block readers
(``readers``), grouped query heads with their masks and sinks (``heads``), the reduced weights it
reports (``weights``), masks from absolute positions (``masks``), the read record a layer's update keeps
and the function that attends it (``reads``), and the SDPA-or-``attend`` choice (``choice``, whose thresholds live there)."""

from . import fused
from .choice import fastest_attention, prefer_attend
from .heads import group_heads, group_sinks, softmax
from .kernel import DECODE_ROWS, attend, attend_weighted
from .masks import CAUSAL, Visibility, VisibilityRule, position_rows
from .readers import BlockReader
from .reads import Reads, attend_reads
from .weights import WEIGHTS

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
