"""Attention over cache stores: one kernel (``kernel``) over tensor views or block readers
(``readers``), grouped query heads with their masks and sinks (``heads``), the reduced weights it
reports (``weights``), masks from absolute positions (``masks``), the read record a layer's update keeps
and the function that attends it (``reads``), and the SDPA-or-``attend`` choice (``choice``, whose thresholds live there)."""

from . import device_kernels, fused, fused_paged, native, triton_decode
from .choice import fastest_attention, prefer_attend
from .half_precision import HalfPrecision, ProbeResult, half_precision_support, use_safe_isa
from .heads import group_heads, group_sinks, softmax
from .kernel import DECODE_ROWS, attend, attend_weighted
from .masks import CAUSAL, Visibility, VisibilityRule, position_rows
from .native_build import DISABLE_ENV, cpu_flags, isa
from .readers import BlockReader
from .reads import Reads, attend_reads
from .weights import WEIGHTS, is_queries

__all__ = [
    "CAUSAL",
    "DECODE_ROWS",
    "DISABLE_ENV",
    "WEIGHTS",
    "is_queries",
    "BlockReader",
    "HalfPrecision",
    "ProbeResult",
    "Reads",
    "Visibility",
    "VisibilityRule",
    "attend",
    "attend_reads",
    "attend_weighted",
    "cpu_flags",
    "device_kernels",
    "fastest_attention",
    "fused",
    "fused_paged",
    "group_heads",
    "group_sinks",
    "half_precision_support",
    "isa",
    "native",
    "position_rows",
    "prefer_attend",
    "softmax",
    "triton_decode",
    "use_safe_isa",
]
