"""One chunk's forward pass with gradients, over a cache state given as tensors.

The model runs as it always does (its embeddings, norms, MLPs, rotary positions); only its
attention calls are taken over: the forward pass carries a ``ChunkStep`` under ``hf.FORWARD_STEP``
and the ``"kvcache"`` attention hands each call to it. For layer ``l`` the step attends the chunk's
queries over the layer's state before the chunk (``ReplayState``: keys, values and the absolute position
of each slot, tensors that may require gradients) followed by the chunk's own keys and values, with
the layer's visibility rule by position (causal; a window's band and sinks). It then puts together
the state the layer kept after the chunk, as the inference cache decided it (``kept``: positions),
by gathering from that concatenation, so gradients reach what the next chunk attended.

No decision is made here: which positions a layer keeps comes from the inference cache's own
forward pass (``train.chunked``), so training replays exactly what serving does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import Visibility
from ..errors import UnsupportedOperation
from ..hf.attention_kwargs import AttentionExtras
from ..hf.bridge import ForwardStep


@dataclass
class ReplayState:
    """One layer's cache state: keys ``[B, Hkv, N, D]``, values ``[B, Hkv, N, Dv]`` and the
    absolute position of each slot ``[B, Hkv, N]`` (-1: an empty slot, never attended)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def detached(self) -> ReplayState:
        return ReplayState(self.keys.detach(), self.values.detach(), self.positions)

    def leaf(self) -> ReplayState:
        """A copy whose keys and values are leaves that collect their gradient."""
        return ReplayState(self.keys.detach().requires_grad_(True), self.values.detach().requires_grad_(True), self.positions)


def empty_state(batch: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype, device) -> ReplayState:
    """The state of a layer before any token: no slots."""
    return ReplayState(
        torch.zeros(batch, heads, 0, head_dim, dtype=dtype, device=device),
        torch.zeros(batch, heads, 0, value_dim, dtype=dtype, device=device),
        torch.zeros(batch, heads, 0, dtype=torch.long, device=device),
    )


def gather_index(candidates: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Where each of ``kept`` ``[B, H, N]`` (positions, -1 for an empty slot) lies in ``candidates``
    ``[B, H, M]`` (positions distinct per row and head, -1 aside): indices ``[B, H, N]`` (0 for an
    empty slot). Raises if a kept position is not among the candidates: the state to replay is not
    the one the inference cache held."""
    if kept.shape[-1] == 0:
        return torch.zeros(kept.shape, dtype=torch.long, device=kept.device)
    big = torch.iinfo(torch.long).max
    keyed = torch.where(candidates < 0, big, candidates)
    order = keyed.argsort(dim=-1)
    ordered = keyed.gather(-1, order)
    at = torch.searchsorted(ordered, torch.where(kept < 0, big, kept).contiguous()).clamp_(max=ordered.shape[-1] - 1)
    found = ordered.gather(-1, at) == kept
    empty = kept < 0
    if not bool((found | empty).all()):
        raise RuntimeError(
            "replay: the inference cache kept a position the chunk did not attend; the recorded decisions do not fit "
            "this forward pass (was the model or the input changed between the passes?)"
        )
    return torch.where(empty, 0, order.gather(-1, at))


class ChunkStep(ForwardStep):
    """The attention of one chunk at positions ``[start, start + tokens)`` over per-layer states.

    ``states[l]``: layer ``l``'s ``ReplayState`` before the chunk (None: no slots yet). ``kept[l]``: the positions layer ``l``
    held after the chunk ``[B, Hkv, N']`` (None: the next state is not wanted). ``rules[l]``: the
    layer's visibility (``attention.Visibility``). After the forward pass, ``after[l]`` is the
    state after the chunk, built in the graph."""

    def __init__(self, start: int, tokens: int, states: list[ReplayState | None], kept: list[torch.Tensor | None], rules: list[Visibility]) -> None:
        self.start, self.tokens = start, tokens
        self.states, self.kept, self.rules = states, kept, rules
        self.after: list[ReplayState | None] = [None] * len(states)
        self.layers_run = 0

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:  # fmt: skip
        """``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, S, D|Dv]`` (rotary positions applied):
        the attention output ``[B, S, Hq, Dv]``."""
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < len(self.states):
            raise UnsupportedOperation(f"chunked training needs each attention module's layer_idx; {type(module).__name__} has {layer!r}")
        extras = AttentionExtras.from_kwargs(kwargs)
        if extras.sinks is not None or extras.bias is not None or extras.indices is not None:
            raise UnsupportedOperation("chunked training does not apply attention sinks, position biases or sparse indices yet")
        if getattr(module, "is_causal", True) is False:
            raise UnsupportedOperation("chunked training needs causal attention; this model's is not")
        batch, q_heads, tokens, dim = query.shape
        if tokens != self.tokens:
            raise UnsupportedOperation(f"the chunk has {self.tokens} tokens but layer {layer}'s attention got {tokens} queries")
        kv_heads = key.shape[1]
        state = self.states[layer]
        if state is None:  # nothing cached before this chunk
            state = empty_state(batch, kv_heads, key.shape[-1], value.shape[-1], key.dtype, key.device)
        if state.keys.shape[1] != kv_heads or state.keys.shape[0] != batch:
            raise UnsupportedOperation(
                f"layer {layer}'s state holds {list(state.keys.shape)} keys but its attention got {list(key.shape)}"
            )
        own = torch.arange(self.start, self.start + tokens, device=key.device)
        keys = torch.cat([state.keys.to(key.dtype), key], dim=2)
        values = torch.cat([state.values.to(value.dtype), value], dim=2)
        positions = torch.cat([state.positions, own.expand(batch, kv_heads, tokens)], dim=2)  # [B, Hkv, M]
        visible = self.rules[layer](own.view(-1, 1), positions.unsqueeze(2))  # [B, Hkv, S, M]
        group = q_heads // kv_heads
        # Query head h reads KV head h // group (transformers' repeat_kv): group the query rows per KV head.
        q = query.reshape(batch, kv_heads, group * tokens, dim)
        mask = visible.unsqueeze(2).expand(batch, kv_heads, group, tokens, visible.shape[-1]).reshape(batch, kv_heads, group * tokens, -1)
        scale = dim**-0.5 if scaling is None else float(scaling)
        if extras.softcap is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:
            scores = q @ keys.transpose(-1, -2) * scale
            scores = extras.softcap * torch.tanh(scores / extras.softcap)
            out = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ values
        kept = self.kept[layer]
        if kept is not None:
            index = gather_index(positions, kept)
            self.after[layer] = ReplayState(
                keys.gather(2, index.unsqueeze(-1).expand(*index.shape, keys.shape[-1])),
                values.gather(2, index.unsqueeze(-1).expand(*index.shape, values.shape[-1])),
                kept,
            )
        self.layers_run += 1
        return out.reshape(batch, q_heads, tokens, -1).transpose(1, 2)
