"""The prefix keys of a pool's blocks: a hash chain over full blocks of tokens, and the checks of
keys, token ids and integer arguments the pool shares."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ..errors import PoolError
from ..prompts.keys import chain

#: A block's prefix key: what ``chain_keys`` returns (hex str), or any non-empty bytes or str.
Key = bytes | str


def chain_keys(tokens: Sequence[int] | torch.Tensor, block_size: int, salt: bytes | str) -> list[str]:
    """The prefix key of each full block of ``tokens`` (a sequence of ids or a 1-D integer tensor):
    ``key_i = SHA-256(key_{i-1} || int64 bytes of block i's tokens)``, ``key_{-1} = SHA-256(salt)``,
    as hex strings; a last partial block gets no key.

    This is the prompt store's chain (``kvcache.prompts.keys.chain``) with chunk = ``block_size``,
    so a key names the whole prefix up to the end of its block under one salt. ``salt`` must name
    everything the stored keys and values depend on besides the tokens (model, dtype, ...);
    ``kvcache.prompts.keys.salt`` makes one. A ``str`` salt is taken as its UTF-8 bytes.
    """
    block_size = integer("block_size", block_size)
    if block_size < 1:
        raise PoolError(f"block_size must be at least 1, got {block_size}")
    if isinstance(salt, str):
        salt = salt.encode()
    elif not isinstance(salt, bytes):
        raise PoolError(f"salt must be bytes or str, got {type(salt).__name__}")
    return chain(salt, token_ids(tokens), block_size)


def check_key(key: object) -> Key:
    if not isinstance(key, (bytes, str)) or not key:
        raise PoolError(f"a block key must be non-empty bytes or str, got {key!r}")
    return key


def token_ids(tokens: object) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise PoolError(f"tokens must be a 1-D integer tensor, got a {tokens.dim()}-D {tokens.dtype} tensor")
        tokens = tokens.tolist()
    try:
        ids = [integer("a token id", t) for t in tokens]
    except TypeError:
        raise PoolError(f"tokens must be a sequence of token ids, got {type(tokens).__name__}") from None
    bad = next((t for t in ids if not 0 <= t < 2**63), None)
    if bad is not None:
        raise PoolError(f"token ids must be non-negative 64-bit integers, got {bad}")
    return ids


def integer(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise PoolError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise PoolError(f"{name} must be an integer, got {type(value).__name__}") from None
