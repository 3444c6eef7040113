"""Decode steps as one compiled graph per row bucket (the engine's ``compile=True``).

A step whose rows all decode one token over a full-precision pool on the CPU runs the model's
forward compiled by ``torch.compile`` (inductor, ``fullgraph``, weights frozen: inductor packs the
linear layers for oneDNN itself) instead of eagerly. The attention is part of the graph: it writes
the step's keys and values into their slots by index assignment and reads the pool through the C++
kernels declared as torch operators (``attention/graph_ops.py``), so nothing breaks the graph.

Shapes are fixed per bucket: a step of ``S`` rows runs in the smallest bucket ``B >= S`` of
``BUCKETS``, padded. Each bucket keeps its inputs as tensors written in place before every call,
so one compiled graph serves every step of that bucket:

- ``ids``, ``positions`` int64 ``[1, B]``;
- ``slot_blocks``, ``slot_offsets`` int64 ``[B]``: where each row's new token goes;
- ``tables`` int32 ``[B, W]`` and ``lengths`` int64 ``[B]``: the blocks each row reads on its own,
  ``W`` the pool's blocks (the most a row can hold), only each row's first entries written;
- ``shared_table`` int32 ``[1, W]``, ``shared_length`` int64 ``[1]``, ``members`` bool ``[B]``: the
  step's largest group of rows sharing prefix blocks (``shared_prefix.groups``), read once for all
  of them; a group's rows read only their blocks after it on their own. Without a group the
  shared length is 0.

Padding rows write into, and read, one scratch block that the engine holds for this (taken from
the pool). Per layer the attention reads the rows' own blocks through ``kvcache::paged_decode_lse``,
the shared prefix through the same operator with every row's query stacked (in passes of at most
``native.PAGED_MAX_ROWS`` query rows), and merges the two by their log-sum-exps as
``shared_prefix.attend`` does; rows outside the group take their own read alone.

A bucket is compiled at its first step (about a minute for SmolLM2 on a 2-core CPU; far less for
a tiny model), later steps reuse it; ``graphs`` counts the graphs compiled. The weights are frozen
into the graphs, and the steps do not check the model's modules again (dynamo's guards on them
are dropped: they cost about 2 ms a SmolLM2 step): a model whose weights or modules change after
its first compiled step needs a new engine.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import Any

import torch

from ..attention import graph_ops, native
from ..errors import UnsupportedOperation
from ..hf.bridge import FORWARD_STEP
from ..hf.linears import PackedLinears
from . import shared_prefix
from .pool import BlockPool
from .rotary_tables import RotaryTables
from .rows import Row, padded
from .step import check_call, running

#: Row buckets (dynamo keeps up to 8 graphs of one function).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def refusal(pool: BlockPool) -> str | None:
    """Why decode steps over ``pool`` cannot be compiled, or None when they can."""
    if not pool.exact:
        return f"the engine compiles steps over full-precision blocks; this pool's are {pool.format.name}"
    if pool.device.type != "cpu":
        return f"the engine compiles steps on the CPU; this pool is on {pool.device}"
    if not native.available():
        return "the engine's compiled step needs kvcache's C++ library, which cannot be built here (no C++ compiler)"
    return None


class GraphDecode:
    """The compiled decode steps of ``model`` over ``pool``, for up to ``max_rows`` rows a step, its
    linear layers on ``linears``' packed copies where given (their panels, ``kvcache::linear``)."""

    def __init__(self, model: Any, pool: BlockPool, max_rows: int, linears: PackedLinears | None = None):
        why = refusal(pool)
        if why is not None:
            raise UnsupportedOperation(why + "; create the engine with compile=False")
        self.model, self.pool, self.linears = model, pool, linears
        self.ops = graph_ops.register()
        self.rotary = RotaryTables(model, self.ops.kept)
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + (next((b for b in BUCKETS if b >= max_rows), BUCKETS[-1]),)
        #: The block padding rows write into and read (held for good, never shared).
        self.scratch = pool.allocate(1)[0]
        self._buckets: dict[int, Bucket] = {}
        #: Compiles this engine's decode graphs and counts them.
        self.compiler = Compiler()

        def forward(ids: torch.Tensor, positions: torch.Tensor, step: Bucket) -> torch.Tensor:
            return model(input_ids=ids, position_ids=positions, use_cache=False, **{FORWARD_STEP: step}).logits

        self._compiled = self.compiler.compile(forward, "decode_step", dynamic=False)

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (one a bucket, unless something recompiles)."""
        return self.compiler.graphs

    def takes(self, rows: Sequence[Row]) -> bool:
        """Whether a step of ``rows`` runs compiled: every row decodes one token over the pool's
        blocks (no own cache, no weights to report), and a bucket holds them."""
        return 0 < len(rows) <= self.buckets[-1] and all(
            r.count == 1 and r.past > 0 and r.weights is None and r.cache is None for r in rows
        )

    def run(
        self, rows: Sequence[Row], ids: Sequence[int], positions: Sequence[int], size: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """The logits ``[S, vocab]`` of a step of ``rows`` (``takes`` them; their slots claimed)
        computing tokens ``ids`` at ``positions``, and how many rows read a shared prefix once; in
        bucket ``size`` (default the smallest that holds them)."""
        size = self.bucket_for(len(rows)) if size is None else size
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = Bucket(self, size)
        shared = bucket.fill(rows, ids, positions)
        with running(self.model, self.linears), self.rotary.active():
            logits = self._compiled(bucket.ids, bucket.positions, bucket)
        return logits[0, : len(rows)], shared

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` rows (the largest bucket past it)."""
        return next((b for b in self.buckets if b >= rows), self.buckets[-1])

    def warm(self, rows: int | None = None) -> None:
        """Compile every bucket up to the one that holds ``rows`` rows (default: all) now, each by
        one call of padding rows alone (which touch only the scratch block)."""
        top = self.buckets[-1] if rows is None else self.bucket_for(rows)
        for size in self.buckets:
            if size <= top:
                self.run([], [], [], size)


class Compiler:
    """``torch.compile`` for an engine's step function (inductor, ``fullgraph``, weights frozen),
    counting the graphs it compiles (``graphs``)."""

    def __init__(self) -> None:
        self.graphs = 0

    def compile(self, forward: Any, name: str, **options: Any) -> Any:
        """``forward`` compiled. Dynamo keeps its graphs (at most 8) on the function's code object,
        which every engine's ``forward`` would share: a copy of the code object gives this engine
        graphs of its own. Its guards skip the model's modules (see the module docstring); a step's
        inputs, shapes included, are still checked."""
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, name, None, forward.__closure__)
        skip = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        return torch.compile(own, backend=self._backend, fullgraph=True, options=skip, **options)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs, config_patches={"freezing": True})


class Bucket:
    """The inputs of a compiled step of ``size`` rows, and its attention (a ``ForwardStep``)."""

    def __init__(self, graph: GraphDecode, size: int):
        pool = graph.pool
        self.pool, self.ops, self.size, self.scratch = pool, graph.ops, size, graph.scratch
        width = pool.total
        self.ids = torch.zeros(1, size, dtype=torch.long)
        self.positions = torch.zeros(1, size, dtype=torch.long)
        self.slot_blocks = torch.full((size,), self.scratch, dtype=torch.long)
        self.slot_offsets = torch.zeros(size, dtype=torch.long)
        self.tables = torch.full((size, width), self.scratch, dtype=torch.int32)
        self.lengths = torch.ones(size, dtype=torch.int64)
        self.shared_table = torch.zeros(1, width, dtype=torch.int32)
        self.shared_length = torch.zeros(1, dtype=torch.int64)
        self.members = torch.zeros(size, dtype=torch.bool)
        self.layers = [pool.storage.layer(i) for i in range(pool.layers)]

    def fill(self, rows: Sequence[Row], ids: Sequence[int], positions: Sequence[int]) -> int:
        """Write the step of ``rows`` into the inputs (padding the rest); the rows in the shared pass."""
        n, bs = len(rows), self.pool.block_size
        lengths = [r.length for r in rows]
        tables = [r.table for r in rows]
        groups = shared_prefix.groups(tables, lengths, bs)
        members, shared = max(groups, key=lambda g: len(g[0]) * g[1], default=([], 0))
        skip = [0] * n
        for i in members:
            skip[i] = shared
        own = padded([t[s:] for t, s in zip(tables, skip)])
        self.ids[0, :n] = torch.tensor(list(ids))
        self.positions[0, :n] = torch.tensor(list(positions))
        self.slot_blocks[:n] = torch.tensor([r.table[r.past // bs] for r in rows])
        self.slot_offsets[:n] = torch.tensor([r.past % bs for r in rows])
        self.tables[:n, : own.shape[1]] = own
        self.lengths[:n] = torch.tensor([length - s * bs for length, s in zip(lengths, skip)])
        self.ids[0, n:] = 0
        self.positions[0, n:] = 0
        self.slot_blocks[n:] = self.scratch
        self.slot_offsets[n:] = 0
        self.tables[n:, 0] = self.scratch
        self.lengths[n:] = 1
        self.members.fill_(False)
        if members:
            self.members[members] = True
            self.shared_table[0, :shared] = torch.tensor(tables[members[0]][:shared], dtype=torch.int32)
        self.shared_length[0] = shared * bs
        return len(members)

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:  # fmt: skip
        """Write ``key``/``value`` ``[1, Hkv, B, D]`` into the rows' slots and attend; ``[1, B, Hq, Dv]``."""
        layer = check_call(self.pool, module, query, key, value, kwargs, self.size)
        blocks = self.layers[layer]
        keys, values = blocks["keys"], blocks["values"]
        # by index assignment on the layer's tensors, not ``storage.write_slots``: traced through
        # that, a compiled 16-row SmolLM2 step took 326 ms against 86
        keys[self.slot_blocks, :, self.slot_offsets] = key[0].transpose(0, 1).to(keys.dtype)
        values[self.slot_blocks, :, self.slot_offsets] = value[0].transpose(0, 1).to(values.dtype)
        size, q_heads, dim = self.size, query.shape[1], query.shape[-1]
        kv_heads = self.pool.kv_heads
        group = q_heads // kv_heads
        scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
        q = query[0].transpose(0, 1).reshape(size, kv_heads, group, dim)
        own, own_lse = self.ops.paged_decode_lse(q, keys, values, self.tables, self.lengths, scale)
        # every row's query as the rows of one sequence over the shared blocks, in passes the kernel takes
        per_pass = max(1, native.PAGED_MAX_ROWS // group)
        stacked = q.transpose(0, 1)  # [Hkv, B, R, D]
        parts = [
            self.ops.paged_decode_lse(
                stacked[:, s : s + per_pass].reshape(1, kv_heads, -1, dim), keys, values,
                self.shared_table, self.shared_length, scale,
            )  # fmt: skip
            for s in range(0, size, per_pass)
        ]
        out_s = torch.cat([o.reshape(kv_heads, -1, group, o.shape[-1]) for o, _ in parts], dim=1).transpose(0, 1)
        lse_s = torch.cat([lse.reshape(kv_heads, -1, group) for _, lse in parts], dim=1).transpose(0, 1)
        member = self.members[:, None, None]
        # a row outside the group takes its own read alone (own_lse is finite: every row reads its new token)
        lse_s = torch.where(member, lse_s, float("-inf"))
        out_s = torch.where(member[..., None], out_s, 0.0)
        out = shared_prefix.merge(out_s, lse_s, own, own_lse)
        return out.reshape(1, size, q_heads, -1).to(query.dtype)
