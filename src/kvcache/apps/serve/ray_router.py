"""``kvcache serve --ray --router blocks``: a Ray Serve request router that sends a request to the
replica whose pool holds the longest prefix of its prompt, by the engine's own block keys.

Each replica reports what its pool holds (``Replica.record_routing_stats``, every
``STATS_PERIOD_S``; Ray Serve carries the report to the router): its engine's key salt, its block
size and the first ``KEY_DIGITS`` hex digits of every block key its pool holds, owned or cached
(``BlockPool.keys``). The ingress gives each request its prompt's token ids (``Call.tokens``). The
router computes the prompt's block keys under the reported salt (``chain_keys``, as the engine
does) and counts, per replica, the leading keys it holds: reported, or routed to it in the last
``remember_s`` seconds (a report lags by up to a period, and a prompt being computed is not in it
yet). A prompt routed before the first report (a cluster just started: no salt yet) is keyed when
that report arrives.

The choice (``rank``): among the replicas whose queues are within ``imbalance`` requests of the
shortest, the longest match first; ties (a new prefix above all) go to the replica with the smaller
footprint, the distinct block keys routed to it in the last ``footprint_s`` seconds, then to the
shorter queue, then at random. The footprint is the working set its pool must keep: placing new
prefixes by it splits the prefixes in use evenly between the pools (by queue length alone, a
replica can be handed more system prompts than its pool holds, and then evicts them in turn; a
full pool's count of blocks says nothing, as every pool is full once warm). Replicas further
behind come last. Ray sends the request to the first rank, or to the second when the first is full.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

#: Seconds between a replica's reports of the blocks it holds.
STATS_PERIOD_S = 1.0
#: Hex digits of a block key a replica reports (64 bits: no collision among any pool's blocks).
KEY_DIGITS = 16


@dataclass(frozen=True)
class Candidate:
    """A replica as ``rank`` sees it: the block keys it holds (``KEY_DIGITS`` digits), its queue
    length (None: not known), and its footprint (distinct block keys routed to it lately)."""

    id: Any
    held: Callable[[str], bool]
    load: int | None
    footprint: int


def matched(keys: Sequence[str], held: Callable[[str], bool]) -> int:
    """How many of ``keys`` (a prompt's block keys in order) ``held`` holds from the first on."""
    return sum(1 for _ in itertools.takewhile(held, keys))


def rank(keys: Sequence[str], candidates: Sequence[Candidate], imbalance: float, rng: random.Random) -> list[Candidate]:
    """``candidates`` best first for a prompt of block ``keys`` (see the module docstring); an
    unknown queue length counts as 0."""
    if not candidates:
        return []
    shortest = min(c.load or 0 for c in candidates)
    behind = lambda c: (c.load or 0) - shortest > imbalance  # noqa: E731
    return sorted(candidates, key=lambda c: (behind(c), -matched(keys, c.held), c.footprint, c.load or 0, rng.random()))


def report(salt: bytes, block_size: int, keys: Sequence[str]) -> dict[str, Any]:
    """What a replica reports (``Replica.record_routing_stats``)."""
    return {"salt": salt.hex(), "block_size": block_size, "blocks": [k[:KEY_DIGITS] for k in keys], "at": time.time()}


def tokens_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    """The prompt's token ids the ingress gave a request (``Call.tokens``); none for another call."""
    call = pending_request.args[0] if pending_request is not None and pending_request.args else None
    return tuple(getattr(call, "tokens", ()))


def prompt_keys(tokens: Sequence[int], stats: dict[str, Any]) -> list[str]:
    """The block keys of a prompt of ``tokens`` under a replica's reported salt (``KEY_DIGITS``
    digits each); none for a report without a salt or a block size, or for tokens that are not ids."""
    from ...engine import PoolError, chain_keys

    salt, block_size = stats.get("salt"), stats.get("block_size")
    if not tokens or not isinstance(salt, str) or not isinstance(block_size, int) or block_size < 1:
        return []
    try:
        return [k[:KEY_DIGITS] for k in chain_keys(list(tokens), block_size, bytes.fromhex(salt))]
    except (ValueError, PoolError):  # a salt that is not hex, a token id out of range: route by load
        return []


class BlockAffinityRouter(RequestRouter):
    """The router (see the module docstring); ``imbalance``, ``remember_s`` and ``footprint_s``
    come from ``RequestRouterConfig.request_router_kwargs``."""

    def initialize_state(self, imbalance: float = 4.0, remember_s: float = 10.0, footprint_s: float = 60.0, seed: int | None = None) -> None:
        self._imbalance = float(imbalance)
        self._remember_s = float(remember_s)
        self._footprint_s = float(footprint_s)
        self._rng = random.Random(seed)
        self._routed: dict[ReplicaID, dict[str, float]] = {}  # keys routed to a replica -> when
        self._reported: dict[ReplicaID, tuple[Any, frozenset[str]]] = {}  # the last report's time and keys
        self._scheme: dict[str, Any] = {}  # the salt and block size of the last report read
        # prompts routed before any report gave the scheme, keyed once one does: replica -> [(tokens, when)]
        self._unkeyed: dict[ReplicaID, list[tuple[tuple[int, ...], float]]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = self._keys(pending_request, candidate_replicas)
        now = time.time()
        by_id = {r.replica_id: r for r in candidate_replicas}
        candidates = [self._candidate(r, now) for r in candidate_replicas]
        order = [by_id[c.id] for c in rank(keys, candidates, self._imbalance, self._rng)]
        return [order[:1], order[1:]] if len(order) > 1 else [order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        now = time.time()
        if not self._scheme.get("salt"):  # no report read yet (a cluster just started): key it later
            horizon = max(self._remember_s, self._footprint_s)
            earlier = [(t, when) for t, when in self._unkeyed.get(replica_id, []) if now - when <= horizon]
            self._unkeyed[replica_id] = [*earlier, (tokens_of(pending_request), now)]
            return
        routed = self._routed.setdefault(replica_id, {})
        for key in self._keys(pending_request, []):
            routed[key] = now

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        for table in (self._routed, self._unkeyed, self._reported):
            table.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def _keys(self, pending_request: PendingRequest | None, replicas: Sequence[RunningReplica]) -> list[str]:
        tokens = tokens_of(pending_request)
        stats = next((r.routing_stats for r in replicas if r.routing_stats.get("salt")), None)
        if stats is not None:
            self._scheme = {"salt": stats["salt"], "block_size": stats.get("block_size")}
            for rid, routed_then in self._unkeyed.items():
                routed = self._routed.setdefault(rid, {})
                for earlier, when in routed_then:
                    for key in prompt_keys(earlier, self._scheme):
                        routed[key] = max(when, routed.get(key, when))
            self._unkeyed.clear()
        return prompt_keys(tokens, self._scheme)

    def _candidate(self, replica: RunningReplica, now: float) -> Candidate:
        rid, stats = replica.replica_id, replica.routing_stats
        last = self._reported.get(rid)
        if last is None or last[0] != stats.get("at"):
            last = (stats.get("at"), frozenset(stats.get("blocks") or ()))
            self._reported[rid] = last
        reported = last[1]
        routed = self._routed.get(rid, {})
        for key in [k for k, t in routed.items() if now - t > max(self._remember_s, self._footprint_s)]:
            del routed[key]
        recent = lambda key: now - routed.get(key, -float("inf")) <= self._remember_s  # noqa: E731
        footprint = sum(now - t <= self._footprint_s for t in routed.values())
        return Candidate(rid, lambda key: key in reported or recent(key), self.replica_queue_len_cache.get(rid), footprint)
