"""``--router blocks`` without a cluster: what a replica reports names the blocks its engine holds
under the keys the router computes for a prompt, and the router's choices (longest match within
the load bound, room for new prefixes, what it was just sent) over a sequence of requests."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ray.serve", reason="the ray extra (pip install kvcache[ray])")

from kvcache import Engine  # noqa: E402
from kvcache.apps.serve.ray_app import Call  # noqa: E402
from kvcache.apps.serve.ray_router import BlockAffinityRouter, Candidate, matched, prompt_keys, rank, report  # noqa: E402
from helpers import model_for  # noqa: E402

BLOCK = 8


def ids(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 200), k=n)


def test_a_replicas_report_holds_the_keys_the_router_computes_for_the_prompts_it_served():
    engine = Engine(model_for("llama"), block_size=BLOCK, blocks=32, max_seqs=2)
    served, other = ids(3 * BLOCK + 5, 1), ids(3 * BLOCK, 2)
    engine.submit(served, max_new_tokens=2, eos_token_id=[])
    while engine.step():
        pass
    stats = report(engine.prefix_salt, engine.pool.block_size, engine.pool.keys())
    held = set(stats["blocks"])
    keys = prompt_keys(served, stats)
    assert len(keys) == 3 and matched(keys, held.__contains__) == 3
    assert matched(prompt_keys(other, stats), held.__contains__) == 0
    assert matched(prompt_keys(served[:BLOCK] + other, stats), held.__contains__) == 1  # one block in common, then not
    assert prompt_keys(served, {}) == [] and prompt_keys([], stats) == []
    assert prompt_keys(served, {**stats, "salt": "not hex"}) == [] and prompt_keys([-1] * BLOCK, stats) == []


def candidate(name: str, held: set[str], load: int | None = 0, footprint: int = 0) -> Candidate:
    return Candidate(name, held.__contains__, load, footprint)


def test_the_longest_match_wins_within_the_load_bound_and_the_rest_follow():
    keys = ["a", "b", "c"]
    a, b, c = candidate("A", {"a"}), candidate("B", {"a", "b"}, load=3), candidate("C", set(), load=0)
    rng = random.Random(0)
    assert [x.id for x in rank(keys, [a, b, c], imbalance=4, rng=rng)] == ["B", "A", "C"]
    b_far = candidate("B", {"a", "b"}, load=5)  # 5 behind the shortest queue: beyond the bound
    assert [x.id for x in rank(keys, [a, b_far, c], imbalance=4, rng=rng)] == ["A", "C", "B"]
    unknown = candidate("B", {"a", "b"}, load=None)  # a queue not known yet counts as empty
    assert rank(keys, [a, unknown], imbalance=4, rng=rng)[0].id == "B"


def test_a_new_prefix_goes_to_the_smaller_footprint_then_to_the_shorter_queue():
    rng = random.Random(0)
    big, small = candidate("big", {"x", "y"}, footprint=40), candidate("small", {"z"}, load=3, footprint=20)
    assert rank(["new"], [big, small], 4, rng)[0].id == "small"  # on a longer queue, within the bound
    assert rank(["new"], [big, candidate("small", {"z"}, load=5, footprint=20)], 4, rng)[0].id == "big"  # beyond it
    assert rank(["new"], [big, candidate("same", set(), load=1, footprint=40)], 4, rng)[0].id == "big"
    assert rank(["x", "new"], [big, small], 4, rng)[0].id == "big"  # a match outranks the footprint
    assert rank([], [], 4, rng) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sets(st.integers(0, 3)), st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=4),
       st.integers(0, 5))  # fmt: skip
def test_the_first_choice_is_never_beaten_by_an_eligible_replica(replicas, imbalance):
    """Against the rule written out: no replica within the load bound matches more, or as much
    with a smaller footprint, or as much with as small a footprint on a shorter queue."""
    keys = [f"k{i}" for i in range(4)]
    helds = [set(keys[:depth]) | {f"other{e}" for e in extra} for depth, extra, _, _ in replicas]
    cands = [candidate(str(i), held, load, footprint) for i, (held, (_, _, load, footprint)) in enumerate(zip(helds, replicas))]
    first = rank(keys, cands, imbalance, random.Random(1))[0]
    shortest = min(c.load for c in cands)
    eligible = [c for c in cands if c.load - shortest <= imbalance]
    assert first in eligible
    best = max(matched(keys, c.held) for c in eligible)
    assert matched(keys, first.held) == best
    tied = [c for c in eligible if matched(keys, c.held) == best]
    assert first.footprint == min(c.footprint for c in tied)
    assert first.load == min(c.load for c in tied if c.footprint == first.footprint)


def replica(name: str, stats: dict) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=stats, max_ongoing_requests=64)


def pending(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(args=[Call("POST", "/v1/chat/completions", "", (), b"", "", tuple(tokens))])


def test_the_router_follows_reports_remembers_what_it_sent_and_balances_beyond_the_bound():
    engine = Engine(model_for("llama"), block_size=BLOCK, blocks=32, max_seqs=2)
    system, other = ids(2 * BLOCK, 3), ids(2 * BLOCK, 4)
    engine.submit(system + [5], max_new_tokens=1, eos_token_id=[])
    while engine.step():
        pass
    holds = report(engine.prefix_salt, BLOCK, engine.pool.keys())
    empty = report(engine.prefix_salt, BLOCK, ())

    async def scenario():
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        router = BlockAffinityRouter(DeploymentID(name="kvcache-engine", app_name="test"), DeploymentHandleSource.UNKNOWN,
                                     use_replica_queue_len_cache=True)  # fmt: skip
        router.initialize_state(imbalance=2, remember_s=60, seed=0)
        a, b = replica("A", holds), replica("B", empty)

        async def first(tokens):
            return (await router.choose_replicas([a, b], pending(tokens)))[0][0].replica_id

        assert await first(system + ids(3, 5)) == "A"  # A reported the system prompt's blocks
        router.on_request_routed(pending(system + ids(3, 5)), "A", None)
        assert await first(other + ids(3, 6)) == "B"  # a new prompt: to the smaller footprint (A was just sent 2 blocks)
        router.on_request_routed(pending(other), "B", None)
        b.routing_stats = {**empty, "at": empty["at"] + 1}  # a later report that does not have it yet
        router.replica_queue_len_cache.update("B", 1)
        assert await first(other + ids(3, 7)) == "B"  # remembered from routing, on a longer queue
        router.replica_queue_len_cache.update("A", 4)  # A three behind B (bound 2): B, though A holds it
        assert await first(system + ids(3, 8)) == "B"
        assert await first([]) == "B"  # no prompt: the shorter queue
        ranks = await router.choose_replicas([a, b], pending(system))
        assert [r.replica_id for rank_ in ranks for r in rank_] == ["B", "A"]  # both ranked, the rest second
        router.replica_queue_len_cache.update("A", 1)
        router.on_request_routed(pending(ids(2 * BLOCK, 9)), "A", None)  # A: 4 blocks routed, B: 2
        assert await first(ids(2 * BLOCK, 10)) == "B"
        for key in router._routed["A"]:  # A's were routed longer ago than footprint_s: they stop counting
            router._routed["A"][key] -= 100
        assert await first(ids(2 * BLOCK, 10)) == "A"

    asyncio.run(scenario())


def test_the_ingress_tokenizes_a_prompt_as_the_replica_does(tmp_path):
    import json

    from kvcache.apps.cli_load import load_tokenizer
    from kvcache.apps.serve.app import chat_ids, text_ids
    from kvcache.apps.serve.ray_app import routing_tokens
    from serve_process import tiny_chat_model

    tokenizer = load_tokenizer(str(tiny_chat_model(tmp_path)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cache?"}]
    chat = json.dumps({"model": "m", "messages": messages}).encode()
    assert routing_tokens(tokenizer, "/v1/chat/completions", chat) == tuple(chat_ids(tokenizer, messages))
    assert routing_tokens(tokenizer, "/v1/completions", b'{"prompt": ["Once upon", "x"]}') == tuple(text_ids(tokenizer, "Once upon"))
    assert routing_tokens(tokenizer, "/v1/completions", b'{"prompt": [5, 6, 7]}') == (5, 6, 7)
    for path, body in [("/v1/chat/completions", b"not json"), ("/v1/models", b""), ("/v1/chat/completions", b'{"messages": 3}')]:
        assert routing_tokens(tokenizer, path, body) == ()


def test_a_prompt_routed_before_the_first_report_is_keyed_when_it_arrives():
    """A cluster just started: no replica has reported its salt, so the router cannot key what it
    routes. What it sent then counts once the first report comes, though that report (sent before
    the prompt was computed) does not hold it."""
    engine = Engine(model_for("llama"), block_size=BLOCK, blocks=32, max_seqs=2)
    system = ids(2 * BLOCK, 11)
    empty = report(engine.prefix_salt, BLOCK, ())

    async def scenario():
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        router = BlockAffinityRouter(DeploymentID(name="kvcache-engine", app_name="test"), DeploymentHandleSource.UNKNOWN,
                                     use_replica_queue_len_cache=True)  # fmt: skip
        router.initialize_state(imbalance=2, remember_s=60, seed=0)
        a, b = replica("A", {}), replica("B", {})
        await router.choose_replicas([a, b], pending(system + [5]))
        router.on_request_routed(pending(system + [5]), "A", None)  # no salt known: keyed later
        router.on_request_routed(pending(ids(2 * BLOCK, 12)), "B", None)  # B's footprint equals A's
        a.routing_stats, b.routing_stats = dict(empty), dict(empty)
        for _ in range(4):  # ties would go either way at random; the remembered prompt decides
            assert (await router.choose_replicas([b, a], pending(system + [6])))[0][0].replica_id == "A"
        assert router._unkeyed == {}

    asyncio.run(scenario())
