"""Which requests compute which tokens in the next step, and the blocks they hold.

Each step has a budget of ``max_batch_tokens`` tokens:

1. running requests that need one token (decode) come first, then running requests in the middle
   of their prompt (a prefill chunk of what the budget leaves), oldest first;
2. then waiting requests join, oldest first, while the budget, ``max_seqs`` and the pool allow.
   A joining request first takes the registered blocks of its longest known prefix (a pool hit:
   those tokens are not computed again). If the next block of its prefix is being computed right
   now by a running request, it waits a step for it instead of computing it twice.

A request that needs a block when the pool has none available preempts the newest running
request not yet scheduled this step (or, if there is none, is preempted itself): the preempted one
gives back its blocks and goes to the front of the queue, to be computed again later (its full
blocks stay registered in the pool's LRU, so most come back as hits). A joining request never
preempts.

After the forward pass (``commit``) each row's newly full blocks are registered under their chain
keys, so later requests (or this one after a preemption) find them; a block that turns out to
duplicate one registered meanwhile is swapped for it. Not thread-safe: the engine holds its lock.

With a store tier (``tier.py``), a joining request asks the prompt store for what lies past its
pool hits, and a request's full chunks are stored once its prompt is computed and before it is
preempted (so it reloads them instead of computing them again).

A request of a bounded kind (``compression.py``) gives its prompt's blocks back once its own cache
holds its context, and from then on holds a lease: as many blocks as its cache's bytes fill,
recounted after every step (``commit``), preempting the newest other request when the pool runs
short. It computes one token a step past its prompt, also when it computes its generated tokens
again after a preemption, so its cache evicts as it did the first time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..prompts.keys import chain
from .pool import BlockPool, PoolError
from .request import Request, State
from .tier import StoreTier


class Scheduler:
    def __init__(
        self, pool: BlockPool, salt: bytes, max_batch_tokens: int, max_seqs: int, share_prefixes: bool = True,
        tier: StoreTier | None = None,
    ):
        self.pool, self.salt, self.tier = pool, salt, tier
        self.max_batch_tokens, self.max_seqs, self.share_prefixes = max_batch_tokens, max_seqs, share_prefixes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.store_tokens = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, request: Request) -> None:
        request.keys = chain(self.salt, request.tokens, self.pool.block_size) if self.share_prefixes else []
        self.waiting.append(request)

    # ---- planning a step -------------------------------------------------------------------------

    def plan(self) -> list[tuple[Request, int]]:
        """The step's rows, ``(request, tokens to compute)``, with their blocks allocated and the
        slots they write claimed."""
        budget = self.max_batch_tokens
        order = [r for r in self.running if r.remaining == 1] + [r for r in self.running if r.remaining > 1]
        rows: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        for request in order:
            if budget == 0:
                break
            if request.state is not State.RUNNING:  # preempted by an earlier row of this step
                continue
            n = self._chunk(request, min(request.remaining, budget))
            if n == 0:
                continue
            if not self._grow(request, n, order, scheduled):
                continue
            rows.append((request, n))
            scheduled.add(request.rid)
            budget -= n
        skipped = 0
        while budget > 0 and len(self.running) < self.max_seqs and skipped < len(self.waiting):
            request = self.waiting[skipped]
            n = self._admit(request, budget)
            if n is None:  # waits for a prefix being computed: let the next one try
                skipped += 1
                continue
            if n == 0:  # no room: the queue waits for blocks to come back
                break
            rows.append((request, n))
            budget -= n
        for request, n in rows:
            self._claim(request, n)
        return rows

    def _grow(self, request: Request, n: int, order: list[Request], scheduled: set[int]) -> bool:
        """Give ``request`` the blocks for ``n`` more tokens, preempting newer unscheduled requests as
        needed; False if ``request`` had to be preempted itself."""
        if request.own_context:  # its cache holds them; its lease is counted after the step
            return True
        need = blocks_for(request.slots + n, self.pool.block_size) - len(request.table)
        while need > self.pool.available:
            victim = next(
                (r for r in reversed(order) if r.state is State.RUNNING and r is not request and r.rid not in scheduled),
                None,
            )
            self.preempt(victim or request)
            if victim is None:
                return False
        if need > 0:
            request.table.extend(self.pool.allocate(need))
        return True

    def _chunk(self, request: Request, n: int) -> int:
        """The tokens ``request`` computes this step, at most ``n``: a prompt to be compressed ends a
        chunk exactly at its end, and its last chunk holds the observation window (0: wait for a
        step with more room); past it, one token a step."""
        c = request.compression
        if c is None:
            return n
        left = len(request.prompt) - request.computed
        if left <= 0 and request.own_context:
            return min(n, 1)
        if c.prefills:
            return min(n, left)
        if left <= 0:
            return n
        if n >= left:
            return left
        return max(0, min(n, left - c.window))

    def _admit(self, request: Request, budget: int) -> int | None:
        """Start ``request``: its pool hits, then blocks for its first chunk; returns the chunk's
        tokens, 0 if the pool has no room now, None if it waits for a prefix being computed."""
        pool, bs = self.pool, self.pool.block_size
        if request.own_context:  # a window's own cache takes its prompt: no block, nothing shared
            n = self._chunk(request, min(len(request.tokens), budget))
            if n:
                self._start(request, 0, 0)
            return n
        scored = request.scored_upto  # prompt tokens whose log-probabilities need no logits of this pass
        hits: list[int] = []
        if self.share_prefixes:
            limit = min((len(request.tokens) - 1) // bs, len(request.keys))  # the last token is always computed
            if request.compression is not None:  # the queries its compression reads are computed here
                limit = min(limit, request.compression.first_observed(len(request.prompt)) // bs)
            if request.prompt_logprobs is not None:  # a position's logits score the next token: compute them
                limit = min(limit, (scored - 1) // bs)
            for key in request.keys[:limit]:
                block = pool.lookup(key)
                if block is None:
                    break
                hits.append(block)
            if len(hits) < limit and self._in_flight(request.keys[len(hits)], len(hits)):
                _release(pool, hits)
                return None
        start = len(hits) * bs
        fetched = None
        if self.tier is not None and scored == len(request.prompt):  # the store holds no logits
            fetched = self.tier.fetch(request.tokens[: self._loadable(request)], start)
        loaded = fetched[1] if fetched is not None else start
        request.computed = loaded
        n = self._chunk(request, min(len(request.tokens) - loaded, budget))
        need = blocks_for(loaded + n, bs) - len(hits)
        if n == 0 or need > pool.available:
            _release(pool, hits)
            request.computed = 0
            return 0
        request.table = hits + pool.allocate(need)
        if fetched is not None:
            self.tier.write(request.table, start, fetched[0], loaded)  # type: ignore[union-attr]
            self.store_tokens += loaded - start
        if pool.open_blocks:
            request.tail = pool.take_tail()
        request.registered = len(hits)
        self._start(request, start, loaded)
        return n

    def _start(self, request: Request, reused_pool: int, loaded: int) -> None:
        """Move ``request`` to the running requests, ``loaded`` of its tokens already in its blocks."""
        request.computed = loaded
        if request.stats.preemptions == 0:
            request.stats.reused_pool, request.stats.reused_store = reused_pool, loaded - reused_pool
        request.state = State.RUNNING
        self.waiting.remove(request)
        self.running.append(request)

    def _loadable(self, request: Request) -> int:
        """How many of ``request``'s tokens a store may provide, plus one (``StoreTier.fetch`` leaves
        the last token to compute): the tokens before the first query a compression reads."""
        if request.compression is None:
            return len(request.tokens)
        return request.compression.first_observed(len(request.prompt)) + 1

    def _in_flight(self, key: str, index: int) -> bool:
        """Whether a running request is computing the block whose chain key is ``key`` (its
        ``index``-th block) right now."""
        bs = self.pool.block_size
        return any(
            len(r.keys) > index and r.keys[index] == key and r.computed < (index + 1) * bs for r in self.running
        )

    def _claim(self, request: Request, n: int) -> None:
        if request.own_context:  # its own cache takes the tokens
            return
        bs, t = self.pool.block_size, request.slots
        end = t + n
        while t < end:
            offset = t % bs
            take = min(bs - offset, end - t)
            self.pool.claim(request.table[t // bs], offset, take)
            t += take

    # ---- after the forward pass ------------------------------------------------------------------

    def commit(
        self, rows: list[tuple[Request, int]], chosen: dict[int, int], caches: dict[int, Any] | None = None,
    ) -> list[Request]:
        """Advance each row by its computed tokens; append the token chosen for each request that
        finished its tokens (``chosen``: request id -> token id); hand each prompt compressed in
        this step its own cache (``caches``: request id -> ``KVCache``), its prompt's blocks given
        back; recount the leases. Returns the requests that got a token."""
        now = time.perf_counter()
        got = []
        for request, n in rows:
            request.computed += n
            request.stats.computed += n
            if self.tier is not None and request.computed - n < len(request.prompt) <= request.computed:
                self.tier.save(request)  # the prompt is computed: its chunks go to the store
            self._register(request)
            if caches is not None and request.rid in caches:
                _release(self.pool, request.table)
                request.table, request.cache, request.observed = [], caches[request.rid], {}
                request.keys, request.registered = [], 0
            if request.rid in chosen:
                self._append(request, chosen[request.rid], now)
                got.append(request)
        for request, _ in rows:
            if request.state is State.RUNNING and request.cache is not None:
                self._lease(request)
            if request.state is State.RUNNING and request.computed >= len(request.prompt):
                held = len(request.table) + len(request.lease)
                request.stats.held_blocks = max(request.stats.held_blocks, held)
        return got

    def _lease(self, request: Request) -> None:
        """Hold as many blocks as ``request``'s own cache's bytes fill, no more. While the pool has too few,
        the newest running request gives its blocks back (``request`` itself when it is the newest,
        so the oldest always goes on); a cache larger than the whole pool fails its request."""
        pool = self.pool
        need = -(-request.cache.nbytes // pool.block_nbytes) - len(request.lease)
        while need > pool.available:
            others = [r for r in self.running if r is not request]
            if not others:
                error = PoolError(
                    f"request {request.rid}'s {request.compression.spec} cache holds {request.cache.nbytes} bytes, "
                    f"more than the pool's {pool.total} blocks of {pool.block_nbytes}"
                )
                self.finish(request, "error", error)
                return
            victim = max(others, key=lambda r: r.rid)
            if victim.rid < request.rid:
                self.preempt(request)
                return
            self.preempt(victim)
        if need > 0:
            request.lease.extend(pool.allocate(need))
        elif need < 0:  # the cache shrank (recoded coarser): its surplus blocks go back
            _release(pool, request.lease[need:])
            del request.lease[need:]

    def _append(self, request: Request, token: int, now: float) -> None:
        request.tokens.append(token)
        stats = request.stats
        stats.generated += 1
        if stats.first_token is None:
            stats.first_token = now
        if token in request.eos:
            self.finish(request, "eos")
        elif stats.generated >= request.max_new_tokens:
            self.finish(request, "length")
        elif self.share_prefixes and not request.own_context and len(request.tokens) % self.pool.block_size == 0:
            request.keys = chain(self.salt, request.tokens, self.pool.block_size, request.keys)

    def _register(self, request: Request) -> None:
        """Register the request's newly full blocks (swapping any that duplicate a registered one)."""
        if not self.share_prefixes or request.own_context or request.state is not State.RUNNING:
            return
        pool, table = self.pool, request.table
        full = min(request.computed // pool.block_size, len(request.keys))
        for i in range(request.registered, full):
            key = request.keys[i]
            holder = pool.register(table[i], key)
            if holder != table[i]:
                shared = pool.lookup(key)
                pool.release(table[i])
                table[i] = shared
        request.registered = max(request.registered, full)

    # ---- leaving -----------------------------------------------------------------------------------

    def preempt(self, request: Request) -> None:
        """Take ``request``'s blocks back and queue it first, to compute its tokens again later
        (with a store tier, its full chunks are stored first, to be reloaded instead)."""
        if self.tier is not None:
            self.tier.save(request)
        self._give_back(request)
        request.computed, request.registered = 0, 0
        request.keys = chain(self.salt, request.tokens, self.pool.block_size) if self.share_prefixes else []
        request.state = State.WAITING
        request.stats.preemptions += 1
        self.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        """End ``request`` (``"eos"``, ``"length"``, ``"cancelled"``, ``"error"``); its blocks go back."""
        if request.state is State.FINISHED:
            return
        if request.state is State.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._give_back(request)
        request.state, request.finish_reason, request.error = State.FINISHED, reason, error
        request.stats.finished = time.perf_counter()

    def _give_back(self, request: Request) -> None:
        """Release ``request``'s blocks, its lease, its own cache and its open block."""
        _release(self.pool, request.table + request.lease)
        request.table, request.lease, request.cache, request.observed = [], [], None, {}
        if request.tail >= 0:
            self.pool.give_tail(request.tail)
            request.tail = -1


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _release(pool: BlockPool, blocks: list[int]) -> None:
    """Release ``blocks`` last first, so the LRU evicts a prefix's tail before its head."""
    for block in reversed(blocks):
        pool.release(block)
