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

The same machine runs over int8 blocks (``CodedMachine``: every running request holds its own open
block, the open blocks add up; tokens are not compared, as the reference depends on the chunks
the engine chose) and over bounded kinds (``SnapMachine``, ``H2OMachine``: once its prompt is
computed a request holds no blocks of its own but a lease covering its cache's bytes; tokens
against ``test_engine_bounded.bounded_reference``, which chunking does not change).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_reference import reference, same_or_near_tie
from test_engine_bounded import bounded_reference
from helpers import model_for
from kvcache import Engine
from kvcache.engine.request import State

BS = 4
PREFIXES = [[], [7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21]]
_REFERENCES: dict[tuple, tuple] = {}


SNAPKV = "snapkv:budget=0.5,window=3,pool=3"


def expected(model, prompt: list[int], new: int, spec: str = "growable"):
    key = (tuple(prompt), new, spec)
    if key not in _REFERENCES:
        if spec == "growable":
            _REFERENCES[key] = reference(model, prompt, new)
        else:
            _REFERENCES[key] = bounded_reference(model, prompt, new, spec)[0]
    return _REFERENCES[key]


class EngineMachine(RuleBasedStateMachine):
    spec = "growable"
    blocks = 7
    #: Whether the tokens are compared with the reference (``expected``).
    compare = True

    def __init__(self):
        super().__init__()
        self.model = model_for("llama", num_hidden_layers=2)  # the engine tests' model (conftest.py)
        self.engine = Engine(self.model, self.spec, block_size=BS, blocks=self.blocks, max_batch_tokens=10, max_seqs=4)
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
        alone = sum(pool.refcount(b) == 1 for b in handle._request.table) + len(handle._request.lease)
        owned, was_done = pool.owned_count, handle.done
        handle.cancel()
        assert pool.owned_count == owned - alone
        assert handle.finish_reason == "cancelled" or was_done
        self.cancelled.append((prompt, new, handle))

    @invariant()
    def pool_is_consistent(self):
        pool = self.engine.pool
        pool.check()
        tails = []
        for prompt, new, handle in self.live + self.cancelled:
            request = handle._request
            if request.state is State.RUNNING:
                assert len(request.table) * BS >= request.slots
                assert all(pool.refcount(b) > 0 for b in request.table)
                assert all(pool.refcount(b) == 1 for b in request.lease)
                if request.cache is not None:
                    assert request.table == [], "a request with its own cache still holds prompt blocks"
                    assert len(request.lease) * pool.block_nbytes >= request.cache.nbytes, "the lease is short"
                if request.tail >= 0:
                    tails.append(request.tail)
            else:
                assert request.table == [] and request.tail == -1 and request.lease == [] and request.cache is None
                assert request.computed == 0 or request.state is State.FINISHED
            if not self.compare:
                continue
            tokens, gaps = expected(self.model, prompt, new, self.spec)
            got = handle.tokens
            if got[: len(tokens)] != tokens[: len(got)]:
                same_or_near_tie(got, (tokens, gaps), f"{prompt}")
        if hasattr(pool, "free_tails"):
            assert len(set(tails)) == len(tails), "two running requests share an open block"
            assert pool.free_tails + len(tails) == pool.tail_count

    def teardown(self):
        while self.engine.step():
            self.engine.pool.check()
        for prompt, new, handle in self.live:
            result = handle.result()
            if self.compare:
                same_or_near_tie(result, expected(self.model, prompt, new, self.spec), f"{prompt}")
        assert self.engine.idle and self.engine.pool.owned_count == 0


class CodedMachine(EngineMachine):
    spec = "quantized:bits=8,group_size=8"
    compare = False


class SnapMachine(EngineMachine):
    spec = SNAPKV
    blocks = 9


class H2OMachine(EngineMachine):
    spec = "h2o:budget=0.5,recent=2"
    blocks = 9


SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = SETTINGS
TestCodedMachine = CodedMachine.TestCase
TestCodedMachine.settings = settings(SETTINGS, max_examples=30)
TestSnapMachine = SnapMachine.TestCase
TestSnapMachine.settings = settings(SETTINGS, max_examples=30)
TestH2OMachine = H2OMachine.TestCase
TestH2OMachine.settings = settings(SETTINGS, max_examples=20)
