"""``Engine(compile=True)``: decode steps as one compiled graph per row bucket (``graph_step.py``),
other steps as one graph of a dynamic token count (``graph_chunk.py``).

One compiled engine serves the whole module (its two decode buckets, 1 and 2 rows, and its prompt
graph, of any token count, compile once, in the fixture), so the module pays inductor's compile
three times. Every batch runs through it and through an eager engine, which must
give the same tokens (both within the near-tie rule of each request's own ``generate``); the
compiled engine must have run its steps compiled, and never recompile.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine
from kvcache.engine.graph_step import GraphDecode
from kvcache.errors import UnsupportedOperation
from kvcache.attention import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled step needs the C++ library (no compiler)")

BS = 4
NEW = 8


@pytest.fixture(scope="module")
def compiled(model):
    engine = Engine(model, block_size=BS, blocks=160, max_seqs=2, compile=True)
    engine.warm_up()
    assert engine.graph.buckets == (1, 2) and engine.graph.graphs == 2 and engine.chunks.graphs == 1
    return engine


def no_recompiles(engine) -> bool:
    return engine.graph.graphs == 2 and engine.chunks.graphs == 1


def run_both(model, compiled, prompts, **submit):
    """Each prompt's tokens from the compiled engine and from a fresh eager one, and the compiled
    steps run; the compiled engine's cached prefixes are forgotten first and its pool checked after."""
    compiled.reset_prefix_cache()
    before = compiled.stats.compiled_steps
    handles = [compiled.submit(p, max_new_tokens=NEW, eos_token_id=[], **submit) for p in prompts]
    while compiled.step():
        compiled.pool.check()
    eager = Engine(model, block_size=BS, blocks=160, max_seqs=2)
    want = [eager.submit(p, max_new_tokens=NEW, eos_token_id=[], **submit) for p in prompts]
    eager.run()
    assert compiled.pool.owned_count == 1  # the scratch block alone
    return [h.result() for h in handles], [h.result() for h in want], compiled.stats.compiled_steps - before


BATCHES = {
    "a shared prefix": [ids(68, 1) + ids(3, 2), ids(68, 1) + ids(5, 3), ids(68, 1) + ids(2, 4)],
    "distinct prompts, ragged": [ids(9, 5), ids(4 * BS, 6), ids(2, 7)],
    "one request": [ids(11, 8)],
    "two requests": [ids(6, 9), ids(13, 10)],
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_compiled_decode_steps_give_the_eager_engines_tokens(model, compiled, name):
    prompts = BATCHES[name]
    steps_before = compiled.stats.steps
    got, want, steps = run_both(model, compiled, prompts)
    assert got == want
    assert steps == compiled.stats.steps - steps_before  # prompt steps and decode steps alike
    for i, (p, tokens) in enumerate(zip(prompts, got)):
        assert same_or_near_tie(tokens, reference(model, p, NEW), f"request {i}") == 0
    assert no_recompiles(compiled), "a step recompiled"


def test_prompt_logprobs_and_one_token_prompts_run_eagerly(model, compiled):
    prompts = [ids(12, 40), ids(7, 41)]
    compiled.reset_prefix_cache()
    before = compiled.stats.compiled_steps
    handles = [compiled.submit(p, max_new_tokens=1, eos_token_id=[], prompt_logprobs=2) for p in prompts]
    compiled.run()
    assert compiled.stats.compiled_steps == before  # prompt steps that score their tokens: eager
    eager = Engine(model, block_size=BS, blocks=160, max_seqs=2)
    want = [eager.submit(p, max_new_tokens=1, eos_token_id=[], prompt_logprobs=2) for p in prompts]
    eager.run()
    for got, expected in zip(handles, want):
        assert got.result() == expected.result()
        assert got.prompt_logprobs == expected.prompt_logprobs
    one = compiled.submit([5], max_new_tokens=2, eos_token_id=[])
    steps = compiled.stats.compiled_steps
    compiled.step()
    assert compiled.stats.compiled_steps == steps  # a step of one prompt token: eager
    compiled.run()
    assert one.result() == reference(model, [5], 2)[0] and no_recompiles(compiled)


def test_a_shared_prefix_is_read_once_inside_the_graph(model, compiled):
    before = compiled.stats.shared_prefix_rows
    got, want, _ = run_both(model, compiled, BATCHES["a shared prefix"])
    assert got == want and compiled.stats.shared_prefix_rows > before


@pytest.mark.parametrize("where", ["here", "on the background thread"])
def test_generate_batch_runs_the_graphs_of_the_warm_up_without_compiling_again(model, compiled, where):
    """generate_batch and the background loop hold the attention switch and the packed layers over
    their steps; the tensors each step makes must still match what the graphs were traced with."""
    compiled.reset_prefix_cache()
    prompts = BATCHES["a shared prefix"] + BATCHES["distinct prompts, ragged"][:1]
    with compiled.running() if where != "here" else contextlib.nullcontext():
        got = compiled.generate_batch(prompts, max_new_tokens=NEW, eos_token_id=[])
    for prompt, tokens in zip(prompts, got):
        same_or_near_tie(tokens, reference(model, prompt, NEW), "compiled")
    assert no_recompiles(compiled), "a step recompiled"


def test_a_compiled_step_writes_its_rows_slots_and_the_scratch_block_only(model, compiled, monkeypatch):
    pool, graph = compiled.graph.pool, compiled.graph
    compiled.reset_prefix_cache()
    handle = compiled.submit(ids(7, 20), max_new_tokens=3, eos_token_id=[])
    compiled.step()  # the prompt, eagerly
    before = [{name: t.clone() for name, t in pool.storage.layer(i).items()} for i in range(pool.layers)]
    steps = compiled.stats.compiled_steps
    monkeypatch.setattr(graph, "buckets", (2,))  # one row in the bucket of two: one padding row
    compiled.step()
    assert compiled.stats.compiled_steps == steps + 1
    (request,) = compiled.scheduler.running
    row = (request.table[(request.slots - 1) // BS], (request.slots - 1) % BS)
    changed = torch.zeros(pool.total, BS, dtype=torch.bool)
    for i in range(pool.layers):
        for name, t in pool.storage.layer(i).items():  # [blocks, Hkv, BS, D]
            changed |= (t != before[i][name]).any(-1).any(1)
    written = {(b, s) for b, s in changed.nonzero().tolist()}
    assert row in written and written - {row} <= {(graph.scratch, s) for s in range(BS)}
    compiled.run()
    assert handle.result() == reference(model, ids(7, 20), 3)[0]


def test_bounded_requests_run_eagerly_beside_compiled_steps(model, compiled):
    prompts = [ids(30, 11), ids(9, 12)]
    got, want, steps = run_both(model, compiled, prompts, cache="window:window=8,sinks=2")
    assert got == want and steps == 0  # every row holds its context in a cache of its own


def test_compile_is_refused_at_start_where_steps_cannot_be_compiled(model):
    with pytest.raises(UnsupportedOperation, match="full-precision blocks.*compile=False"):
        Engine(model, "quantized:bits=8", block_size=BS, blocks=32, compile=True)


def test_the_scratch_block_is_not_the_requests(model):
    engine = Engine(model, block_size=BS, blocks=8, max_seqs=2, compile=True)  # (no step: nothing compiles)
    assert engine.max_request_tokens == 7 * BS and engine.pool.owned_count == 1
    with pytest.raises(Exception, match="needs 8 blocks.*the pool has 7 for requests"):
        engine.submit(ids(8 * BS - 4, 1), max_new_tokens=4)
    assert GraphDecode(model, engine.pool, 300).buckets[-1] == 128  # the top bucket caps; more rows run eagerly


def test_reset_prefix_cache_forgets_finished_prompts_only(model):
    engine = Engine(model, block_size=BS, blocks=64, max_seqs=2)
    done, other = ids(4 * BS, 30), ids(4 * BS, 31)
    engine.generate_batch([done + [5]], max_new_tokens=2, eos_token_id=[])
    assert engine.pool.cached_count > 0
    running = engine.submit(other, max_new_tokens=NEW, eos_token_id=[])
    engine.step()
    computed = engine.stats.forward_tokens
    assert engine.reset_prefix_cache() > 0 and engine.pool.cached_count == 0
    engine.pool.check()
    again = engine.submit(done + [7], max_new_tokens=2, eos_token_id=[])
    engine.run()
    assert engine.stats.forward_tokens - computed >= len(done)  # computed again, not found
    assert same_or_near_tie(running.result(), reference(model, other, NEW), "running") == 0
    assert same_or_near_tie(again.result(), reference(model, done + [7], 2), "again") == 0
