"""The engine as a hypothesis state machine: random submits (prompts drawn around a few shared
prefixes, so blocks are shared and registered), steps and cancels, over a pool small enough that
requests preempt each other, against a simple reference: each request's own greedy ``generate``
(``engine_reference.py``) and plain bookkeeping.

After every rule: the pool's invariants (``BlockPool.check``: refcounts never negative, every block
free, cached or owned and the counts adding up to the total, keys and blocks agreeing, registered
blocks full), every running request's blocks owned and covering what it computed, no block held
by a waiting or finished request, and the tokens each request has so far a prefix of what it will
finish with. A write to a shared or registered block raises in the pool (``claim``), so no such
write can pass silently. At the end every request runs out, each matches its reference (near-ties
as ``engine_reference`` says) and no block is still owned.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_reference import reference, same_or_near_tie
from helpers import model_for
from kvcache import Engine
from kvcache.engine.request import State

BS = 4
PREFIXES = [[], [7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21]]
_REFERENCES: dict[tuple, tuple] = {}


def expected(model, prompt: list[int], new: int):
    key = (tuple(prompt), new)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(model, prompt, new)
    return _REFERENCES[key]


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = model_for("llama")
        self.engine = Engine(self.model, block_size=BS, blocks=7, max_batch_tokens=10, max_seqs=4)
        self.live: list = []  # (prompt, max_new, handle)
        self.cancelled: list = []

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        own=st.lists(st.integers(3, 255), min_size=0, max_size=9),
        new=st.integers(1, 8),
    )
    def submit(self, prefix, own, new):
        prompt = PREFIXES[prefix] + own or [5]
        handle = self.engine.submit(prompt, max_new_tokens=new, eos_token_id=[])
        self.live.append((prompt, new, handle))

    @rule()
    def step(self):
        self.engine.step()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def cancel(self, pick):
        prompt, new, handle = self.live.pop(pick % len(self.live))
        pool = self.engine.pool
        # Blocks only this request holds go back at once; shared ones stay with their other owners.
        alone = sum(pool.refcount(b) == 1 for b in handle._request.table)
        owned, was_done = pool.owned_count, handle.done
        handle.cancel()
        assert pool.owned_count == owned - alone
        assert handle.finish_reason == "cancelled" or was_done
        self.cancelled.append((prompt, new, handle))

    @invariant()
    def pool_is_consistent(self):
        pool = self.engine.pool
        pool.check()
        for prompt, new, handle in self.live + self.cancelled:
            request = handle._request
            if request.state is State.RUNNING:
                assert len(request.table) * BS >= request.computed
                assert all(pool.refcount(b) > 0 for b in request.table)
            else:
                assert request.table == [] and (request.computed == 0 or request.state is State.FINISHED)
            tokens, _ = expected(self.model, prompt, new)
            got = handle.tokens
            if got[: len(tokens)] != tokens[: len(got)]:
                same_or_near_tie(got, (tokens, expected(self.model, prompt, new)[1]), f"{prompt}")

    def teardown(self):
        while self.engine.step():
            self.engine.pool.check()
        for prompt, new, handle in self.live:
            same_or_near_tie(handle.result(), expected(self.model, prompt, new), f"{prompt}")
        assert self.engine.idle and self.engine.pool.owned_count == 0


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
