"""One scheduler step as one forward pass: the rows of every running request packed into one
sequence, and the attention that writes their keys and values into the pool and reads each row's
own blocks.

The model sees a batch of one sequence of ``T`` tokens (every row's tokens one after the other)
with each token's own position id, so its linear layers run once over all rows. Its attention
calls (the ``"kvcache"`` implementation, which hands them to ``PagedStep.attend`` when the forward
carries a step under ``hf.FORWARD_STEP``) take the packed query ``[1, Hq, T, D]`` and the new keys
and values ``[1, Hkv, T, D]``. For each layer the step:

1. runs each row whose context lives in a bounded cache of its own (``compression.py``) through
   that cache's layer: ``update`` with its new key and value, then ``attend``, as under ``generate``;
2. stores the other rows' new keys and values in the pool, as its format allows (``block_io.py``:
   every token into its slot, or into the row's open block where blocks are coded whole);
3. runs the rows that compute one token (decode) together through the paged kernel of the pool's
   format (ragged lengths, each row's block table; in full precision, rows that share prefix blocks
   read those once for all of them, ``shared_prefix.py``);
4. runs each row of several tokens (a prefill chunk) through attention over its past and itself,
   causal aligned to the end: in full precision all such rows at once through the paged prefill
   kernel over their blocks (``block_io.SlotIO.chunks``), else (coded blocks, a chunk that reports
   weights, a device without the kernel) each over its gathered past and itself;
5. stores what had to be read exact first (blocks that filled, coded; a chunk's remainder, open).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import attend, attend_weighted
from ..errors import UnsupportedOperation
from ..hf.attention_kwargs import AttentionExtras
from ..hf.bridge import ForwardStep, use_kvcache_attention
from .block_io import block_io
from .pool import BlockPool
from .rows import Row, StepRows


class PagedStep(ForwardStep):
    """The attention of one packed forward pass over ``pool`` (see the module docstring).

    ``rows`` lie one after the other from token 0 of the packed sequence. Every block a row writes
    must be writable (``BlockPool.claim`` checks and notes them; the engine claims before the
    forward). ``layers_run`` counts the attention calls, so the engine can tell a model that did not
    pass the step down to its attention."""

    def __init__(self, pool: BlockPool, rows: list[Row]):
        self.pool, self.rows = pool, rows
        #: The rows split by how they attend (``rows.StepRows``), what ``block_io`` reads too.
        self.split = StepRows(rows, pool.device)
        self.layers_run = 0
        #: For each row that reports weights (by its index in ``rows``): per layer the row's keys and
        #: values ``[1, Hkv, length, D]`` and its weights, mode -> float32 ``[1, Hkv, length]``.
        self.reported: dict[int, list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self.io = block_io(pool, self.split)

    @property
    def shared_rows(self) -> int:
        """Decode rows that read a shared prefix in one pass with other rows, in this step."""
        return self.io.shared_rows

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:
        """Write ``key``/``value`` ``[1, Hkv, T, D]`` into the pool and attend; ``[1, T, Hq, Dv]``."""
        layer = check_call(self.pool, module, query, key, value, kwargs, self.split.tokens)
        dim = query.shape[-1]
        scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
        out = self._attend_layer(layer, query, key, value, scale)
        self.layers_run += 1
        return out

    def _attend_layer(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store the layer's new keys and values and attend every row: ``[1, T, Hq, Dv]``."""
        split = self.split
        out = query.new_empty(1, split.tokens, query.shape[1], value.shape[-1])
        for r in split.own_rows:
            span = slice(r.start, r.start + r.count)
            own = r.cache.kv_layers[layer]
            own.update(key[:, :, span], value[:, :, span])
            out[0, span] = own.attend(query[:, :, span], scale=scale)[0].transpose(0, 1)
        self.io.before(layer, key, value)
        if split.decode_rows:
            q = query[0, :, split.decode_tokens].transpose(0, 1)  # [S, Hq, D]
            out[0, split.decode_tokens] = self.io.decode(layer, q, scale).to(out.dtype)
        chunks = self.io.chunks(layer, query, scale) if split.chunk_rows else None
        if chunks is not None:
            out[0, self.io.chunk_tokens] = chunks.to(out.dtype)
        for r in split.chunk_rows if chunks is None else split.reporting_rows:
            span = slice(r.start, r.start + r.count)
            q, k, v = query[:, :, span], key[:, :, span], value[:, :, span]
            if r.past:
                past_k, past_v = self.io.past(layer, r)
                k = torch.cat([past_k[None].to(k.dtype), k], dim=2)
                v = torch.cat([past_v[None].to(v.dtype), v], dim=2)
            if r.weights is not None:
                got = self._reporting(r, q, k, v, scale)
            elif r.past == 0:
                got = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                got = attend(q, k, v, scale=scale, causal=True)
            out[0, span] = got[0].transpose(0, 1)
        self.io.after(layer, key, value)
        return out

    def _reporting(self, row: Row, q, k, v, scale: float) -> torch.Tensor:
        """A chunk row's attention ``[1, Hq, n, Dv]`` over ``k``/``v`` (its past and itself),
        keeping them and its reduced weights in ``reported``."""
        if row.weights:
            got, weights = attend_weighted(q, k, v, scale=scale, causal=True, weights=row.weights)
        else:  # keys and values only (a compression that reads no weights)
            got, weights = attend(q, k, v, scale=scale, causal=True), {}
        self.reported.setdefault(self.rows.index(row), []).append((k, v, weights))
        return got


@contextlib.contextmanager
def running(model: Any, linears: Any) -> Iterator[None]:
    """What every engine forward pass runs under, eager or compiled: inference mode, ``model``'s
    attention as the ``"kvcache"`` implementation, and ``linears`` (a ``PackedLinears``, or None)
    active."""
    with torch.inference_mode(), stepping(model, linears):
        yield


@contextlib.contextmanager
def stepping(model: Any, linears: Any) -> Iterator[None]:
    """The attention switch and the packed linear layers of ``running``, entered once for a run of
    steps on the thread that steps (the engine's loops): the steps' own entries inside it then cost
    nothing, where alone each walks the model's modules twice (about 2 ms a step for SmolLM2). Not
    inference mode, which each step enters itself: tensors made between steps stay normal tensors,
    as the compiled graphs were traced with (an inference tensor fails their guards and compiles
    the graph again). ``no_grad`` because the packed layers swap in only without autograd."""
    with torch.no_grad(), use_kvcache_attention(model), linears.active() if linears is not None else contextlib.nullcontext():
        yield


def check_call(
    pool: BlockPool, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    kwargs: dict, tokens: int,
) -> int:  # fmt: skip
    """The layer of an attention call of a packed step of ``tokens`` tokens over ``pool``; refuses a
    call the engine's paged attention cannot serve, naming why."""
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise UnsupportedOperation(
            f"the engine needs each attention module's layer_idx; {type(module).__name__} has none"
        )
    extras = AttentionExtras.from_kwargs(kwargs)
    if extras.softcap is not None or extras.sinks is not None or extras.bias is not None or extras.indices is not None:
        raise UnsupportedOperation(
            "the engine's paged attention does not apply logit caps, attention sinks, position biases or "
            "sparse indices yet; serve this model with generate and make_cache"
        )
    if query.shape[0] != 1 or query.shape[2] != tokens:
        raise UnsupportedOperation(
            f"the engine packs {tokens} tokens as one sequence, but the attention got a query of shape "
            f"{list(query.shape)}; this model does not pass the packed batch through unchanged"
        )
    if key.shape[1] != pool.kv_heads or key.shape[-1] != pool.head_dim or value.shape[-1] != pool.value_dim:
        raise UnsupportedOperation(
            f"layer {layer}'s attention got keys {list(key.shape)} and values {list(value.shape)}; the engine's pool "
            f"holds {pool.kv_heads} heads of {pool.head_dim} (values {pool.value_dim}) as the config says"
        )
    return layer
