"""Prompt store keys: a hash chain over fixed-size chunks of a prompt's token ids.

``salt`` names everything a stored entry depends on besides the tokens: the model (its config
fingerprint), the dtype it computes in, the cache spec, the chunk size and the entry format. The
key of the prefix ending after chunk ``i`` is ``H(key of chunk i-1 || tokens of chunk i)``, with
``H(salt)`` before the first, so a key names one whole prefix under one salt: two models, two
dtypes or two cache kinds never share a key, and a chunk's key changes with anything before it.

Rows of a batch are keyed by their real tokens: ``generate`` numbers a left-padded row's
positions from its first real token (``attention_mask.cumsum(-1) - 1``), so those tokens' keys and
values are the ones an unpadded prompt computes, and the pads (masked out) are never keyed. A row
with a hole in its mask, or padding on the right, is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hf.prefill import check_token_ids

#: Version of the key scheme and entry format: a change makes every old entry a miss.
SCHEME = "kvcache-prompt/2"


def salt(fingerprint: str, dtype: torch.dtype, spec: str, chunk: int) -> bytes:
    """What a key depends on besides the tokens (JSON, so a field can never run into the next)."""
    fields = {"scheme": SCHEME, "model": fingerprint, "dtype": str(dtype).removeprefix("torch."), "spec": spec, "chunk": chunk}
    return json.dumps(fields, sort_keys=True).encode()


def chain(salt_bytes: bytes, tokens: Sequence[int], chunk: int, known: Sequence[str] = ()) -> list[str]:
    """Hex keys of the prefixes ``tokens[:chunk]``, ``tokens[:2 * chunk]``, ... (full chunks only).
    ``known``: the keys of the first chunks, already computed (a chain extended as tokens come):
    kept, and only the keys after them computed."""
    keys = list(known)
    digest = bytes.fromhex(keys[-1]) if keys else hashlib.sha256(salt_bytes).digest()
    ids = torch.as_tensor(list(tokens[len(keys) * chunk :]), dtype=torch.int64)  # only what is new
    for start in range(0, len(ids) - chunk + 1, chunk):
        digest = hashlib.sha256(digest + ids[start : start + chunk].numpy().tobytes()).digest()
        keys.append(digest.hex())
    return keys


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a batch: ``pad`` left pads, then its real ``tokens``."""

    pad: int
    tokens: list[int]


def rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[PromptRow]:
    """The rows of ``input_ids`` ``[B, T]`` without their left padding (``attention_mask`` ``[B, T']``,
    1 = a real token; ``T' <= T`` covers the prompt, the tokens after it count as real, as after
    ``generate``). Raises ``ValueError`` for anything but left padding."""
    check_token_ids(input_ids, "input_ids", "[B, T]")
    batch, width = input_ids.shape
    ids = input_ids.tolist()
    if attention_mask is None:
        return [PromptRow(0, row) for row in ids]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > width:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be [B, T'] with B = {batch} and T' <= {width} (the prompt's columns), got {got}")
    out = []
    for r, mask in enumerate(attention_mask.to(torch.long).tolist()):
        pad = next((i for i, m in enumerate(mask) if m != 0), len(mask))
        if any(m != 1 for m in mask[pad:]) or any(m != 0 for m in mask[:pad]):
            raise ValueError(
                f"attention_mask row {r} is not left padding (zeros, then ones): prompt reuse needs "
                "left-padded batches, as generate takes them for decoder-only models"
            )
        out.append(PromptRow(pad, ids[r][pad:]))
    return out

