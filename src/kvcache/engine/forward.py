"""One engine step's forward pass: the scheduler's rows in, each finished row's next token out.

The rows (each request and how many of its tokens it computes) become one packed sequence of
token ids and positions and ``step.Row``s. A step in which every row decodes one token runs through
the compiled graph of its bucket where the engine has one (``graph_step.py``); any other step runs
the model eagerly, its linear layers on packed weights (``PackedLinears``), its attention through
``step.PagedStep``. The logits of each row's last token give its next token (``sampling.py``) and
its log-probabilities (``logprobs.py``); a prompt to be compressed gets its own cache from what its
chunks reported (``hf.scoring.compress``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf.bridge import FORWARD_STEP
from ..hf.build import make_cache
from ..hf.linears import PackedLinears
from ..hf.scoring import compress
from .compression import accumulate
from .graph_chunk import GraphChunk
from .graph_step import GraphDecode
from .logprobs import record
from .pool import BlockPool
from .probe import check_layers_run
from .request import Request
from .rows import Row
from .sampling import choose
from .step import PagedStep, running


class Forward:
    """The forward passes of ``model`` over ``pool``: compiled through ``graph`` (decode-only
    steps) or ``chunks`` (other steps) where one takes the step, else eager with ``linears``
    active; ``keeps_logits``: the model's forward takes ``logits_to_keep``."""

    def __init__(
        self, model: Any, pool: BlockPool, graph: GraphDecode | None, chunks: GraphChunk | None,
        linears: PackedLinears | None, keeps_logits: bool,
    ) -> None:  # fmt: skip
        self.model, self.pool, self.graph, self.chunks = model, pool, graph, chunks
        self.linears, self.keeps_logits = linears, keeps_logits

    def __call__(self, rows: list[tuple[Request, int]]) -> tuple[dict[int, int], dict[int, Any], int, bool]:
        """One forward pass over ``rows`` (each request and how many of its tokens): the next token
        of each row that computed its last token, the own cache of each prompt compressed in this
        step (request id -> ``KVCache``), the decode rows that read a shared prefix once, and
        whether the step ran compiled."""
        ids, positions, packed, last, scoring = [], [], [], [], []
        for request, n in rows:
            if request.cache is None and request.own_context:  # a window's cache takes its prompt too
                request.cache = make_cache(self.model, request.compression.spec)
            start = len(ids)
            ids.extend(request.tokens[request.computed : request.computed + n])
            positions.extend(range(request.computed, request.computed + n))
            scores = min(request.computed + n, len(request.prompt) - 1) - request.computed
            if request.prompt_logprobs is not None and scores > 0:  # logits at position p score prompt token p + 1
                scoring.append((request, start, scores))
            c = request.compression
            prompt = c is not None and request.cache is None
            weights = c.chunk_modes(request.computed + n == len(request.prompt)) if prompt else None
            packed.append(Row(start, n, request.slots, tuple(request.table), request.tail, weights, request.cache))
            if request.computed + n == len(request.tokens):
                last.append((request.rid, start + n - 1))
        rows_scored = [i for _, start, count in scoring for i in range(start, start + count)]
        reported: dict[int, list] = {}
        compiled = self.graph is not None and self.graph.takes(packed)
        if compiled:  # every row decodes: its last token is its only one
            logits, shared = self.graph.run(packed, ids, positions)
        elif self.chunks is not None and self.chunks.takes(packed, bool(rows_scored)):
            logits, shared, compiled = self.chunks.run(packed, ids, positions, [i for _, i in last]), 0, True
        else:
            logits, shared, reported = self._eager(packed, ids, positions, [i for _, i in last] + rows_scored)
        by_id = {request.rid: request for request, _ in rows}
        picked = [by_id[rid] for rid, _ in last]
        chosen = choose(logits[: len(last)], [r.sampling for r in picked], [r.generator for r in picked])
        record(picked, logits[: len(last)], chosen, scoring, logits[len(last) :])
        caches = {}
        for i, reported in reported.items():
            request, n = rows[i]
            request.observed = accumulate(request.observed, {m: [w[m] for _, _, w in reported] for m in reported[0][2]})
            if request.computed + n == len(request.prompt):
                past = [(k, v) for k, v, _ in reported]
                caches[request.rid] = compress(self.model, request.compression.spec, past, request.observed)
        return {rid: token for (rid, _), token in zip(last, chosen)}, caches, shared, compiled

    def _eager(self, packed: list[Row], ids: list[int], positions: list[int], keep: list[int]) -> tuple[torch.Tensor, int, dict]:
        """One eager forward pass of the step of ``packed`` rows: the logits ``[len(keep), vocab]``
        of the packed tokens ``keep``, the decode rows that read a shared prefix once, and what
        rows that report weights kept (``PagedStep.reported``)."""
        step = PagedStep(self.pool, packed)
        device = self.pool.device
        kept = torch.tensor(keep, dtype=torch.long, device=device)
        kwargs = {"logits_to_keep": kept} if self.keeps_logits else {}
        with running(self.model, self.linears):
            out = self.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                **{FORWARD_STEP: step},
                **kwargs,
            )
        check_layers_run(step, self.pool.layers)
        logits = out.logits[0] if self.keeps_logits else out.logits[0, kept]
        return logits, step.shared_rows, step.reported
