"""The coded decode library's pass over a pool of coded blocks (``fused.py`` says how it reads codes):
a decode step of many sequences, each read through its block table, each with an exact tail block.
The engine's step over a coded pool (``engine/block_io.py``) calls it."""

from __future__ import annotations

import torch

from .fused import fits, inner_contiguous, library, same_strides

#: Key blocks a task of ``paged_decode_attention`` takes, in tokens (a sequence's blocks are split
#: into runs of about this many, so one long sequence still spreads over the threads).
_PAGED_TASK_TOKENS = 256


def paged_decode_attention(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bits: int,
    value_group: int,
    tables: torch.Tensor,
    coded: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_blocks: torch.Tensor,
    tail_lengths: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    fp8: bool = False,
) -> torch.Tensor | None:
    """A decode step of ``S`` sequences over a pool of coded blocks, in one library call: the
    normalised attention output float32 ``[S, Hkv, R, Dv]`` of query rows ``[S, Hkv, R, D]`` (the rows
    of each KV head's group packed), scores ``scale * q . k`` (capped as ``softcap * tanh(score /
    softcap)`` when ``softcap`` is given).

    ``keys``: codes uint8 ``[NB, Hkv, bs, D * bits / 8]``, scale and minimum ``[NB, Hkv, D]`` (per
    channel over each block's ``bs`` tokens); ``values``: codes ``[NB, Hkv, bs, Dv * bits / 8]``, scale
    and minimum ``[NB, Hkv, bs, Dv / value_group]`` (per token). Sequence ``s`` attends, in order, its
    ``coded[s]`` (int64 ``[S]``, a multiple of ``bs``) coded tokens from blocks ``tables[s, 0],
    tables[s, 1], ...`` (int32 ``[S, W]``), then ``tail_lengths[s]`` (int64 ``[S]``, ``0..bs``) exact
    tokens from block ``tail_blocks[s]`` (int32 ``[S]``, ignored for an empty tail) of the float32
    pools ``tail_keys`` ``[NT, Hkv, bs, D]`` and ``tail_values`` ``[NT, Hkv, bs, Dv]`` (last dims
    contiguous). A sequence with no tokens gets zeros. ``fp8``: the codes are e4m3 bytes (``bits`` 8).

    None: see the module docstring (also for tail pools of another dtype or layout). Raises
    ``ValueError`` for a length, block id or tail block outside the table or the pools."""
    if not _paged_fits(query, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths):
        return None
    if fp8 and bits != 8:
        return None
    lib = library(fp8)
    if lib is None:
        return None
    seqs, heads, rows, dim = query.shape
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    pool_blocks, _, block_size, _ = kcodes.shape
    vdim = tail_values.shape[3]
    out = torch.empty(seqs, heads, rows, vdim, dtype=torch.float32)
    if seqs == 0:
        return out
    q = query.detach().float().contiguous()
    kcodes, vcodes = inner_contiguous(kcodes), inner_contiguous(vcodes)
    kscale, kmin = same_strides(kscale, kmin)
    vscale, vmin = same_strides(vscale, vmin)
    table = tables.to(torch.int32).contiguous()
    coded = coded.to(torch.int64).contiguous()
    tail_blocks, tail_lengths = tail_blocks.to(torch.int32).contiguous(), tail_lengths.to(torch.int64).contiguous()
    per_task = max(1, _PAGED_TASK_TOKENS // block_size)
    tk, tv = tail_keys.stride(), tail_values.stride()
    failed = lib.kv_paged_coded_decode(
        q.data_ptr(), kcodes.data_ptr(), kscale.data_ptr(), kmin.data_ptr(),
        vcodes.data_ptr(), vscale.data_ptr(), vmin.data_ptr(), tail_keys.data_ptr(), tail_values.data_ptr(),
        table.data_ptr(), coded.data_ptr(), tail_blocks.data_ptr(), tail_lengths.data_ptr(), out.data_ptr(),
        seqs, heads, rows, dim, vdim, block_size, value_group, bits, pool_blocks, tail_keys.shape[0], table.shape[1],
        kcodes.stride(0), kcodes.stride(1), kscale.stride(0), kscale.stride(1),
        vcodes.stride(0), vcodes.stride(1), vscale.stride(0), vscale.stride(1),
        tk[0], tk[1], tk[2], tv[0], tv[1], tv[2],
        per_task, float(scale), float(softcap or 0.0), torch.get_num_threads(),
    )  # fmt: skip
    if failed == 2:
        raise ValueError(
            f"paged coded decode: a sequence's coded length (a multiple of the block size {block_size}, within "
            f"its table of {table.shape[1]}), block id (below {pool_blocks}), tail length (0..{block_size}) or "
            f"tail block (below {tail_keys.shape[0]}) is out of range"
        )
    return None if failed else out


def _paged_fits(query, keys, values, bits, value_group, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths) -> bool:
    """Whether ``paged_decode_attention`` can take these shapes (see its docstring) in the library."""
    kcodes, kscale, kmin = keys
    vcodes, vscale, vmin = values
    tensors = (query, kcodes, kscale, kmin, vcodes, vscale, vmin, tables, coded, tail_keys, tail_values, tail_blocks, tail_lengths)
    if query.dim() != 4 or kcodes.dim() != 4 or vcodes.dim() != 4 or bits not in (8, 4, 2):
        return False
    seqs, heads, rows, dim = query.shape
    blocks, block_size = kcodes.shape[0], kcodes.shape[2]
    vdim = vcodes.shape[3] * 8 // bits
    return (
        all(t.device.type == "cpu" for t in tensors)
        and fits(rows, max(dim, vdim), bits, query.device)
        and kcodes.dtype == vcodes.dtype == torch.uint8
        and block_size >= 1
        and kcodes.shape == (blocks, heads, block_size, dim * bits // 8)
        and dim % (8 // bits) == 0
        and kscale.shape == kmin.shape == (blocks, heads, dim)
        and vcodes.shape[:3] == (blocks, heads, block_size)
        and value_group >= 1
        and value_group % (8 // bits) == 0
        and vdim % value_group == 0
        and vscale.shape == vmin.shape == (blocks, heads, block_size, vdim // value_group)
        and tail_keys.dtype == tail_values.dtype == torch.float32
        and tail_keys.dim() == tail_values.dim() == 4
        and tail_keys.shape == (tail_keys.shape[0], heads, block_size, dim)
        and tail_values.shape == (tail_keys.shape[0], heads, block_size, vdim)
        and tail_keys.stride(3) == 1
        and tail_values.stride(3) == 1
        and tables.dim() == 2
        and tables.shape[0] == seqs
        and coded.shape == tail_blocks.shape == tail_lengths.shape == (seqs,)
        and not (torch.is_grad_enabled() and query.requires_grad)  # the library computes no gradients
    )
