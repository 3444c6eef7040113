"""What an engine counts over its life (``Engine.stats``; ``Engine.reset_stats`` starts them again)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counts over the engine's life."""

    steps: int = 0
    #: Tokens run through the model (prefill chunks, recomputation and decode rows).
    forward_tokens: int = 0
    #: Most requests in one step, and most blocks owned at the end of a step.
    peak_rows: int = 0
    peak_owned_blocks: int = 0
    #: Most requests past their prompt (holding their whole context, decoding) after one step.
    peak_decoding: int = 0
    preemptions: int = 0
    #: Prompt tokens loaded from the store tier (first admissions and reloads after preemption).
    store_tokens: int = 0
    #: Decode rows that read a shared prefix once with other rows (``shared_prefix.py``), over all steps.
    shared_prefix_rows: int = 0
    #: Steps run through a compiled graph (``compile=True``: decode-only steps, ``graph_step.py``).
    compiled_steps: int = 0
