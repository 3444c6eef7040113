"""Decode attention in Triton, for CUDA tensors: one kernel for every decode path of the library.

A decode step attends a few query rows per KV head (the query heads of a group packed, times the
new tokens: ``R <= 16``) over a run of tokens. The run is read one of four ways, chosen by
compile-time flags of the one kernel (``_decode``):

- ``decode_views``: keys and values as a cache's views ``[B, Hkv, T, D]`` (any strides but the
  last), with an optional key mask per batch row and a soft-cap;
- ``paged_decode``: float blocks ``[NB, Hkv, bs, D]`` read through each sequence's block table,
  ragged lengths;
- ``paged_coded_decode``: int8/int4/int2 blocks (keys per channel over the block, values per token
  in groups) through block tables, then each sequence's exact open block (float32);
- ``token_coded_decode``: a store's per-token codes (an evicting layer's coded slots).

Codes are read straight from their bytes and dequantized in registers as ``quant.py`` does
(``code * scale + minimum`` in float32), so no step dequantizes a store. Every program takes one
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

# Triton (the `triton` extra) is imported when the kernel is first compiled (``_kernel``), not with
# kvcache: importing it costs a few tenths of a second that a CPU user should not pay. The kernel's
# body reads ``tl`` from these globals when Triton compiles it.
triton = None
tl = None

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


def _decode(
    Q, sq_s, sq_h, sq_r,
    K, sk_s, sk_h, sk_t,
    KS, KM, sks_s, sks_h, sks_t,
    V, sv_s, sv_h, sv_t,
    VS, VM, svs_s, svs_h, svs_t,
    TK, TV, stk_n, stk_h, stk_t, stv_n, stv_h, stv_t,
    TAIL_BLOCK, CODED, CODED_V, TABLE, stab_s, LENGTHS, KEEP, skeep_s,
    O, M, L,
    heads, rows, dim, vdim, split_tokens, scale, softcap,
    BS: tl.constexpr, PAGED: tl.constexpr, KEY_CODES: tl.constexpr, VALUE_CODES: tl.constexpr,
    BITS: tl.constexpr, KG: tl.constexpr, KB: tl.constexpr, VG: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_CAP: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr,
    EVEN: tl.constexpr, DOT: tl.constexpr, DOT_PV: tl.constexpr, KEY16: tl.constexpr, KROWS: tl.constexpr, VGROUPS: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head) pair, one split of its tokens: see the module docstring.

    ``KEY_CODES``: 0 float keys, 1 codes with a scale per channel over each block of ``KB`` tokens
    (paged: the pool's block), 2 codes with a scale per token and group of ``KG`` channels;
    ``VALUE_CODES``: 0 float, 2 per token in groups of ``VG``. Codes pack ``8 // BITS`` a byte,
    lowest bits first. ``HAS_TAIL``: keys from token ``CODED[s]`` and values from ``CODED_V[s]`` on
    are exact, in tail block ``TAIL_BLOCK[s]`` of ``TK``/``TV`` from its slot 0. ``EVEN``: the dims
    are their padded sizes, so loads are masked by token only (and vectorise along the dim).
    ``KEY16``: float keys and the query in one 16-bit type, multiplied as they are. ``DOT``/``DOT_PV``:
    the precision of the other products (see ``_precision``). ``KROWS`` > 0: a tile spans that many
    key scale rows whole (read once, not once a token); ``VGROUPS`` > 0: a token's value scales read
    as a row of that many groups (``0``: the general gathers)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    s = pid // heads
    h = pid % heads
    length = tl.load(LENGTHS + s)
    start = split * split_tokens
    stop = tl.minimum(start + split_tokens, length)
    r = tl.arange(0, R_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + s * sq_s + h * sq_h + r[:, None] * sq_r + d[None, :], mask=(r[:, None] < rows) & (d[None, :] < dim), other=0.0)
    q16 = q
    q = q.to(tl.float32)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    coded = length
    coded_v = length
    tail = 0
    if HAS_TAIL:
        coded = tl.load(CODED + s)
        coded_v = tl.load(CODED_V + s)
        tail = tl.load(TAIL_BLOCK + s)
    for t0 in range(start, stop, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live = t < stop
        stored = live & (t < coded)
        stored_v = live & (t < coded_v)
        if PAGED:
            block = tl.load(TABLE + s * stab_s + t // BS, mask=stored, other=0).to(tl.int64)
            slot = t % BS
            k_at = block * sk_s + h * sk_h + slot * sk_t
            v_at = block * sv_s + h * sv_h + slot * sv_t
            ks_at = block * sks_s + h * sks_h + slot * sks_t
            vs_at = block * svs_s + h * svs_h + slot * svs_t
        else:
            k_at = s * sk_s + h * sk_h + t * sk_t
            v_at = s * sv_s + h * sv_h + t * sv_t
            ks_at = s * sks_s + h * sks_h + t * sks_t
            vs_at = s * svs_s + h * svs_h + t * svs_t
            block = t  # unused
        if EVEN:
            kmask = stored[:, None]
            vmask = stored_v[:, None]
        else:
            kmask = stored[:, None] & (d[None, :] < dim)
            vmask = stored_v[:, None] & (dv[None, :] < vdim)
        if KEY_CODES == 0:
            k = tl.load(K + k_at[:, None] + d[None, :], mask=kmask, other=0.0)
            if not KEY16:
                k = k.to(tl.float32)
        else:
            byte = tl.load(K + k_at[:, None] + (d // PER)[None, :], mask=kmask, other=0).to(tl.int32)
            code = ((byte >> ((d % PER) * BITS)[None, :]) & LEVELS).to(tl.float32)
            if KEY_CODES == 1 and KROWS > 0:  # the tile's scale rows (KROWS of them), each spread over its tokens
                rb = t0 // (BLOCK // KROWS) + tl.arange(0, KROWS)
                rlive = rb * (BLOCK // KROWS) < tl.minimum(stop, coded)
                if PAGED:
                    row_at = tl.load(TABLE + s * stab_s + rb, mask=rlive, other=0).to(tl.int64) * sks_s + h * sks_h
                else:
                    row_at = s * sks_s + h * sks_h + rb * sks_t
                k_scale = tl.load(KS + row_at[:, None] + d[None, :], mask=rlive[:, None] & (d[None, :] < dim), other=0.0)
                k_min = tl.load(KM + row_at[:, None] + d[None, :], mask=rlive[:, None] & (d[None, :] < dim), other=0.0)
                k = code.reshape(KROWS, BLOCK // KROWS, D_PAD) * k_scale[:, None, :] + k_min[:, None, :]
                k = k.reshape(BLOCK, D_PAD)
            else:
                if KEY_CODES == 1:  # per channel over a block: one scale row a block
                    if PAGED:
                        sc_at = (block * sks_s + h * sks_h)[:, None] + d[None, :]
                    else:
                        sc_at = (s * sks_s + h * sks_h + (t // KB) * sks_t)[:, None] + d[None, :]
                else:
                    sc_at = ks_at[:, None] + (d // KG)[None, :]
                k_scale = tl.load(KS + sc_at, mask=kmask, other=0.0).to(tl.float32)
                k_min = tl.load(KM + sc_at, mask=kmask, other=0.0).to(tl.float32)
                k = code * k_scale + k_min
        if VALUE_CODES == 0:
            v = tl.load(V + v_at[:, None] + dv[None, :], mask=vmask, other=0.0).to(tl.float32)
        else:
            vbyte = tl.load(V + v_at[:, None] + (dv // PER)[None, :], mask=vmask, other=0).to(tl.int32)
            vcode = ((vbyte >> ((dv % PER) * BITS)[None, :]) & LEVELS).to(tl.float32)
            if VGROUPS > 0:  # a token's VGROUPS scales, each spread over its group of channels
                g = tl.arange(0, VGROUPS)
                vsc_at = vs_at[:, None] + g[None, :]
                v_scale = tl.load(VS + vsc_at, mask=stored_v[:, None], other=0.0)
                v_min = tl.load(VM + vsc_at, mask=stored_v[:, None], other=0.0)
                v = vcode.reshape(BLOCK, VGROUPS, DV_PAD // VGROUPS) * v_scale[:, :, None] + v_min[:, :, None]
                v = v.reshape(BLOCK, DV_PAD)
            else:
                vsc_at = vs_at[:, None] + (dv // VG)[None, :]
                v = vcode * tl.load(VS + vsc_at, mask=vmask, other=0.0).to(tl.float32) + tl.load(VM + vsc_at, mask=vmask, other=0.0).to(tl.float32)
        if HAS_TAIL:  # the exact tokens after the coded ones (an open block, a layer's residual)
            open_k = live & (t >= coded)
            open_v = live & (t >= coded_v)
            ok = t - coded
            ov = t - coded_v
            if EVEN:
                tkmask = open_k[:, None]
                tvmask = open_v[:, None]
            else:
                tkmask = open_k[:, None] & (d[None, :] < dim)
                tvmask = open_v[:, None] & (dv[None, :] < vdim)
            tk = tl.load(TK + tail * stk_n + h * stk_h + ok[:, None] * stk_t + d[None, :], mask=tkmask, other=0.0)
            tv = tl.load(TV + tail * stv_n + h * stv_h + ov[:, None] * stv_t + dv[None, :], mask=tvmask, other=0.0)
            k = tl.where(open_k[:, None], tk.to(tl.float32), k)
            v = tl.where(open_v[:, None], tv.to(tl.float32), v)
        if KEY16:  # 16-bit keys and query: exact products, summed in float32
            scores = tl.dot(q16, tl.trans(k)) * scale  # [R_PAD, BLOCK]
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
        if HAS_CAP:  # softcap * tanh(score / softcap), tanh through exp (no libdevice in the interpreter)
            x = scores / softcap
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        valid = live
        if HAS_KEEP:
            valid = valid & (tl.load(KEEP + s * skeep_s + t, mask=live, other=0) != 0)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PV)
        m_i = m_new
    part = pid * n_splits + split
    tl.store(O + part * R_PAD * DV_PAD + r[:, None] * DV_PAD + dv[None, :], acc)
    tl.store(M + part * R_PAD + r, m_i)
    tl.store(L + part * R_PAD + r, l_i)


def _merge(O, M, L, OUT, LSE, n_splits, R_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    """One (sequence, KV head) pair: its splits' partial outputs merged by log-sum-exp into
    ``OUT`` ``[R_PAD, DV_PAD]`` and ``LSE`` ``[R_PAD]``; a row that saw no key gets zeros and -inf."""
    pid = tl.program_id(0)
    r = tl.arange(0, R_PAD)
    dv = tl.arange(0, DV_PAD)
    top = tl.full([R_PAD], float("-inf"), tl.float32)
    total = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    for i in range(n_splits):
        part = pid * n_splits + i
        m = tl.load(M + part * R_PAD + r)
        top_new = tl.maximum(top, m)
        safe = tl.where(top_new == float("-inf"), 0.0, top_new)
        old = tl.exp(top - safe)
        new = tl.exp(m - safe)
        total = total * old + tl.load(L + part * R_PAD + r) * new
        acc = acc * old[:, None] + tl.load(O + part * R_PAD * DV_PAD + r[:, None] * DV_PAD + dv[None, :]) * new[:, None]
        top = top_new
    seen = total > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    tl.store(OUT + pid * R_PAD * DV_PAD + r[:, None] * DV_PAD + dv[None, :], out)
    tl.store(LSE + pid * R_PAD + r, tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf")))


@cache
def _kernels(interpret: bool):
    """``(_decode, _merge)`` compiled by ``triton.jit`` (per interpreter setting: the decorator reads
    it), Triton imported here the first time."""
    global triton, tl
    import triton
    import triton.language as tl

    return triton.jit(_decode), triton.jit(_merge)


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


def _run(q, rows, vdim, lengths, longest, *, keys, values, key_codes=0, value_codes=0, bits=8, key_group=1,
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
        decode, merge = _kernels(interpreting())
        decode[(seqs * heads, splits)](
            q, q.stride(0), q.stride(1), q.stride(2),
            keys[0], *keys[1:], ks[0], ks[1], *ks[2:],
            values[0], *values[1:], vs[0], vs[1], *vs[2:],
            tk, tv, tk.stride(0), tk.stride(1), tk.stride(2), tv.stride(0), tv.stride(1), tv.stride(2),
            tail_blocks, coded, coded_v, table, table.stride(0), lengths, keep_t, keep_t.stride(0),
            o, m, l_sum,
            heads, rows, dim, vdim, per, float(scale), float(softcap or 1.0),
            BS=bs, PAGED=paged is not None, KEY_CODES=key_codes, VALUE_CODES=value_codes, BITS=bits,
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
) -> torch.Tensor | None:
    """``fused_paged.paged_decode_attention``'s step (same arguments and result) in Triton."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    seqs, heads, rows, dim = query.shape
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
        bits=bits, value_group=value_group, key_scale=(kscale, kmin, kscale.stride(0), kscale.stride(1), 0),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), paged=(tables, kcodes.shape[2]), tail=tail,
        scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip
    return out


def token_coded_decode(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, tokens: int, key_group: int, value_group: int,
    scale: float, softcap: float | None = None, launch: Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused.token_decode_attention``'s step (same arguments and result: ``(out, lse)``) in Triton."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    batch, heads, rows, dim = query.shape
    if not available() or rows > MAX_ROWS or tokens < 1 or not _tensors_ok(query, kcodes, vcodes, kscale, vscale):
        return None
    if kscale.stride() != kmin.stride() or vscale.stride() != vmin.stride():
        return None
    lengths = torch.full((batch,), int(tokens), dtype=torch.int64, device=query.device)
    return _run(
        query, rows, vcodes.shape[3] * 8 // bits, lengths, int(tokens),
        keys=(kcodes, *kcodes.stride()[:3]), values=(vcodes, *vcodes.stride()[:3]), key_codes=2, value_codes=2,
        bits=bits, key_group=key_group, value_group=value_group, key_scale=(kscale, kmin, *kscale.stride()[:3]),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip


def quantized_decode(
    query: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bits: int, value_group: int, coded_keys: int,
    coded_values: int, exact_keys: torch.Tensor, exact_values: torch.Tensor, seen: int, scale: float,
    softcap: float | None = None, launch: Launch | None = None,
) -> torch.Tensor | None:
    """A quantized layer's decode step over all ``seen`` tokens in one call: its key blocks
    (codes ``[B, Hkv, n, G, D']``, scale and minimum ``[B, Hkv, n, D]``) up to ``coded_keys``, its
    value codes (``[B, Hkv, C, Dv']``, groups of ``value_group``) up to ``coded_values``, and the
    exact residual after each (``exact_keys`` ``[B, Hkv, r, D]`` from ``coded_keys``,
    ``exact_values`` from ``coded_values``). The output float32 ``[B, Hkv, R, Dv]``, or None."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    batch, heads, rows, dim = query.shape
    if not available() or rows > MAX_ROWS or seen < 1 or kcodes.dim() != 5:
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
    out, _ = _run(
        query, rows, vcodes.shape[3] * 8 // bits, lengths, int(seen),
        keys=(flat_codes, *flat_codes.stride()[:3]), values=(vcodes, *vcodes.stride()[:3]), key_codes=1, value_codes=2,
        bits=bits, key_block=group, value_group=value_group, key_scale=(kscale, kmin, *kscale.stride()[:3]),
        value_scale=(vscale, vmin, *vscale.stride()[:3]), tail=tail, scale=scale, softcap=softcap, launch=launch,
    )  # fmt: skip
    return out
