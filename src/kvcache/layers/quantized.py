"""int8/int4/int2 storage with a full-precision residual of recent tokens (KIVI, Liu et al., 2024);
fp8 (e4m3) codes in the same layout with ``codes="fp8"`` (``formats/fp8.py``).

Keys are quantized per channel over blocks of ``group_size`` tokens (keys have outlier channels,
so each channel gets its own range); values per token, in groups of ``group_size`` channels. Codes
of 4 and 2 bits are packed two and four per byte. The most recent ``residual`` tokens stay in full precision:
keys and values leave the residual together, a whole block of ``group_size`` once
``residual + group_size`` have gathered (so between ``residual`` and ``residual + group_size - 1``
recent tokens are exact), as KIVI's streaming quantization does. A decode step between two blocks
only writes its token into the residual, in place. A prompt's tail stays exact the same way.

Decode attention reads the store block by block (``block`` tokens at a time): the attention
kernel gets a ``BlockReader`` (``StoreReader``) that dequantizes one block into a small temporary
for the kernel to take its scores or its share of the output, so no full-precision copy of the
cache is ever built on a decode step. A plain decode step (no mask or weights asked for; sinks
the kernel adds from the step's log-sum-exp) goes further: ``StoreReader.decode_attention`` attends the codes in one pass of the coded library,
softmax included, and merges in the few tokens after them. A chunk longer than the
residual (a prefill) attends its own tokens in full precision, as Hugging Face's quantized cache
does, with the quantized past dequantized for that one pass.

Positions are in order (token ``p`` is column ``p``), so masks need no remapping. Trimming works
for tokens still in the residual; quantized tokens cannot be un-quantized into a rollback.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from ..attention import BlockReader, Reads, device_kernels, fused
from ..errors import UnsupportedOperation
from ..formats.quant import BITS
from .checks import Geometry
from .codes import CodedStore
from .options import Option
from .own_attention import OwnAttentionLayer
from .state import LayerState

#: What a code is: an integer (``bits`` wide) or an e4m3 float (8 bits).
CODES = ("int", "fp8")


class QuantizedLayer(OwnAttentionLayer):
    """The policy over a ``CodedStore`` (``codes.py``): when tokens leave the full-precision
    residual for the codes, and how attention reads them (``StoreReader``)."""

    kind = "quantized"
    exact = False  # type: ignore[assignment]
    spec_options = {
        "bits": Option(int), "group_size": Option(int, least=1), "residual": Option(int, least=0), "codes": Option(str),
    }  # fmt: skip
    keyword_options = {"block": Option(int, least=1)}
    spec_order = 3

    def __init__(
        self, bits: int | None = None, group_size: int = 64, residual: int = 32, block: int = 512, codes: str = "int"
    ) -> None:
        super().__init__()
        if codes not in CODES:
            raise ValueError(f"codes must be one of {CODES} (integer or e4m3 codes), got {codes!r}")
        if bits is None:
            bits = 8 if codes == "fp8" else 4
        if int(bits) not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if codes == "fp8" and int(bits) != 8:
            raise ValueError(f"fp8 codes are 8 bits; drop bits or give bits=8, got bits={bits}")
        checked = self.check_options(bits=bits, group_size=group_size, residual=residual, block=block)
        self.bits, self.group_size, self.residual = checked["bits"], checked["group_size"], checked["residual"]
        self.block = max(self.group_size, checked["block"] // self.group_size * self.group_size)
        self.fp8 = codes == "fp8"
        self.codes = CodedStore(self.bits, self.group_size, self.residual, fp8=self.fp8)
        self._viewed: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] | None = None
        self._viewed_at: tuple[int, int] | None = None  # (codes.version, seen) of _viewed
        self._reset_storage()

    def _reset_storage(self) -> None:
        self.codes.drop()
        self.geometry = None
        self._seen = 0

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def reallocations(self) -> int:
        """Allocations of the codes (keys and values grow together: one count)."""
        return self.codes.values.reallocations

    @property
    def value_group(self) -> int:
        return self.codes.value_group(self.geometry)

    @property
    def length(self) -> int:
        return self.seen

    @property
    def capacity(self) -> int:
        return self.codes.capacity

    @property
    def nbytes(self) -> int:
        """Codes, scales and minimums as allocated, plus the full-precision residual buffers."""
        return self.codes.nbytes

    def view(self):
        """The keys and values, dequantized: a full-precision copy (for inspection and tests)."""
        if self.geometry is None:
            return None, None
        return self.codes.dequantized(self.geometry, self.seen)

    def memo_view(self):
        """``view()``, dequantized once per change of content (``codes.version``) and only when read:
        ``HFLayer.keys``/``values`` read it. The copy lives until the next change."""
        at = (self.codes.version, self.seen)
        if self._viewed_at != at:
            self._viewed, self._viewed_at = self.view(), at
        return self._viewed

    def fork(self) -> QuantizedLayer:
        self._viewed, self._viewed_at = None, None  # not copied: a dequantized view is memory for nothing
        return super().fork()

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key, value):
        n, seen = key.shape[2], self.seen
        if self.geometry is None:
            self.codes.check_dims(key, value)
        copy = None
        if n > max(self.residual, 1):  # a chunk that attends itself in full precision, and the past as it is
            if seen:
                past_k, past_v = self.view()
                copy = (torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2))
            else:
                copy = (key, value)
        geometry = self.geometry or Geometry.of(key, value)
        plan = self._plan(key, value)  # quantizes (may raise); nothing stored yet
        if plan is None:  # no block leaves the residual: the tokens join it in place
            self.codes.extend(geometry, key, value)
        else:
            self.codes.write(geometry, plan.get("k"), plan.get("v"), plan["src_k"][:, :, plan["qk"] :], plan["src_v"][:, :, plan["qv"] :])
        self.geometry = geometry
        self._seen = seen + n
        if copy is not None:
            return Reads(copy[0], copy[1], None, seen, n)
        # The model gets the residual buffers (it only hands them back to the attention).
        returned = (self.codes.exact_keys, self.codes.exact_values)
        return Reads(StoreReader(self), None, None, seen, n, all_visible=n == 1, returned=returned)

    def _plan(self, key, value) -> dict[str, Any] | None:
        """Which tokens leave the residual for the codes, quantized: computed before anything
        changes; None when none leave."""
        G, R = self.group_size, self.residual
        ck, cv = self.seen - self.codes.quantized_keys, self.seen - self.codes.quantized_values
        n = key.shape[2]
        qk = max(0, (ck + n - R) // G * G)
        qv = max(0, (cv + n - R) // G * G)
        if not qk and not qv:
            return None
        src_k = key if not ck else torch.cat([self.codes.exact_keys[:, :, :ck], key], dim=2)
        src_v = value if not cv else torch.cat([self.codes.exact_values[:, :, :cv], value], dim=2)
        plan: dict[str, Any] = {"qk": qk, "qv": qv, "src_k": src_k, "src_v": src_v}
        if qk:
            b, h, _, d = src_k.shape
            blocks = src_k[:, :, :qk].reshape(b, h, qk // G, G, d)
            plan["k"] = self.codes.format.encode_keys(blocks)
        if qv:
            plan["v"] = self.codes.format.encode_values(src_v[:, :, :qv])
        return plan

    # ---- rollback and state ---------------------------------------------------------------

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        exact = self.seen - max(self.codes.quantized_keys, self.codes.quantized_values)
        if int(n) > exact:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a quantized layer: only the last {exact} are still in "
                f"full precision, and quantized tokens cannot be rolled back"
            )

    def _trim(self, n: int) -> None:
        # Only residual tokens (check_trim): the caller lowers seen.
        self.codes.trim_exact(n)

    def reset(self) -> None:
        super().reset()
        self._reset_storage()

    def _rebatch(self, fn) -> None:
        if self.codes.allocated:
            self.geometry = replace(self.geometry, batch=self.codes.rebatch(fn))

    def options(self) -> dict[str, Any]:
        options = {"bits": self.bits, "group_size": self.group_size, "residual": self.residual, "block": self.block}
        return {**options, "codes": "fp8"} if self.fp8 else options

    def state(self) -> LayerState:
        return LayerState(self.kind, self.options(), self.seen, self.codes.saved())

    def check_state(self, state: LayerState) -> None:
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        theirs = state.options.get("codes", "int")
        if theirs != ("fp8" if self.fp8 else "int"):  # the same shapes: only the options tell them apart
            raise ValueError(
                f"state holds {theirs} codes; this layer keeps {'fp8' if self.fp8 else 'int'} codes (its codes option)"
            )
        if not state.tensors:
            if int(state.seen):
                raise ValueError(f"quantized layer state holds no tokens but {state.seen} seen")
            return
        self.codes.check(state.tensors, int(state.seen))

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        if state.tensors:
            self.geometry = self.codes.load(state.tensors)
        self._seen = int(state.seen)


class StoreReader(BlockReader):
    """A quantized layer's store as the attention kernel reads it: ``block`` tokens of codes
    dequantized at a time, then the full-precision residual (see the module docstring)."""

    def __init__(self, layer: QuantizedLayer) -> None:
        self.layer = layer
        g, seen = layer.geometry, layer.seen
        self._shape = torch.Size((g.batch, g.heads, seen, g.key_dim))
        self._value_shape = torch.Size((g.batch, g.heads, seen, g.value_dim))

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def value_shape(self) -> torch.Size:
        return self._value_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.geometry.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.geometry.device

    def key_blocks(self) -> Iterator[torch.Tensor]:
        layer, codes = self.layer, self.layer.codes
        tk = codes.quantized_keys
        for start in range(0, tk, layer.block):
            yield codes.keys_block(layer.geometry, start, min(start + layer.block, tk))
        yield codes.exact_keys[:, :, : layer.seen - tk]

    def value_blocks(self) -> Iterator[torch.Tensor]:
        layer, codes = self.layer, self.layer.codes
        tv = codes.quantized_values
        for start in range(0, tv, layer.block):
            yield codes.values_block(layer.geometry, start, min(start + layer.block, tv))
        yield codes.exact_values[:, :, : layer.seen - tv]

    def decode_scores(self, query: torch.Tensor) -> torch.Tensor | None:
        """Scores float32 ``[B, Hkv, R, T]`` of scaled query rows ``[B, Hkv, R, D]``: the codes'
        straight from them (``attention.fused``), the residual's by a product; None when the
        fused path cannot run."""
        layer, codes = self.layer, self.layer.codes
        tk = codes.quantized_keys
        k = codes.keys.tensors  # whole buffers, read up to tk: not even a view is made of the codes
        scores = fused.key_scores(
            query, k["kcodes"], k["kscale"], k["kmin"], layer.bits, tk // layer.group_size, layer.seen, fp8=layer.fp8
        )
        if scores is not None and layer.seen > tk:
            exact = codes.exact_keys[:, :, : layer.seen - tk]
            scores[..., tk:] = torch.matmul(query, exact.transpose(-1, -2))
        return scores

    def decode_values(self, weights: torch.Tensor) -> torch.Tensor | None:
        """``weights @ values`` ``[B, Hkv, R, Dv]`` in the weights' dtype for weights ``[B, Hkv, R, T]``,
        the codes' share straight from them; None when the fused path cannot run."""
        layer, codes = self.layer, self.layer.codes
        tv = codes.quantized_values
        v = codes.values.tensors
        out = fused.weighted_values(
            weights[..., :tv], v["vcodes"], v["vscale"], v["vmin"], layer.bits, layer.value_group, fp8=layer.fp8
        )
        if out is None:
            return None
        if layer.seen > tv:
            out += torch.matmul(weights[..., tv:], codes.exact_values[:, :, : layer.seen - tv]).float()
        return out.to(weights.dtype)

    def decode_attention(
        self, query: torch.Tensor, scale: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's whole attention with no mask or weights (the kernel's ``route`` checks) of
        query rows ``[B, Hkv, R, D]``, scores ``scale * q . k`` capped by ``softcap``: ``(out, lse)``
        as ``BlockReader.decode_attention``, or None to decline (the library cannot run, or no token
        has both its key and its value coded).

        The tokens whose keys and values are both coded (whole key blocks) go through one library
        call (``fused.decode_attention``), the few exact ones after them in the same call (the
        residual; from a state saved before values left in blocks, values coded ahead of the keys
        too). Only a loaded state with coded keys ahead of its coded values sends its tail through
        PyTorch (``_tail_attention``), merged by log-sum-exp."""
        layer, codes = self.layer, self.layer.codes
        k, v = codes.keys.tensors, codes.values.tensors
        if k:  # a device that takes the whole step in one call (CUDA), residual included
            whole = device_kernels.quantized_decode(
                query, (k["kcodes"], k["kscale"], k["kmin"]), (v["vcodes"], v["vscale"], v["vmin"]), layer.bits,
                layer.value_group, codes.quantized_keys, codes.quantized_values, codes.exact_keys, codes.exact_values,
                layer.seen, scale, softcap, fp8=layer.fp8,
            )  # fmt: skip
            if whole is not None:
                return whole[0].to(query.dtype), whole[1]
        coded = self._both_coded()
        if coded == 0:
            return None
        keys, values = (k["kcodes"], k["kscale"], k["kmin"]), (v["vcodes"], v["vscale"], v["vmin"])
        blocks, tail = coded // layer.group_size, self._exact_tail(coded)
        if tail is not None:  # the usual case: the tail in the same library call
            whole = fused.decode_attention(
                query, keys, values, layer.bits, blocks, layer.value_group, scale, softcap, tail, fp8=layer.fp8
            )
            if whole is not None:
                return whole[0].to(query.dtype), whole[1]
        head = fused.decode_attention(
            query, keys, values, layer.bits, blocks, layer.value_group, scale, softcap, fp8=layer.fp8
        )
        if head is None:
            return None
        out, lse = head
        if layer.seen > coded:
            tail_out, tail_lse = self._tail_attention(query, coded, scale, softcap)
            out, lse = fused.merge_attention(out, lse, tail_out, tail_lse), torch.logaddexp(lse, tail_lse)
        return out.to(query.dtype), lse

    def _exact_tail(self, coded: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The tokens after the first ``coded`` as ``fused.decode_attention`` takes them in the same
        call: ``(exact keys, exact values after the coded ones, how many have coded values)``; None
        where their keys are not all exact (a loaded state) or nothing follows."""
        layer, codes = self.layer, self.layer.codes
        tk, tv, seen = codes.quantized_keys, codes.quantized_values, layer.seen
        if seen == coded or tk != coded or tv < coded:
            return None
        # (float32 as the library reads them: a half-precision layer's few exact tokens are widened)
        keys, values = codes.exact_keys.narrow(2, 0, seen - tk), codes.exact_values.narrow(2, 0, seen - tv)
        return keys.float(), values.float(), tv - coded

    def _both_coded(self) -> int:
        """How many first tokens have both their key and their value coded (whole key blocks)."""
        codes, group = self.layer.codes, self.layer.group_size
        return min(codes.quantized_keys, codes.quantized_values // group * group)

    def _tail_attention(
        self, query: torch.Tensor, start: int, scale: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of query rows ``[B, Hkv, R, D]`` over tokens ``start...`` (a block-aligned
        ``start``): the normalised output float32 ``[B, Hkv, R, Dv]`` and each row's log-sum-exp ``[B, Hkv, R]``."""
        keys, values = self._tail(start)
        scores = torch.matmul(query.float() * scale, keys.float().transpose(-1, -2))
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
        return out, lse

    def _tail(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, Hkv, seen - start, D]`` and values ``[B, Hkv, seen - start, Dv]`` of tokens
        ``start...`` (block-aligned) in full precision: codes dequantized where they are coded, the
        residual after them."""
        layer, codes = self.layer, self.layer.codes
        g, seen = layer.geometry, layer.seen
        tk, tv = codes.quantized_keys, codes.quantized_values
        keys = codes.exact_keys[:, :, : seen - tk]
        if tk > start:
            keys = torch.cat([codes.keys_block(g, start, tk), keys], dim=2)
        values = codes.exact_values[:, :, : seen - tv]
        if tv > start:
            values = torch.cat([codes.values_block(g, start, tv), values], dim=2)
        return keys, values
