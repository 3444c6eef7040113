"""What the real-model eval runs: the cache kinds, their specs at a budget, the sizes, the plan.

:data:`KINDS` maps each cache kind to a spec template, :func:`spec_of` fills it for a number of kept
tokens, :func:`setting` picks the run's sizes (context lengths, contexts per length, held-out text)
for ``tiny``, ``quick`` or a full run, and :func:`runs_for` lists every run as ``(kind, mode,
budget)``: ``mode`` ``"question"`` (compressed with the question in the prompt) or ``"context"``
(the document compressed once, then reused), ``budget`` a share of the document's tokens (None for
kinds that keep every token). See :mod:`kvcache.apps.eval_real` for what the modes mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from .run_options import RunOptions

#: Tokens from the start (attention sinks) the window keeps beside its most recent ones.
SINKS = 4
#: Cache kind -> spec template ({slots}: kept tokens; the window keeps SINKS more apart).
KINDS: dict[str, str] = {
    "full": "static:capacity={capacity}",  # sized to the run: its bytes are the tokens' own
    "window": "window:window={window},sinks=" + str(SINKS),
    **{k: k + ":budget={slots}" for k in ("lastrec", "h2o", "tova", "tova-layer", "snapkv", "pyramidkv", "adakv")},
    "adakv-int4": "adakv:budget={slots},storage=int4",
    "kvzip": "kvzip.compress_context({slots} of the tokens)",  # hf/kvzip.py, not a spec: eval_real builds it
    "snapkv-int4": "snapkv:budget={slots},storage=int4",
    **{f"quantized-int{bits}": f"quantized:bits={bits}" for bits in (8, 4, 2)},
}
#: Kinds without a budget (one run each, no budget column).
UNBUDGETED = ("full", "quantized-int8", "quantized-int4", "quantized-int2")
#: Kinds that only run with the document compressed once (query-agnostic by design).
CONTEXT_ONLY = ("kvzip",)
DEFAULT_KINDS = tuple(KINDS)
#: Kinds also run the reuse way (``context``), besides kvzip.
DEFAULT_CONTEXT_KINDS = ("h2o", "snapkv", "kvzip")
DEFAULT_BUDGETS = (0.5, 0.25, 0.125)
ANSWER_TOKENS = 6  # the space and a five-digit key (one digit a token)


@dataclass(frozen=True)
class Setting:
    """The sizes of one run (:func:`setting`), in tokens and counts."""

    lengths: tuple[int, ...]
    contexts: int  # per length, three questions each
    text_tokens: int  # per held-out sample: the first half prefilled
    text_steps: int  # tokens scored after it, one at a time
    text_samples: int
    budgets: tuple[float, ...]


def setting(options: RunOptions) -> Setting:
    """The sizes for ``options``: ``tiny`` (seconds, for tests), ``quick`` or a full run."""
    return options.pick(
        tiny=Setting((384,), 1, 128, 8, 1, (0.5,)),
        quick=Setting((1024, 2048), 3, 1024, 32, 1, (0.5, 0.25)),
        full=Setting((1024, 2048, 4096, 8192), 6, 1024, 64, 1, DEFAULT_BUDGETS),
    )


def spec_of(kind: str, slots: int, capacity: int | None = None) -> str:
    """The spec of ``kind`` keeping ``slots`` tokens (the full cache: ``capacity``, every token)."""
    return KINDS[kind].format(slots=slots, window=max(1, slots - SINKS), capacity=capacity or slots)


def runs_for(kinds, context_kinds, budgets) -> list[tuple[str, str, float | None]]:
    """``(kind, mode, budget)`` of every run, the full reference first: ``mode`` ``"question"`` or
    ``"context"``, ``budget`` a share of the document's tokens (None for kinds that keep every token)."""
    out = [("full", "question", None)]
    for kind in kinds:
        if kind == "full":
            continue
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r} for the real-model eval; valid: {', '.join(KINDS)}")
        modes = ("context",) if kind in CONTEXT_ONLY else ("question", "context") if kind in context_kinds else ("question",)
        for mode in modes:
            out += [(kind, mode, None)] if kind in UNBUDGETED else [(kind, mode, b) for b in budgets]
    return out
