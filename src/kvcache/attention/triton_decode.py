"""Decode attention in Triton, for CUDA tensors: one kernel for every decode path of the library.

A decode step attends a few query rows per KV head (the query heads of a group packed, times the
new tokens: ``R <= 16``) over a run of tokens. The run is read one of four ways, chosen by
compile-time flags of the one kernel (``triton_kernel.py``):

- ``decode_views``: keys and values as a cache's views ``[B, Hkv, T, D]`` (any strides but the
  last), with an optional key mask per batch row and a soft-cap;
- ``paged_decode``: float blocks ``[NB, Hkv, bs, D]`` read through each sequence's block table,
  ragged lengths;
- ``paged_coded_decode``: int8/int4/int2 or fp8 blocks (keys per channel over the block, values per
  token in groups) through block tables, then each sequence's exact open block (float32);
- ``token_coded_decode``: a store's per-token codes (an evicting layer's coded slots).

Codes are read straight from their bytes and dequantized in registers as ``quant.py`` does
(``code * scale + minimum`` in float32; fp8 codes, ``fp8=True``, are e4m3 bytes, as ``fp8.py``), so no step dequantizes a store. Every program takes one
(sequence, KV head) pair and one split of its tokens (split-K, so a long context of one sequence
still fills the GPU); it keeps an online softmax over tiles of ``Launch.block`` tokens and writes
its unnormalised output with its running maximum and sum, which a second kernel (``_merge``) merges
by log-sum-exp. A call is these two launches and no wait for the device: the callers bound the
longest run from shapes they know.

With ``TRITON_INTERPRET=1`` in the environment before Triton is first imported, the kernel runs in
Triton's interpreter on CPU tensors: how CI tests it here (``tests/conftest.py`` sets it).
Which calls come here is ``backends.py``'s choice (CUDA tensors, where Triton is installed).
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import NamedTuple

import torch

from .triton_kernel import kernels

#: Query rows per KV head the kernel takes (a decode step's group times its new tokens).
MAX_ROWS = 16


class Launch(NamedTuple):
    """How ``_decode`` is compiled and launched: tokens a tile (``block``), warps a program, software
    pipeline stages, and the precision of its two products (``tl.dot``'s ``input_precision``:
    ``"tf32x3"`` is three TF32 tensor-core products, about float32's accuracy; ``"ieee"`` float32
    on the CUDA cores, what the interpreter takes)."""

    block: int = 64
    warps: int = 4
    stages: int = 2
    dot: str = "tf32x3"


#: The launch each way in gets on a CUDA device: float tiles (views, float blocks) and coded tiles
#: (their scales and minimums take shared memory per pipeline stage: 3 stages of 64 tokens
#: overflow an H100's 227 KiB). ``tools/gpu_sweep.py`` measures the alternatives.
LAUNCH = {"float": Launch(), "coded": Launch(stages=1)}


@cache
def available() -> bool:
    """Whether Triton is installed (the ``triton`` extra)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pad(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, 1 << (max(int(n), 1) - 1).bit_length())


@cache
def _units(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the interpreter's CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _splits(pairs: int, longest: int, device: torch.device, block: int) -> tuple[int, int]:
    """``(splits, tokens a split)``: enough programs to fill the device (two waves of its
    multiprocessors), no split under 256 tokens; tokens a split a multiple of ``block``."""
    if longest <= 0:
        return 1, block
    splits = max(1, min(-(-2 * _units(device) // max(pairs, 1)), -(-longest // 256)))
    per = -(-longest // splits)
    per = -(-per // block) * block
    return -(-longest // per), per


def _fp8_ok(bits: int, device: torch.device) -> bool:
    """Whether e4m3 codes of ``bits`` can be read on ``device``: 8 bits, and Triton's e4m3 type
    (``float8e4nv``) converts there (the interpreter; CUDA from compute capability 8.9, Ada/Hopper)."""
    return bits == 8 and (device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _precision(q, keys, values, key_codes, value_codes, tail, launch) -> tuple[bool, str, str]:
    """``(KEY16, DOT, DOT_PV)``. Float keys in the query's 16-bit type are multiplied as they are
    (exact products; the interpreter, float16 only). Probabilities times 16-bit values take TF32 (the values exact in it, the
    probabilities rounded to 11 bits, finer than the 16-bit output they become). Every other
    product takes ``launch.dot`` (float32 caches and dequantized codes: ``tf32x3`` by default,
    about float32's accuracy). The interpreter takes ``ieee`` for all."""
    half = (torch.bfloat16, torch.float16)
    key16 = key_codes == 0 and not tail and keys.dtype in half and q.dtype == keys.dtype
    if interpreting():  # (it has no bfloat16 products: numpy has no bfloat16)
        return key16 and keys.dtype == torch.float16, "ieee", "ieee"
    dot_pv = "tf32" if value_codes == 0 and values.dtype in half and launch.dot != "ieee" else launch.dot
    return key16, launch.dot, dot_pv


def _run(q, rows, vdim, lengths, longest, *, keys, values, key_codes=0, value_codes=0, bits=8, fp8=False, key_group=1,
         value_group=1, key_block=1, key_scale=None, value_scale=None, paged=None, tail=None, keep=None, scale, softcap,
         launch=None):  # fmt: skip
    """Launch ``_decode`` over ``q`` ``[S, Hkv, R, D]`` and merge the splits: ``(out, lse)``, float32
    ``[S, Hkv, R, Dv]`` and ``[S, Hkv, R]``. ``longest``: a bound on ``lengths`` (int64 ``[S]``),
    known to the caller, so nothing waits for the device; ``keys``/``values``: ``(tensor,
    stride_seq, stride_head, stride_token)`` (for paged, stride_seq is per block);
    ``key_scale``/``value_scale``: ``(scale, minimum, stride_seq, stride_head, stride_token)``;
    ``paged``: ``(table int32 [S, W], block_size)``; ``tail``: ``(keys, values, blocks int32 [S],
    coded keys int64 [S], coded values int64 [S])``, lengths counting the tail; ``key_block``:
    tokens a key scale row spans (``key_codes`` 1); ``launch``: a ``Launch`` (default ``LAUNCH``'s)."""
    seqs, heads, _, dim = q.shape
    device = q.device
    if launch is None:
        launch = LAUNCH["coded" if key_codes or value_codes else "float"]
    R_PAD, D_PAD, DV_PAD = _pad(rows), _pad(dim), _pad(vdim)
    key16, dot, dot_pv = _precision(q, keys[0], values[0], key_codes, value_codes, tail is not None, launch)
    bs = paged[1] if paged is not None else 1
    spread = bs if paged is not None else key_block  # tokens a key scale row spans (key_codes 1)
    krows = launch.block // spread if key_codes == 1 and _power_of_two(spread) and spread <= launch.block else 0
    even = dim == D_PAD and vdim == DV_PAD
    vgroups = DV_PAD // value_group if value_codes and even and _power_of_two(value_group) and value_group <= DV_PAD else 0
    splits, per = _splits(seqs * heads, longest, device, launch.block)
    o = torch.empty(seqs * heads * splits, R_PAD, DV_PAD, dtype=torch.float32, device=device)
    m = torch.empty(seqs * heads * splits, R_PAD, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    out = torch.empty(seqs, heads, R_PAD, DV_PAD, dtype=torch.float32, device=device)
    lse = torch.empty(seqs, heads, R_PAD, dtype=torch.float32, device=device)
    if seqs:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        ks = key_scale or (dummy, dummy, 0, 0, 0)
        vs = value_scale or (dummy, dummy, 0, 0, 0)
        table = paged[0] if paged is not None else torch.empty(1, 1, dtype=torch.int32, device=device)
        flat4 = dummy.view(1, 1, 1, 1)
        tk, tv, tail_blocks, coded, coded_v = tail if tail is not None else (flat4, flat4, lengths, lengths, lengths)
        keep_t = keep if keep is not None else torch.empty(1, 1, dtype=torch.uint8, device=device)
        decode, merge = kernels(interpreting())
        decode[(seqs * heads, splits)](
            q, q.stride(0), q.stride(1), q.stride(2),
            keys[0], *keys[1:], ks[0], ks[1], *ks[2:],
            values[0], *values[1:], vs[0], vs[1], *vs[2:],
            tk, tv, tk.stride(0), tk.stride(1), tk.stride(2), tv.stride(0), tv.stride(1), tv.stride(2),
            tail_blocks, coded, coded_v, table, table.stride(0), lengths, keep_t, keep_t.stride(0),
            o, m, l_sum,
            heads, rows, dim, vdim, per, float(scale), float(softcap or 1.0),
            BS=bs, PAGED=paged is not None, KEY_CODES=key_codes, VALUE_CODES=value_codes, BITS=bits, FP8=fp8,
            KG=key_group, KB=key_block, VG=value_group, HAS_TAIL=tail is not None, HAS_KEEP=keep is not None,
            HAS_CAP=softcap is not None, R_PAD=R_PAD, D_PAD=D_PAD, DV_PAD=DV_PAD, BLOCK=launch.block,
            EVEN=even, DOT=dot, DOT_PV=dot_pv, KEY16=key16, KROWS=krows, VGROUPS=vgroups,
            num_warps=launch.warps, num_stages=launch.stages,
        )  # fmt: skip
        merge[(seqs * heads,)](o, m, l_sum, out, lse, splits, R_PAD=R_PAD, DV_PAD=DV_PAD)
    return out[:, :, :rows, :vdim], lse[:, :, :rows]


def _tensors_ok(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can read these: one device (CUDA, or the CPU under the interpreter), the
    last dim contiguous."""
    device = tensors[0].device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return False
    return all(t.device == device and (t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1) for t in tensors)


# ---- the four ways in ---------------------------------------------------------------------------


def decode_views(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None, softcap: float | None,
    scale: float, launch: Launch | None = None,
) -> torch.Tensor | None:
    """Query rows ``[B, Hkv, R, D]`` over keys ``[B, Hkv, T, D]`` and values ``[B, Hkv, T, Dv]``
    (views read in place; float32, bfloat16 or float16), keys where ``keep`` (bool ``[B, T]``) holds:
    the output float32 ``[B, Hkv, R, Dv]``, or None where the kernel cannot run."""
    batch, heads, rows, dim = query.shape
    if not available() or rows > MAX_ROWS or key.dim() != 4 or key.shape[:2] != (batch, heads):
        return None
    if not _tensors_ok(query, key, value) or (torch.is_grad_enabled() and query.requires_grad):
        return None
    length = key.shape[2]
    lengths = torch.full((batch,), length, dtype=torch.int64, device=query.device)
    keep_u8 = None if keep is None else keep.to(torch.uint8).expand(batch, length).contiguous()
    out, _ = _run(
        query, rows, value.shape[3], lengths, length, keys=(key, *key.stride()[:3]), values=(value, *value.stride()[:3]),
        keep=keep_u8, scale=scale, softcap=softcap, launch=launch,
    )
    return out


def paged_decode(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
    scale: float, launch: Launch | None = None,
) -> torch.Tensor | None:
    """Query rows ``[S, Hkv, R, D]`` over float blocks ``[NB, Hkv, bs, D]`` / ``[NB, Hkv, bs, Dv]``:
    sequence ``s`` reads its first ``lengths[s]`` tokens from blocks ``tables[s]`` (int32 ``[S, W]``).
    The output float32 ``[S, Hkv, R, Dv]`` (zeros for no tokens), or None."""
    seqs, heads, rows, dim = query.shape
    if not available() or rows > MAX_ROWS or not _tensors_ok(query, key_pool, value_pool):
        return None
    tables = tables.to(device=query.device, dtype=torch.int32).contiguous()
    lengths = lengths.to(device=query.device, dtype=torch.int64).contiguous()
    out, _ = _run(
        query, rows, value_pool.shape[3], lengths, tables.shape[1] * key_pool.shape[2], keys=(key_pool, key_pool.stride(0), key_pool.stride(1), key_pool.stride(2)),
        values=(value_pool, *value_pool.stride()[:3]), paged=(tables, key_pool.shape[2]), scale=scale, softcap=None, launch=launch,
    )
    return out


def paged_coded_decode(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, value_group: int, tables: torch.Tensor,
    coded: torch.Tensor, tail_keys: torch.Tensor, tail_values: torch.Tensor, tail_blocks: torch.Tensor,
    tail_lengths: torch.Tensor, scale: float, softcap: float | None = None, launch: Launch | None = None,
    fp8: bool = False,
) -> torch.Tensor | None:
    """``fused_paged.paged_decode_attention``'s step (same arguments and result) in Triton."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    seqs, heads, rows, dim = query.shape
    if fp8 and not _fp8_ok(bits, query.device):
        return None
    if not available() or rows > MAX_ROWS or not _tensors_ok(query, kcodes, vcodes, tail_keys, tail_values):
        return None
    if kscale.stride() != kmin.stride() or vscale.stride() != vmin.stride() or kscale.stride(-1) != 1 or vscale.stride(-1) != 1:
        return None
    device = query.device
    coded = coded.to(device=device, dtype=torch.int64)
    lengths = (coded + tail_lengths.to(device=device, dtype=torch.int64)).contiguous()
    tables = tables.to(device=device, dtype=torch.int32).contiguous()
    coded = coded.contiguous()
    tail = (tail_keys, tail_values, tail_blocks.to(device=device, dtype=torch.int32).contiguous(), coded, coded)
    longest = tables.shape[1] * kcodes.shape[2] + tail_keys.shape[2]
    out, _ = _run(
        query, rows, vcodes.shape[3] * 8 // bits, lengths, longest,
        keys=(kcodes, *kcodes.stride()[:3]), values=(vcodes, *vcodes.stride()[:3]), key_codes=1, value_codes=2,
        bits=bits, fp8=fp8, value_group=value_group, key_scale=(kscale, kmin, kscale.stride(0), kscale.stride(1), 0),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), paged=(tables, kcodes.shape[2]), tail=tail,
        scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip
    return out


def token_coded_decode(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, tokens: int, key_group: int, value_group: int,
    scale: float, softcap: float | None = None, launch: Launch | None = None, fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused.token_decode_attention``'s step (same arguments and result: ``(out, lse)``) in Triton."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    batch, heads, rows, dim = query.shape
    if fp8 and not _fp8_ok(bits, query.device):
        return None
    if not available() or rows > MAX_ROWS or tokens < 1 or not _tensors_ok(query, kcodes, vcodes, kscale, vscale):
        return None
    if kscale.stride() != kmin.stride() or vscale.stride() != vmin.stride():
        return None
    lengths = torch.full((batch,), int(tokens), dtype=torch.int64, device=query.device)
    return _run(
        query, rows, vcodes.shape[3] * 8 // bits, lengths, int(tokens),
        keys=(kcodes, *kcodes.stride()[:3]), values=(vcodes, *vcodes.stride()[:3]), key_codes=2, value_codes=2,
        bits=bits, fp8=fp8, key_group=key_group, value_group=value_group, key_scale=(kscale, kmin, *kscale.stride()[:3]),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip


def quantized_decode(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, value_group: int, coded_keys: int,
    coded_values: int, exact_keys: torch.Tensor, exact_values: torch.Tensor, seen: int, scale: float,
    softcap: float | None = None, launch: Launch | None = None, fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A quantized layer's decode step over all ``seen`` tokens in one call: its key blocks
    (codes ``[B, Hkv, n, G, D']``, scale and minimum ``[B, Hkv, n, D]``) up to ``coded_keys``, its
    value codes (``[B, Hkv, C, Dv']``, groups of ``value_group``) up to ``coded_values``, and the
    exact residual after each (``exact_keys`` ``[B, Hkv, r, D]`` from ``coded_keys``,
    ``exact_values`` from ``coded_values``). ``(out, lse)``: the output float32 ``[B, Hkv, R, Dv]``
    and each row's log-sum-exp ``[B, Hkv, R]``; or None."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    batch, heads, rows, dim = query.shape
    if not available() or rows > MAX_ROWS or seen < 1 or kcodes.dim() != 5 or (fp8 and not _fp8_ok(bits, query.device)):
        return None
    if not _tensors_ok(query, kcodes, vcodes, kscale, vscale, exact_keys, exact_values):
        return None
    if kscale.stride() != kmin.stride() or vscale.stride() != vmin.stride() or kcodes.stride(2) != kcodes.shape[3] * kcodes.stride(3):
        return None
    device, group = query.device, kcodes.shape[3]
    flat_codes = kcodes.flatten(2, 3)  # [B, Hkv, n * G, D']: a view (checked above)
    lengths = torch.full((batch,), int(seen), dtype=torch.int64, device=device)
    rows_of = torch.arange(batch, dtype=torch.int32, device=device)
    tail = (exact_keys, exact_values, rows_of, torch.full_like(lengths, int(coded_keys)), torch.full_like(lengths, int(coded_values)))
    return _run(
        query, rows, vcodes.shape[3] * 8 // bits, lengths, int(seen),
        keys=(flat_codes, *flat_codes.stride()[:3]), values=(vcodes, *vcodes.stride()[:3]), key_codes=1, value_codes=2,
        bits=bits, fp8=fp8, key_block=group, value_group=value_group, key_scale=(kscale, kmin, *kscale.stride()[:3]),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), tail=tail, scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip
