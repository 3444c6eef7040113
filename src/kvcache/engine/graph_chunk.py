"""Prompt steps as one compiled graph (the engine's ``compile=True``), whatever their token count.

A step that is not all decode rows (``graph_step.py`` compiles those) but whose rows all live in a
full-precision pool on the CPU, report no weights and want no prompt log-probabilities runs the
model's forward compiled by ``torch.compile`` (inductor, ``fullgraph``, weights frozen), so the
normalisations, rotations, activations and residual sums between the linear layers run as a few
fused loops instead of one PyTorch call each. The step's token count ``T`` is a dynamic
dimension of the graph, so steps of every size share one graph (each linear layer picks its
packed layout by the step's token count at run time, ``linear_ops.call``); the rows are padded
to the engine's ``max_seqs`` with rows of no tokens, so that dimension is fixed. Inductor decides
which loops run on several threads by the token count the graph was traced with, so the engine's
``warm_up`` traces a step of ``max_batch_tokens`` (traced with 2 tokens, the loops that rotate the
queries and keys ran on one thread: 0.34 against 0.16 ms a layer of a 2,048-token SmolLM2 step).

Per layer the attention (``ChunkStep.attend``) writes the step's keys and values into their slots by
index assignment and runs every row, a prompt chunk or a decode row alike (a chunk of one token),
through ``kvcache::paged_prefill``: causal inside the chunk, over the row's blocks before it. The
logits come out only for each row's last token (``logits_to_keep``). A decode row in such a step
reads its whole past on its own, not a shared prefix once with other rows (decode-only steps do).

Inputs per step: ``ids``, ``positions`` int64 ``[1, T]``; ``slot_blocks``, ``slot_offsets`` int64
``[T]``; ``tables`` int32 ``[S, W]`` (``W`` the pool's blocks), ``starts`` int64 ``[S + 1]``,
``pasts`` int64 ``[S]``; ``keep`` int64 ``[S]`` (each row's last token; padding rows keep token 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..attention import graph_ops
from ..errors import UnsupportedOperation
from ..hf.bridge import FORWARD_STEP, ForwardStep
from .graph_step import Compiler, refusal
from .pool import BlockPool
from .rotary_tables import RotaryTables
from .rows import Row, slots_of, tables_of
from .step import check_call, running

#: Fewest tokens a compiled prompt step takes (a step of one token would compile a graph of its own).
MIN_TOKENS = 2


class GraphChunk:
    """The compiled prompt steps of ``model`` over ``pool`` for up to ``max_rows`` rows a step;
    ``linears``: the engine's ``PackedLinears`` or None."""

    def __init__(self, model: Any, pool: BlockPool, max_rows: int, linears: Any) -> None:
        why = refusal(pool)
        if why is not None:
            raise UnsupportedOperation(why + "; create the engine with compile=False")
        self.model, self.pool, self.rows, self.linears = model, pool, max_rows, linears
        self.ops = graph_ops.register()
        self.rotary = RotaryTables(model, self.ops.kept)
        #: Compiles this engine's prompt graphs and counts them.
        self.compiler = Compiler()

        def forward(ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, step: ChunkStep) -> torch.Tensor:
            out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep, **{FORWARD_STEP: step})
            return out.logits

        self._compiled = self.compiler.compile(forward, "prompt_step")

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (one: every token count shares it)."""
        return self.compiler.graphs

    def takes(self, rows: Sequence[Row], scored: bool) -> bool:
        """Whether a step of ``rows`` runs compiled: no prompt log-probabilities to score
        (``scored``), at least ``MIN_TOKENS`` tokens, at most ``max_rows`` rows, every row in the
        pool's blocks reporting no weights."""
        return (
            not scored
            and 0 < len(rows) <= self.rows
            and sum(r.count for r in rows) >= MIN_TOKENS
            and all(r.weights is None and r.cache is None for r in rows)
        )

    def run(self, rows: Sequence[Row], ids: Sequence[int], positions: Sequence[int], keep: Sequence[int]) -> torch.Tensor:
        """The logits ``[len(keep), vocab]`` at packed tokens ``keep`` (each a row's last) of a step
        of ``rows`` (``takes`` them; their slots claimed) computing tokens ``ids`` at ``positions``."""
        step = ChunkStep(self.pool, self.ops, rows, self.rows)
        ids_t = torch.tensor([list(ids)], dtype=torch.long)
        positions_t = torch.tensor([list(positions)], dtype=torch.long)
        kept = torch.zeros(self.rows, dtype=torch.long)
        kept[: len(keep)] = torch.tensor(list(keep), dtype=torch.long)
        for t in (ids_t, positions_t):
            torch._dynamo.mark_dynamic(t, 1)
        for t in (step.slot_blocks, step.slot_offsets):
            torch._dynamo.mark_dynamic(t, 0)
        with running(self.model, self.linears), self.rotary.active():
            logits = self._compiled(ids_t, positions_t, kept, step)
        return logits[0, : len(keep)]

    def warm(self, scratch: int, tokens: int) -> None:
        """Compile the graph now, by one step of one row of ``tokens`` tokens (at most what the
        pool's blocks hold), all written to block ``scratch``: a full step's tokens, since inductor
        gives a loop several threads by the token count it traces with (module docstring)."""
        bs = self.pool.block_size
        tokens = max(MIN_TOKENS, min(tokens, self.pool.total * bs))
        row = Row(0, tokens, 0, (scratch,) * -(-tokens // bs))
        self.run([row], [0] * tokens, range(tokens), [tokens - 1])


class ChunkStep(ForwardStep):
    """One compiled prompt step's inputs over ``pool`` and its attention (module docstring)."""

    def __init__(self, pool: BlockPool, ops: graph_ops.GraphOps, rows: Sequence[Row], size: int) -> None:
        self.pool, self.ops, self.size = pool, ops, size
        self.slot_blocks, self.slot_offsets = slots_of(rows, pool.block_size)
        own = tables_of(list(rows))
        self.tables = torch.zeros(size, pool.total, dtype=torch.int32)
        self.tables[: own.shape[0], : own.shape[1]] = own
        counts = [r.count for r in rows] + [0] * (size - len(rows))
        self.starts = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
        self.pasts = torch.tensor([r.past for r in rows] + [0] * (size - len(rows)), dtype=torch.long)
        self.layers = [pool.storage.layer(i) for i in range(pool.layers)]

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:  # fmt: skip
        """Write ``key``/``value`` ``[1, Hkv, T, D]`` into their slots and attend every row
        causally over its blocks; ``[1, T, Hq, Dv]``."""
        tokens = self.slot_blocks.shape[0]  # the same (dynamic) size as the query's
        layer = check_call(self.pool, module, query, key, value, kwargs, tokens)
        blocks = self.layers[layer]
        keys, values = blocks["keys"], blocks["values"]
        # by index assignment on the layer's tensors, not ``storage.write_slots``: traced through
        # that, a compiled 16-row SmolLM2 step took 326 ms against 86
        keys[self.slot_blocks, :, self.slot_offsets] = key[0].transpose(0, 1).to(keys.dtype)
        values[self.slot_blocks, :, self.slot_offsets] = value[0].transpose(0, 1).to(values.dtype)
        q_heads, dim = query.shape[1], query.shape[-1]
        kv_heads = self.pool.kv_heads
        scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
        # contiguous here, so the rotation writes this layout itself (the kernel would copy it again)
        q = query[0].reshape(kv_heads, q_heads // kv_heads, tokens, dim).transpose(1, 2).contiguous()
        out = self.ops.paged_prefill(q, keys, values, self.tables, self.starts, self.pasts, scale)  # [Hkv, T, R, Dv]
        return out.transpose(1, 2).reshape(q_heads, tokens, -1).transpose(0, 1)[None].to(query.dtype)
