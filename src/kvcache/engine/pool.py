"""The block pool of a paged KV cache: fixed-size blocks of slots, reference counted, with prefix
caching by hash chain (the bookkeeping of PagedAttention with automatic prefix caching).

The tensors are the pool's ``storage``, a ``formats.BlockStorage`` in one format (full precision,
or int8/int4/int2 codes with an open block per running sequence), allocated once (``nbytes``) and
never grown; this module decides only which blocks are whose. A sequence holds a block table (a
list of block ids); its token ``t`` lies in block ``table[t // block_size]``, slot
``t % block_size`` (in a coded pool, the tokens of its unfilled last block lie in its open block).

Every block is in exactly one of three sets:

- **free**: refcount 0, no key; handed out first by ``allocate``;
- **cached**: refcount 0 with a key (a full block of a known prefix); ``lookup`` revives it,
  ``allocate`` evicts one when the free blocks do not suffice;
- **owned**: refcount > 0, with or without a key.

Eviction is a segmented LRU. A block a ``lookup`` found since it was allocated is *reused*; cached
blocks wait in two LRUs, least recently released first: the reused ones, and the others, which
``allocate`` evicts first. So a stream of prompts nobody repeats (each request's own tail) cannot
flush the prefixes many requests share, as it does under one LRU. The reused LRU holds at most
``protect`` of the pool's blocks; past that its oldest block moves to the newest end of the other
LRU and stops counting as reused, so prefixes that fell out of use do not keep the pool forever.

A registered (keyed) block is immutable; a shared one (refcount > 1) is read-only: a sequence that
must write into it copies it first (``copy_block``, copy-on-write). The pool notes which slots of
each block every layer has written since the block was allocated, so ``register`` takes only full
blocks. A call that raises changes nothing. Not thread-safe: one scheduler drives a pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from ..errors import PoolError, ShapeError
from ..formats import BlockStorage, Format, FullPrecision
from ..formats.blocks import flat
from .block_keys import Key, check_key, integer


class BlockPool:
    """``blocks`` blocks of ``block_size`` slots for ``layers`` layers of ``kv_heads`` heads: the
    bookkeeping here, the tensors in ``storage`` (a ``formats.BlockStorage`` of ``format``).

    Keys are ``head_dim`` wide, values ``value_dim`` (default ``head_dim``). ``dtype`` is the
    model's: what ``write`` takes and ``gather`` returns. ``format`` (default full precision in
    ``dtype``) is how the blocks keep them; a format that codes keys over a whole block (``Codes``
    with ``key_block=block_size``) needs ``tails`` open blocks, float32, one per running sequence
    (``take_tail``): a sequence's unfilled last block lies there until it fills and is coded whole.
    ``protect`` in [0, 1]: the share of the blocks the reused LRU may hold (0: one plain LRU).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        blocks: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        value_dim: int | None = None,
        *,
        format: Format | None = None,
        tails: int = 0,
        protect: float = 0.5,
    ):
        self.layers = _count("layers", layers, least=1)
        self.kv_heads = _count("kv_heads", kv_heads, least=1)
        self.head_dim = _count("head_dim", head_dim, least=1)
        self.block_size = _count("block_size", block_size, least=1)
        self.total = _count("blocks", blocks, least=1)
        self.value_dim = self.head_dim if value_dim is None else _count("value_dim", value_dim, least=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise PoolError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise PoolError(f"device must name a torch device, got {device!r}: {e}") from None
        if not isinstance(protect, (int, float)) or isinstance(protect, bool) or not 0 <= protect <= 1:
            raise PoolError(f"protect must be a share of the blocks in [0, 1], got {protect!r}")
        self.protect = float(protect)
        self.dtype = dtype
        format = FullPrecision(dtype) if format is None else format
        whole = format.key_block > 1
        self.tail_count = _count("tails", tails, least=1 if whole else 0)
        if tails and not whole:
            raise PoolError(f"open blocks are for formats that code a block whole; {format.name} blocks take single slots")
        block = (self.kv_heads, self.block_size, self.head_dim, self.value_dim)
        try:
            #: Scales of coded blocks, and open blocks, are float32 whatever the model's dtype.
            self.storage = BlockStorage(format, self.layers, self.total, *block, dtype if format.exact else torch.float32, device)
            self.open = (
                BlockStorage(FullPrecision(torch.float32), self.layers, self.tail_count, *block, torch.float32, device)
                if whole else None
            )
        except (ShapeError, ValueError) as e:
            raise PoolError(f"a pool of {format.name} blocks cannot hold these shapes: {e}") from None
        self.device = self.storage.device
        self._free_tails = list(range(self.tail_count - 1, -1, -1))

        self._refs = [0] * self.total
        self._free = list(range(self.total - 1, -1, -1))  # a stack: the lowest ids go out first
        # Cached blocks, least recently released first: not reused (evicted first), and reused.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._reused_lru: OrderedDict[int, None] = OrderedDict()
        self._reused = [False] * self.total  # found by a lookup since allocated
        self._reused_limit = int(self.protect * self.total)
        self._key_of: dict[int, Key] = {}
        self._block_of: dict[Key, int] = {}
        # Per layer, per block: a bit mask of the slots written since the block was allocated.
        self._written = [[0] * self.total for _ in range(self.layers)]

    @property
    def format(self) -> Format:
        return self.storage.format

    @property
    def exact(self) -> bool:
        """Whether the blocks hold keys and values as computed (full precision), so a prompt store's
        entries, a bounded request's prompt and a probe may stand in them; a coded pool's do not."""
        return self.format.exact

    @property
    def open_blocks(self) -> bool:
        """Whether each running sequence holds an open block of its own (``take_tail``)."""
        return self.open is not None

    # ---- sizes and counts -----------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks and the open blocks, all allocated at construction."""
        return self.storage.nbytes + (self.open.nbytes if self.open is not None else 0)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over every layer (keys and values, codes with their scales)."""
        return self.storage.block_nbytes

    @property
    def tail_nbytes(self) -> int:
        """Bytes of one open block over every layer (0 without open blocks)."""
        return self.open.block_nbytes if self.open is not None else 0

    @property
    def free_tails(self) -> int:
        return len(self._free_tails)

    def take_tail(self) -> int:
        """An open block for a sequence's unfilled last block (its content undefined until written)."""
        if not self._free_tails:
            raise PoolError(f"all {self.tail_count} open blocks are taken (one per running sequence)")
        return self._free_tails.pop()

    def give_tail(self, tail: int) -> None:
        if isinstance(tail, bool) or not isinstance(tail, int) or not 0 <= tail < self.tail_count or tail in self._free_tails:
            raise PoolError(f"open block {tail!r} is not taken")
        self._free_tails.append(tail)

    @property
    def free_count(self) -> int:
        """Blocks with refcount 0 and no key."""
        return len(self._free)

    @property
    def cached_count(self) -> int:
        """Blocks with refcount 0 and a key (in an LRU, revivable by ``lookup``)."""
        return len(self._lru) + len(self._reused_lru)

    @property
    def owned_count(self) -> int:
        """Blocks with refcount > 0."""
        return self.total - len(self._free) - self.cached_count

    @property
    def available(self) -> int:
        """What ``allocate`` can hand out: free blocks, then cached ones by eviction."""
        return len(self._free) + self.cached_count

    def refcount(self, block: int) -> int:
        return self._refs[self._block(block)]

    def key(self, block: int) -> Key | None:
        """The key ``block`` is registered under, or None."""
        return self._key_of.get(self._block(block))

    # ---- references -----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with refcount 1, no key and no slot written: free blocks first, then
        cached blocks evicted least recently released first, those never reused before the reused
        ones (their keys stop hitting)."""
        n = _count("n", n, least=0)
        if n > self.available:
            raise PoolError(
                f"cannot allocate {n} blocks: {self.available} free of {self.total} "
                f"({len(self._free)} free, {self.cached_count} cached, {self.owned_count} owned)"
            )
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(out) < n:
            block, _ = (self._lru or self._reused_lru).popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            out.append(block)
        for block in out:
            self._refs[block] = 1
            self._reused[block] = False
            for written in self._written:
                written[block] = 0
        return out

    def retain(self, block: int) -> None:
        """One more reference to an owned block (a second sequence sharing it)."""
        block = self._owned(block, "retain")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """One reference less; at 0 a keyed block goes to the newest end of its LRU (the reused one,
        or the other), any other to the free list."""
        block = self._owned(block, "release")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block not in self._key_of:
                self._free.append(block)
            elif not self._reused[block]:
                self._lru[block] = None
            else:
                self._reused_lru[block] = None
                if len(self._reused_lru) > self._reused_limit:
                    oldest, _ = self._reused_lru.popitem(last=False)
                    self._reused[oldest] = False
                    self._lru[oldest] = None

    def forget_cached(self) -> int:
        """Free every cached block and drop its key (owned blocks keep theirs); how many were freed."""
        cached = [*self._lru, *self._reused_lru]
        for block in cached:
            del self._block_of[self._key_of.pop(block)]
            self._reused[block] = False
        self._free.extend(cached)
        self._lru.clear(), self._reused_lru.clear()
        return len(cached)

    # ---- prefix caching -------------------------------------------------------------------------

    def register(self, block: int, key: Key) -> int:
        """Mark the owned, full ``block`` (every slot written in every layer) as holding the prefix
        ``key``; from now on it is immutable. Returns the block that holds ``key``: ``block``, or
        the one already registered under it (then nothing changes and no reference is taken: the
        caller may ``lookup(key)`` to share it and release its duplicate)."""
        block = self._owned(block, "register")
        key = check_key(key)
        full = (1 << self.block_size) - 1
        unfilled = [layer for layer in range(self.layers) if self._written[layer][block] != full]
        if unfilled:
            raise PoolError(
                f"cannot register block {block}: only full blocks hold a prefix, and layer {unfilled[0]} "
                f"has {self._written[unfilled[0]][block].bit_count()} of {self.block_size} slots written"
            )
        holder = self._block_of.get(key)
        if holder is not None:
            return holder
        if block in self._key_of:
            raise PoolError(f"cannot register block {block} under {key!r}: it already holds {self._key_of[block]!r}")
        self._key_of[block] = key
        self._block_of[key] = block
        return block

    def lookup(self, key: Key) -> int | None:
        """The block registered under ``key``, with one more reference (a cached block leaves its
        LRU), now reused; or None."""
        block = self._block_of.get(check_key(key))
        if block is None:
            return None
        if self._refs[block] == 0:
            del (self._reused_lru if self._reused[block] else self._lru)[block]
        self._reused[block] = True
        self._refs[block] += 1
        return block

    def keys(self) -> tuple[Key, ...]:
        """The keys of every registered block, owned or cached: the prefixes this pool holds. (One
        copy made without releasing the GIL, so another thread may call it while the engine steps.)"""
        return tuple(self._block_of)

    # ---- contents -------------------------------------------------------------------------------

    def writable(self, block: int) -> bool:
        """Whether ``write`` may change ``block``: owned by exactly one reference and unregistered."""
        block = self._block(block)
        return self._refs[block] == 1 and block not in self._key_of

    def write(self, layer: int, block: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``n`` slots from ``offset`` of ``block`` in ``layer``: ``keys`` ``[Hkv, n, D]`` and
        ``values`` ``[Hkv, n, Dv]`` (a leading batch of one, ``[1, Hkv, n, D]``, is taken too), in the
        pool's dtype and device. Refused for a free, cached, shared or registered block, for slots
        past the block's end, and, where the format codes a block whole, for anything but the
        whole block."""
        layer = self._layer(layer)
        block = self._block(block)
        self._check_writable(block)
        keys = self._slots("keys", keys, self.head_dim)
        values = self._slots("values", values, self.value_dim)
        n = keys.shape[1]
        if values.shape[1] != n:
            raise PoolError(f"keys hold {n} slots but values hold {values.shape[1]}")
        offset = _count("offset", offset, least=0)
        if offset + n > self.block_size:
            raise PoolError(f"slots [{offset}, {offset + n}) overflow a block of {self.block_size} slots")
        index = torch.tensor([block], device=self.device)
        if self.storage.format.key_block > 1:
            if offset != 0 or n != self.block_size:
                raise PoolError(
                    f"a {self.format.name} block is written whole: offset 0 and {self.block_size} slots, got offset "
                    f"{offset} and {n} slots"
                )
            self.storage.write_blocks(layer, index, keys[None], values[None])
        else:
            at = torch.arange(offset, offset + n, device=self.device)
            self.storage.write_slots(layer, index.expand(n), at, keys.transpose(0, 1), values.transpose(0, 1))
        self._written[layer][block] |= ((1 << n) - 1) << offset

    def claim(self, block: int, offset: int, n: int) -> None:
        """Note slots ``[offset, offset + n)`` of ``block`` as written in every layer, checking that
        ``block`` is writable, before a caller writes them itself through ``storage`` (the engine's forward pass writes all
        layers of a step that way)."""
        block = self._block(block)
        self._check_writable(block)
        offset, n = _count("offset", offset, least=0), _count("n", n, least=0)
        if offset + n > self.block_size:
            raise PoolError(f"slots [{offset}, {offset + n}) overflow a block of {self.block_size} slots")
        bits = ((1 << n) - 1) << offset
        for written in self._written:
            written[block] |= bits

    def copy_block(self, src: int) -> int:
        """A newly allocated block (refcount 1, unregistered) holding ``src``'s slots in every layer:
        copy-on-write of a shared or registered block. ``src`` must be owned."""
        src = self._owned(src, "copy")
        (dst,) = self.allocate(1)
        self.storage.copy(dst, src)
        for written in self._written:
            written[dst] = written[src]
        return dst

    def gather(self, layer: int, block_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys ``[Hkv, n * block_size, D]`` and values ``[Hkv, n * block_size, Dv]`` of the
        owned blocks ``block_ids`` in order, gathered into new contiguous tensors."""
        layer = self._layer(layer)
        ids = [self._owned(block, "read") for block in block_ids]
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        keys, values = self.storage.read_blocks(layer, index)
        return flat(keys).to(self.dtype), flat(values).to(self.dtype)

    # ---- invariants -----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``PoolError`` naming the first broken invariant of the bookkeeping."""
        refs, free, lru, reused_lru = self._refs, self._free, list(self._lru), list(self._reused_lru)
        if len(refs) != self.total:
            _broken(f"{len(refs)} refcounts for {self.total} blocks")
        negative = next((b for b, r in enumerate(refs) if r < 0), None)
        if negative is not None:
            _broken(f"block {negative} has refcount {refs[negative]}")
        seen: dict[int, str] = {}
        for where, blocks in (("free list", free), ("cached LRU", lru), ("reused LRU", reused_lru)):
            for block in blocks:
                if not 0 <= block < self.total:
                    _broken(f"the {where} holds {block}, not a block id")
                if block in seen:
                    _broken(f"block {block} is in the {seen[block]} and the {where}")
                seen[block] = where
                if refs[block] != 0:
                    _broken(f"block {block} in the {where} has refcount {refs[block]}")
                if (where != "free list") != (block in self._key_of):
                    _broken(f"block {block} in the {where} {'has' if block in self._key_of else 'has no'} key")
        if len(reused_lru) > self._reused_limit:
            _broken(f"the reused LRU holds {len(reused_lru)} blocks, over its {self._reused_limit}")
        mismarked = next((b for b in lru + reused_lru if self._reused[b] != (b in self._reused_lru)), None)
        if mismarked is not None:
            _broken(f"block {mismarked} is {'not ' * (not self._reused[mismarked])}marked reused but is in the "
                    f"{'reused' if mismarked in self._reused_lru else 'cached'} LRU")  # fmt: skip
        unplaced = next((b for b, r in enumerate(refs) if r == 0 and b not in seen), None)
        if unplaced is not None:
            _broken(f"block {unplaced} has refcount 0 but is neither free nor cached")
        if len(self._block_of) != len(self._key_of):
            _broken(f"{len(self._block_of)} keys map to blocks but {len(self._key_of)} blocks have keys")
        for key, block in self._block_of.items():
            if not 0 <= block < self.total or self._key_of.get(block) != key:
                _broken(f"key {key!r} maps to block {block}, which holds {self._key_of.get(block)!r}")
        full = (1 << self.block_size) - 1
        for block in self._key_of:
            if any(written[block] != full for written in self._written):
                _broken(f"registered block {block} is not full in every layer")
        if self.free_count + self.cached_count + sum(r > 0 for r in refs) != self.total:
            _broken("free + cached + owned blocks do not add up to the total")

    # ---- helpers --------------------------------------------------------------------------------

    def _block(self, block: object) -> int:
        block = integer("block", block)
        if not 0 <= block < self.total:
            raise PoolError(f"block {block} is not a block of this pool (0 to {self.total - 1})")
        return block

    def _layer(self, layer: object) -> int:
        layer = integer("layer", layer)
        if not 0 <= layer < self.layers:
            raise PoolError(f"layer {layer} is not a layer of this pool (0 to {self.layers - 1})")
        return layer

    def _owned(self, block: object, verb: str) -> int:
        block = self._block(block)
        if self._refs[block] == 0:
            state = "cached (lookup its key to use it)" if block in self._key_of else "free"
            raise PoolError(f"cannot {verb} block {block}: it is {state}, not owned")
        return block

    def _check_writable(self, block: int) -> None:
        self._owned(block, "write")
        refs = self._refs[block]
        if refs > 1:
            raise PoolError(f"cannot write block {block}: it is shared (refcount {refs}); copy_block it first")
        if block in self._key_of:
            raise PoolError(f"cannot write block {block}: it is registered under {self._key_of[block]!r}, so immutable")

    def _slots(self, name: str, x: object, dim: int) -> torch.Tensor:
        want = f"[{self.kv_heads}, n, {dim}]"
        if not isinstance(x, torch.Tensor):
            raise PoolError(f"{name} must be a tensor {want}, got {type(x).__name__}")
        if x.dim() == 4 and x.shape[0] == 1:
            x = x[0]
        if x.dim() != 3 or x.shape[0] != self.kv_heads or x.shape[2] != dim:
            raise PoolError(f"{name} must be {want} (or [1, {self.kv_heads}, n, {dim}]), got {list(x.shape)}")
        if x.dtype != self.dtype or x.device != self.device:
            raise PoolError(f"{name} must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")
        return x


def _broken(what: str) -> None:
    raise PoolError(f"block pool invariant broken: {what}")


def _count(name: str, value: object, least: int) -> int:
    value = integer(name, value)
    if value < least:
        raise PoolError(f"{name} must be at least {least}, got {value}")
    return value
