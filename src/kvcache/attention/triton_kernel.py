"""The Triton source of the decode kernel ``triton_decode.py`` launches: ``_decode`` (one program
per (sequence, KV head) pair and split of its tokens: an online softmax over tiles, its unnormalised
output with its running maximum and sum) and ``_merge`` (the splits merged by log-sum-exp).
``triton_decode.py`` documents the four ways in, their flags and the launch."""

from __future__ import annotations

from functools import cache

# Triton (the `triton` extra) is imported when the kernel is first compiled (``kernels``), not with
# kvcache: importing it costs a few tenths of a second that a CPU user should not pay. The kernel's
# body reads ``tl`` from these globals when Triton compiles it.
triton = None
tl = None


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
    BITS: tl.constexpr, FP8: tl.constexpr, KG: tl.constexpr, KB: tl.constexpr, VG: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_CAP: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr,
    EVEN: tl.constexpr, DOT: tl.constexpr, DOT_PV: tl.constexpr, KEY16: tl.constexpr, KROWS: tl.constexpr, VGROUPS: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head) pair, one split of its tokens: see the module docstring.

    ``KEY_CODES``: 0 float keys, 1 codes with a scale per channel over each block of ``KB`` tokens
    (paged: the pool's block), 2 codes with a scale per token and group of ``KG`` channels;
    ``VALUE_CODES``: 0 float, 2 per token in groups of ``VG``. Codes pack ``8 // BITS`` a byte,
    lowest bits first; ``FP8``: each byte (``BITS`` 8) an e4m3 float. ``HAS_TAIL``: keys from token ``CODED[s]`` and values from ``CODED_V[s]`` on
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
            byte = tl.load(K + k_at[:, None] + (d // PER)[None, :], mask=kmask, other=0)
            if FP8:
                code = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                code = ((byte.to(tl.int32) >> ((d % PER) * BITS)[None, :]) & LEVELS).to(tl.float32)
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
            vbyte = tl.load(V + v_at[:, None] + (dv // PER)[None, :], mask=vmask, other=0)
            if FP8:
                vcode = vbyte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                vcode = ((vbyte.to(tl.int32) >> ((dv % PER) * BITS)[None, :]) & LEVELS).to(tl.float32)
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
def kernels(interpret: bool):
    """``(_decode, _merge)`` compiled by ``triton.jit`` (per interpreter setting: the decorator reads
    it), Triton imported here the first time."""
    global triton, tl
    import triton
    import triton.language as tl

    return triton.jit(_decode), triton.jit(_merge)
