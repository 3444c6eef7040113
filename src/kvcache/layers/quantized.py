"""int8/int4/int2 storage with a full-precision residual of recent tokens (KIVI, Liu et al., 2024).

Keys are quantized per channel over blocks of ``group_size`` tokens (keys have outlier channels,
so each channel gets its own range); values per token, in groups of ``group_size`` channels. Codes
of 4 and 2 bits are packed two and four per byte. The most recent ``residual`` tokens stay in full precision:
values leave the residual one token at a time, keys a whole block of ``group_size`` once
``residual + group_size`` have gathered (so between ``residual`` and ``residual + group_size - 1``
recent keys are exact). A prompt's tail stays exact the same way.

Decode attention reads the store block by block (``block`` tokens at a time): it dequantizes one
block into a small temporary, takes its scores or its share of the output, and moves on, so no
full-precision copy of the cache is ever built on a decode step. A chunk longer than the
residual (a prefill) attends its own tokens in full precision, as Hugging Face's quantized cache
does, with the quantized past dequantized for that one pass.

Positions are in order (token ``p`` is column ``p``), so masks need no remapping. Trimming works
for tokens still in the residual; quantized tokens cannot be un-quantized into a rollback.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..attention import group_heads, group_sinks, softmax
from ..errors import ShapeError, UnsupportedOperation
from ..quant import BITS, Quantized, dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
from ..registry import Option
from .base import Geometry, LayerState, check_kv
from .bounded import AttentionSet, BoundedLayer

#: Tensors of the quantized store, each ``[B, Hkv, slots, ...]``; keys' scale/minimum have one slot a block.
_STORE = ("kcodes", "kscale", "kmin", "vcodes", "vscale", "vmin")


class QuantizedLayer(BoundedLayer):
    kind = "quantized"
    spec_options = {"bits": Option(int), "group_size": Option(int, least=1), "residual": Option(int, least=0)}
    spec_order = 3

    def __init__(self, bits: int = 4, group_size: int = 64, residual: int = 32, block: int = 512) -> None:
        super().__init__()
        if int(bits) not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if int(group_size) < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if int(residual) < 0:
            raise ValueError(f"residual must be >= 0 tokens, got {residual}")
        self.bits, self.group_size, self.residual = int(bits), int(group_size), int(residual)
        self.block = max(self.group_size, int(block) // self.group_size * self.group_size)
        self._reset_storage()

    def _reset_storage(self) -> None:
        self._q: dict[str, torch.Tensor] | None = None
        self._rk: torch.Tensor | None = None  # [B, Hkv, residual + group_size, D]
        self._rv: torch.Tensor | None = None  # [B, Hkv, max(residual, 1), Dv]
        self._tk = 0  # quantized keys (a multiple of group_size)
        self._tv = 0  # quantized values
        self._reads_store = False  # whether the pending queries attend the store (else a full-precision copy)
        self.geometry = None
        self._seen = 0

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def value_group(self) -> int:
        return min(self.group_size, self.geometry.value_dim) if self.geometry else self.group_size

    @property
    def length(self) -> int:
        return self.seen

    @property
    def capacity(self) -> int:
        return 0 if self._q is None else self._q["kcodes"].shape[2] + self._rk.shape[2]

    @property
    def nbytes(self) -> int:
        """Codes, scales and minimums as allocated, plus the full-precision residual buffers."""
        if self._q is None:
            return 0
        return sum(t.nbytes for t in self._q.values()) + self._rk.nbytes + self._rv.nbytes

    def view(self):
        """The keys and values, dequantized: a full-precision copy (for inspection and tests)."""
        if self.geometry is None:
            return None, None
        return self._dequantized()

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self._keys_block(0, self._tk), self._rk[:, :, : self.seen - self._tk]], dim=2)
        values = torch.cat([self._values_block(0, self._tv), self._rv[:, :, : self.seen - self._tv]], dim=2)
        return keys, values

    # ---- reading blocks of the store -------------------------------------------------------

    def _keys_block(self, start: int, stop: int) -> torch.Tensor:
        """Dequantized keys of positions ``start:stop`` (block-aligned), ``[B, Hkv, stop - start, D]``."""
        g, q, G = self.geometry, self._q, self.group_size
        blocks = (stop - start) // G
        codes = q["kcodes"][:, :, start:stop].reshape(g.batch, g.heads, blocks, G, q["kcodes"].shape[-1])
        scale = q["kscale"][:, :, start // G : stop // G].unsqueeze(3)
        minimum = q["kmin"][:, :, start // G : stop // G].unsqueeze(3)
        out = dequantize_per_channel(Quantized(codes, scale, minimum, self.bits), g.dtype)
        return out.reshape(g.batch, g.heads, stop - start, g.key_dim)

    def _values_block(self, start: int, stop: int) -> torch.Tensor:
        q = self._q
        part = Quantized(q["vcodes"][:, :, start:stop], q["vscale"][:, :, start:stop], q["vmin"][:, :, start:stop], self.bits)
        return dequantize_per_token(part, self.value_group, self.geometry.dtype)

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key, value):
        n, seen = key.shape[2], self.seen
        if self.geometry is None:
            self._check_dims(key, value)
        copy = None
        if n > max(self.residual, 1):  # a chunk that attends itself in full precision, and the past as it is
            if seen:
                past_k, past_v = self._dequantized()
                copy = (torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2))
            else:
                copy = (key, value)
        plan = self._plan(key, value)  # quantizes (may raise); nothing stored yet
        self._commit(plan, key, value)
        self._seen = seen + n
        self._reads_store = copy is None
        if copy is not None:
            pending = AttentionSet(copy[0], copy[1], torch.arange(seen + n, device=key.device), seen)
        else:
            pending = AttentionSet(self._rk, self._rv, torch.empty(0), seen, all_visible=n == 1)
        return self._set_pending(pending, n)

    def _check_dims(self, key, value) -> None:
        d, dv, G = key.shape[3], value.shape[3], self.group_size
        per_byte = 8 // self.bits
        if d % per_byte or dv % per_byte:
            raise ShapeError(
                f"{self.bits}-bit storage packs {per_byte} codes a byte: head dims must be multiples of "
                f"{per_byte}, got {d} and {dv}"
            )
        if dv % min(G, dv):
            raise ShapeError(f"value head dim {dv} is not a multiple of group_size {G}")

    def _plan(self, key, value) -> dict[str, Any]:
        """Which tokens leave the residual for the store, quantized: computed before anything changes."""
        G, R = self.group_size, self.residual
        ck, cv = self.seen - self._tk, self.seen - self._tv
        n = key.shape[2]
        qk = max(0, (ck + n - R) // G * G)
        qv = max(0, cv + n - R)
        src_k = key if not ck else torch.cat([self._rk[:, :, :ck], key], dim=2)
        src_v = value if not cv else torch.cat([self._rv[:, :, :cv], value], dim=2)
        plan: dict[str, Any] = {"qk": qk, "qv": qv, "src_k": src_k, "src_v": src_v}
        if qk:
            b, h, _, d = src_k.shape
            blocks = src_k[:, :, :qk].reshape(b, h, qk // G, G, d)
            plan["k"] = quantize_per_channel(blocks, self.bits)
        if qv:
            plan["v"] = quantize_per_token(src_v[:, :, :qv], self.bits, min(G, value.shape[3]))
        return plan

    def _commit(self, plan: dict[str, Any], key, value) -> None:
        if self._q is None:
            self.geometry = Geometry.of(key, value)
            self._allocate_store(0)
            g = self.geometry
            self._rk = key.new_empty(g.batch, g.heads, self.residual + self.group_size, g.key_dim)
            self._rv = value.new_empty(g.batch, g.heads, max(self.residual, 1), g.value_dim)
        qk, qv = plan["qk"], plan["qv"]
        self._ensure_store(self._tk + qk, self._tv + qv)
        G, q = self.group_size, self._q
        if qk:
            k = plan["k"]
            q["kcodes"][:, :, self._tk : self._tk + qk].copy_(k.codes.flatten(2, 3))
            q["kscale"][:, :, self._tk // G : (self._tk + qk) // G].copy_(k.scale.squeeze(3))
            q["kmin"][:, :, self._tk // G : (self._tk + qk) // G].copy_(k.minimum.squeeze(3))
        if qv:
            v = plan["v"]
            q["vcodes"][:, :, self._tv : self._tv + qv].copy_(v.codes)
            q["vscale"][:, :, self._tv : self._tv + qv].copy_(v.scale)
            q["vmin"][:, :, self._tv : self._tv + qv].copy_(v.minimum)
        rest_k, rest_v = plan["src_k"][:, :, qk:], plan["src_v"][:, :, qv:]
        self._rk[:, :, : rest_k.shape[2]].copy_(rest_k)
        self._rv[:, :, : rest_v.shape[2]].copy_(rest_v)
        self._tk += qk
        self._tv += qv

    def _allocate_store(self, tokens: int) -> None:
        """(Re)allocate the quantized store for ``tokens`` (a multiple of group_size), keeping its content."""
        g, G = self.geometry, self.group_size
        shapes = self._store_shapes(g, tokens, tokens)
        new = {name: torch.empty(shape, dtype=dtype, device=g.device) for name, (shape, dtype) in shapes.items()}
        if self._q is not None:
            used = {"kcodes": self._tk, "kscale": self._tk // G, "kmin": self._tk // G}
            for name, t in new.items():
                keep = used.get(name, self._tv)
                t[:, :, :keep].copy_(self._q[name][:, :, :keep])
        self._q = new
        self.reallocations += 1

    def _store_shapes(self, g: Geometry, tk: int, tv: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each store tensor holding ``tk`` quantized keys and ``tv`` values."""
        G, b, h = self.group_size, g.batch, g.heads
        groups = g.value_dim // min(G, g.value_dim)
        return {
            "kcodes": ((b, h, tk, g.key_dim * self.bits // 8), torch.uint8),
            "kscale": ((b, h, tk // G, g.key_dim), g.dtype),
            "kmin": ((b, h, tk // G, g.key_dim), g.dtype),
            "vcodes": ((b, h, tv, g.value_dim * self.bits // 8), torch.uint8),
            "vscale": ((b, h, tv, groups), g.dtype),
            "vmin": ((b, h, tv, groups), g.dtype),
        }

    def _ensure_store(self, tk: int, tv: int) -> None:
        have = self._q["kcodes"].shape[2]
        need = max(tk, tv)
        if need <= have:
            return
        G = self.group_size
        grown = max(need, have + have // 4)  # a quarter more: the store is the bulk of the memory
        self._allocate_store(math.ceil(grown / G) * G)

    # ---- attention --------------------------------------------------------------------------

    def _attend_pending(self, query, pending, scale, softcap, mask, sinks):
        if not self._reads_store:  # a full-precision copy
            return super()._attend_pending(query, pending, scale, softcap, mask, sinks)
        return self._attend_store(query, pending.first_query, scale, softcap, mask, sinks), None

    def _attend_store(self, query, first_query, scale, softcap, mask, sinks=None) -> torch.Tensor:
        """Attention of queries at ``first_query...`` over the store, one block at a time."""
        g = self.geometry
        b, hq, n, d = query.shape
        group = hq // g.heads
        rows = group * n
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        q_t = (query * scale).reshape(b, g.heads, rows, d).transpose(-1, -2)  # [B, Hkv, D, rows]
        parts = [self._keys_block(s, min(s + self.block, self._tk)) @ q_t for s in range(0, self._tk, self.block)]
        parts.append(self._rk[:, :, : self.seen - self._tk] @ q_t)
        scores = torch.cat(parts, dim=2).transpose(-1, -2)  # [B, Hkv, rows, T]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(b, g.heads, group, n, self.seen)
        masked = mask is not None or n > 1
        if mask is not None:
            m = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
            while m.dim() < 4:
                m = m.unsqueeze(0)
            scores = scores.masked_fill(~group_heads(m[..., : self.seen], g.heads), -math.inf)
        if n > 1:
            q_pos = torch.arange(first_query, first_query + n, device=query.device).view(-1, 1)
            scores = scores.masked_fill(torch.arange(self.seen, device=query.device) > q_pos, -math.inf)
        probs = softmax(scores, group_sinks(sinks, g.heads, group))
        if masked:
            probs = probs.nan_to_num(0.0)
        probs = probs.to(g.dtype).reshape(b, g.heads, rows, self.seen)
        out = probs[..., self._tv :] @ self._rv[:, :, : self.seen - self._tv]
        for s in range(0, self._tv, self.block):
            stop = min(s + self.block, self._tv)
            out = out + probs[..., s:stop] @ self._values_block(s, stop)
        return out.view(b, g.heads, group, n, g.value_dim).reshape(b, hq, n, g.value_dim)

    # ---- rollback and state ---------------------------------------------------------------

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        exact = self.seen - max(self._tk, self._tv)
        if int(n) > exact:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a quantized layer: only the last {exact} are still in "
                f"full precision, and quantized tokens cannot be rolled back"
            )

    def _trim(self, n: int) -> None:
        pass  # the residual's counts follow seen, which the caller lowers

    def reset(self) -> None:
        super().reset()
        self._reset_storage()

    def _rebatch(self, fn) -> None:
        if self._q is None:
            return
        g = self.geometry
        q = {name: fn(t) for name, t in self._q.items()}
        rk, rv = fn(self._rk), fn(self._rv)
        self._q, self._rk, self._rv = q, rk, rv
        self.geometry = Geometry(rk.shape[0], g.heads, g.key_dim, g.value_dim, g.dtype, g.device)

    def options(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "residual": self.residual, "block": self.block}

    def state(self) -> LayerState:
        tensors: dict[str, torch.Tensor] = {}
        if self._q is not None:
            G = self.group_size
            used = {"kcodes": self._tk, "kscale": self._tk // G, "kmin": self._tk // G}
            tensors = {name: t[:, :, : used.get(name, self._tv)] for name, t in self._q.items()}
            tensors["residual_keys"] = self._rk[:, :, : self.seen - self._tk]
            tensors["residual_values"] = self._rv[:, :, : self.seen - self._tv]
        return LayerState(self.kind, self.options(), self.seen, tensors)

    def check_state(self, state: LayerState) -> None:
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        t = state.tensors
        if not t:
            if int(state.seen):
                raise ValueError(f"quantized layer state holds no tokens but {state.seen} seen")
            return
        missing = [name for name in (*_STORE, "residual_keys", "residual_values") if name not in t]
        if missing:
            raise ValueError(f"quantized layer state lacks {missing}")
        rk, rv = t["residual_keys"], t["residual_values"]
        # Residual keys and values differ in length (keys leave it a block at a time): only
        # [batch, heads] and the dtype must agree.
        check_kv(rk[:, :, :0], rv[:, :, :0], None) if rk.dim() == rv.dim() == 4 else check_kv(rk, rv, None)
        self._check_dims(rk, rv)
        if any(t[name].dim() != 4 for name in _STORE):
            raise ShapeError(f"quantized layer state: {', '.join(f'{n} {tuple(t[n].shape)}' for n in _STORE)} must be 4-D")
        tk, tv = t["kcodes"].shape[2], t["vcodes"].shape[2]
        seen = int(state.seen)
        if tk % self.group_size or tk + rk.shape[2] != seen or tv + rv.shape[2] != seen:
            raise ValueError(
                f"quantized layer state is inconsistent: {tk} quantized + {rk.shape[2]} "
                f"residual keys, {tv} + {rv.shape[2]} values, {seen} tokens seen"
            )
        if rk.shape[2] >= self.residual + self.group_size or rv.shape[2] > self.residual:
            raise ValueError(
                f"quantized layer state keeps {rk.shape[2]} keys and {rv.shape[2]} values in full precision; "
                f"residual {self.residual} with group size {self.group_size} keeps at most "
                f"{self.residual + self.group_size - 1} and {self.residual}"
            )
        for name, (shape, dtype) in self._store_shapes(Geometry.of(rk, rv), tk, tv).items():
            if tuple(t[name].shape) != shape or t[name].dtype != dtype:
                raise ShapeError(
                    f"quantized layer state: {name!r} should be {dtype} of shape {shape}, "
                    f"got {t[name].dtype} of shape {tuple(t[name].shape)}"
                )

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        t = state.tensors
        if t:
            rk, rv = t["residual_keys"], t["residual_values"]
            self.geometry = Geometry.of(rk, rv)
            g = self.geometry
            tk, tv = t["kcodes"].shape[2], t["vcodes"].shape[2]
            self._allocate_store(math.ceil(max(tk, tv) / self.group_size) * self.group_size)
            G = self.group_size
            used = {"kcodes": tk, "kscale": tk // G, "kmin": tk // G}
            for name in _STORE:
                self._q[name][:, :, : used.get(name, tv)].copy_(t[name])
            self._rk = rk.new_empty(g.batch, g.heads, self.residual + G, g.key_dim)
            self._rv = rv.new_empty(g.batch, g.heads, max(self.residual, 1), g.value_dim)
            self._rk[:, :, : rk.shape[2]].copy_(rk)
            self._rv[:, :, : rv.shape[2]].copy_(rv)
            self._tk, self._tv = tk, tv
        self._seen = int(state.seen)
