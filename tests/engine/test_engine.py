"""``kvcache.Engine``: many requests over one block pool, against each request's own greedy
``generate`` with ``DynamicCache`` (``engine_reference.py`` states the near-tie rule).

Batch compositions: prompts shorter than a block, exactly k blocks, k blocks + 1, one token;
identical prompts submitted in the same step; a shared prefix; budgets that split prompts into
chunks; a pool too small for every request at once (preemption); cancels mid-decode; a forward
pass that fails; the background thread. The pool's invariants are checked after every step.
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine, cache_kwargs
from kvcache.engine import EngineStats, PoolError, RequestCancelled
from kvcache.errors import UnsupportedOperation

NEW = 10


def run_checked(engine: Engine) -> None:
    """Step to the end, checking the pool after every step."""
    while engine.step():
        engine.pool.check()
    engine.pool.check()
    assert engine.pool.owned_count == 0, "blocks still owned after every request ended"


def assert_all_match(model, prompts, handles, new=NEW, most_ties=0) -> None:
    ties = sum(
        same_or_near_tie(h.result(), reference(model, p, new), f"request {i} ({len(p)} tokens)")
        for i, (p, h) in enumerate(zip(prompts, handles))
    )
    assert ties <= most_ties


def compositions(bs: int) -> list[list[int]]:
    shared = ids(2 * bs, 7)
    return [
        ids(max(1, bs // 2 - 1), 1),  # shorter than a block
        ids(2 * bs, 2),  # exactly two blocks
        ids(2 * bs + 1, 3),  # two blocks and one token
        ids(1, 4),  # one token
        shared + ids(3, 5),
        shared + ids(bs, 6),
        list(shared),  # identical prompts, submitted in the same step
        list(shared),
    ]


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("bs,budget", [(4, 7), (4, 64), (16, 9), (16, 512)])
def test_every_request_matches_its_own_generate(model, bs, budget, share):
    engine = Engine(model, block_size=bs, blocks=64, max_batch_tokens=budget, max_seqs=5, share_prefixes=share)
    prompts = compositions(bs)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    run_checked(engine)
    assert_all_match(model, prompts, handles)
    assert all(h.finish_reason == "length" for h in handles)
    if not share:
        assert all(h.stats.reused_pool == 0 for h in handles)


def test_a_shared_prompt_is_computed_once(model):
    bs, shared, own = 8, ids(32, 11), 5
    prompts = [shared + ids(own, 20 + i) for i in range(6)]
    engine = Engine(model, block_size=bs, blocks=64, max_batch_tokens=256, max_seqs=8)
    handles = [engine.submit(p, max_new_tokens=4, eos_token_id=[]) for p in prompts]
    run_checked(engine)
    assert_all_match(model, prompts, handles, new=4)
    assert [h.stats.reused_pool for h in handles] == [0] + [32] * 5
    # Every prompt token once, plus the shared 32 once, plus 3 decode tokens per request.
    assert engine.stats.forward_tokens == 32 + 6 * own + 6 * 3


def test_identical_prompts_in_one_step_wait_for_the_first(model):
    prompt = ids(21, 12)
    engine = Engine(model, block_size=4, blocks=32, max_batch_tokens=512, max_seqs=4)
    first, second = (engine.submit(prompt, max_new_tokens=3, eos_token_id=[]) for _ in range(2))
    engine.step()
    assert first.stats.computed == 21 and second.stats.computed == 0, "the second computed the shared blocks again"
    run_checked(engine)
    assert second.stats.reused_pool == 20 and first.stats.reused_pool == 0
    assert first.result() == second.result()
    same_or_near_tie(first.result(), reference(model, prompt, 3))


def test_a_pool_too_small_for_all_preempts_and_every_request_completes(model):
    bs = 4
    prompts = [ids(9 + 3 * i, 30 + i) for i in range(5)]
    longest = max(len(p) for p in prompts) + NEW - 1
    engine = Engine(model, block_size=bs, blocks=-(-longest // bs) + 2, max_batch_tokens=64, max_seqs=5)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    run_checked(engine)
    assert engine.stats.preemptions > 0
    assert sum(h.stats.preemptions for h in handles) == engine.stats.preemptions
    assert_all_match(model, prompts, handles, most_ties=1)


def test_reset_stats_counts_from_zero_and_keeps_the_cached_prefixes(model):
    bs, shared = 4, ids(16, 14)
    engine = Engine(model, block_size=bs, blocks=40, max_batch_tokens=64, max_seqs=2)
    first = [shared + ids(3 + i, 40 + i) for i in range(2)]
    engine.generate_batch(first, max_new_tokens=3, eos_token_id=[])
    assert engine.stats.steps > 0 and engine.stats.forward_tokens > 0
    engine.reset_stats()
    assert engine.stats == EngineStats()
    again = shared + ids(2, 50)
    engine.generate_batch([again], max_new_tokens=3, eos_token_id=[])
    assert engine.stats.forward_tokens == 2 + 2  # the shared 16 from the cache, then 2 decode tokens
    assert engine.stats.peak_rows == 1 and engine.stats.preemptions == 0


def test_cancel_mid_decode_returns_the_blocks_at_once(model):
    prompts = [ids(10, 40), ids(13, 41), ids(6, 42)]
    engine = Engine(model, block_size=4, blocks=32, max_batch_tokens=64, max_seqs=4, share_prefixes=False)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    for _ in range(3):
        engine.step()
    victim = handles[1]
    held = len(victim._request.table)
    owned = engine.pool.owned_count
    assert len(victim.tokens) == 3 and held > 0
    victim.cancel()
    assert engine.pool.owned_count == owned - held
    engine.pool.check()
    with pytest.raises(RequestCancelled, match="after 3 generated"):
        victim.result()
    assert victim.finish_reason == "cancelled" and victim.tokens == reference(model, prompts[1], 3)[0]
    run_checked(engine)
    assert_all_match(model, [prompts[0], prompts[2]], [handles[0], handles[2]])
    victim.cancel()  # a finished request stays as it was
    assert victim.finish_reason == "cancelled"


def test_cancel_while_waiting(model):
    engine = Engine(model, block_size=4, blocks=16, max_seqs=1)
    first = engine.submit(ids(5, 1), max_new_tokens=2, eos_token_id=[])
    waiting = engine.submit(ids(5, 2), max_new_tokens=2, eos_token_id=[])
    engine.step()
    waiting.cancel()
    run_checked(engine)
    assert first.finish_reason == "length" and waiting.finish_reason == "cancelled" and waiting.tokens == []


def test_eos_ends_a_request_and_frees_its_blocks(model):
    prompt = ids(12, 50)
    expected, _ = reference(model, prompt, NEW)
    eos = expected[4]
    stop = expected.index(eos)
    engine = Engine(model, block_size=4, blocks=16)
    handle = engine.submit(prompt, max_new_tokens=NEW, eos_token_id=eos)
    run_checked(engine)
    assert handle.result() == expected[: stop + 1] and handle.finish_reason == "eos"


def test_iterating_a_handle_steps_the_engine(model):
    prompt = ids(9, 60)
    engine = Engine(model, block_size=4, blocks=16)
    handle = engine.submit(prompt, max_new_tokens=6, eos_token_id=[])
    seen = []
    for token in handle:
        seen.append(token)
        assert handle.tokens[: len(seen)] == seen
    assert seen == handle.result()
    same_or_near_tie(seen, reference(model, prompt, 6))
    assert handle.stats.ttft is not None and handle.stats.tpot is not None and handle.stats.generated == 6


def test_the_background_thread_serves_generate_batch_and_handles(model):
    prompts = [ids(7, 70), ids(20, 71), ids(3, 72)]
    engine = Engine(model, block_size=8, blocks=32)
    with engine.running():
        outputs = engine.generate_batch(prompts, max_new_tokens=5, eos_token_id=[])
        streamed = list(engine.submit(prompts[1], max_new_tokens=5, eos_token_id=[]))
    assert engine.idle
    for prompt, out in zip(prompts, outputs):
        same_or_near_tie(out, reference(model, prompt, 5))
    assert streamed == outputs[1]
    # After the thread stopped, the caller's own calls step the engine again.
    assert engine.generate_batch([prompts[0]], max_new_tokens=5, eos_token_id=[]) == [outputs[0]]


def test_run_here_steps_on_the_calling_thread_while_another_thread_waits_on_handles(model):
    """What ``kvcache serve`` does: the engine steps on the thread that loaded the model and a client
    thread submits and waits; setting the stop event and waking ends the loop."""
    import threading

    prompts = [ids(7, 90), ids(18, 91)]
    engine = Engine(model, block_size=8, blocks=32)
    stop, got, stepping = threading.Event(), {}, []

    def client():
        got["outputs"] = engine.generate_batch(prompts, max_new_tokens=5, eos_token_id=[])
        with pytest.raises(RuntimeError, match="already stepping"):
            engine.run_here(threading.Event())
        stepping.append(engine._thread)
        stop.set()
        engine.wake()

    thread = threading.Thread(target=client)
    thread.start()
    engine.run_here(stop)
    thread.join()
    assert stepping == [threading.current_thread()] and engine._thread is None and engine.idle
    for prompt, out in zip(prompts, got["outputs"]):
        same_or_near_tie(out, reference(model, prompt, 5))


def test_a_failed_forward_pass_leaves_every_request_as_it_was(model):
    prompts = [ids(6, 80), ids(11, 81)]
    engine = Engine(model, block_size=4, blocks=32)
    handles = [engine.submit(p, max_new_tokens=5, eos_token_id=[]) for p in prompts]
    engine.step()
    engine.step()
    before = [(h.tokens, h._request.computed) for h in handles]

    def fail(*_):
        raise RuntimeError("injected failure")

    hook = model.model.layers[-1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        hook.remove()
    assert [(h.tokens, h._request.computed) for h in handles] == before
    engine.pool.check()
    run_checked(engine)
    assert_all_match(model, prompts, handles, new=5)


def test_an_error_on_the_background_thread_fails_that_steps_requests(model):
    engine = Engine(model, block_size=4, blocks=32)

    def fail(*_):
        raise RuntimeError("injected failure")

    hook = model.model.layers[0].register_forward_pre_hook(fail)
    try:
        with engine.running():
            handle = engine.submit(ids(5, 90), max_new_tokens=3, eos_token_id=[])
            with pytest.raises(RuntimeError, match="injected"):
                handle.result(timeout=30)
    finally:
        hook.remove()
    assert handle.finish_reason == "error" and engine.pool.owned_count == 0


# ---- refusals -----------------------------------------------------------------------------------------


def test_bad_requests_are_refused_and_change_nothing(model):
    engine = Engine(model, block_size=4, blocks=4)
    for bad, match in [
        ([], "empty"),
        ([3, 300], "outside the model's vocabulary"),
        ([3, -1], "outside"),
        ("abc", "token ids"),
        (torch.zeros(2, 3, dtype=torch.long), r"\[S\] or \[1, S\]"),
        (torch.zeros(3), "token ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([3, 4], max_new_tokens=0)
    with pytest.raises(PoolError, match="needs 5 blocks of 4; the pool has 4"):
        engine.submit(ids(10, 1), max_new_tokens=8)
    with pytest.raises(ValueError, match="eos_token_id"):
        engine.submit([3, 4], eos_token_id="x")
    assert engine.idle and engine.pool.owned_count == 0


def test_bad_engines_are_refused(model):
    with pytest.raises(UnsupportedOperation, match="does not serve 'kvzip' caches"):
        Engine(model, "kvzip:budget=64")
    with pytest.raises(ValueError, match="not both"):
        Engine(model, blocks=4, max_bytes=10**6)
    with pytest.raises(ValueError, match="holds no block"):
        Engine(model, max_bytes=100)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Engine(model, max_batch_tokens=0)
    with pytest.raises(TypeError, match="transformers causal LM"):
        Engine(torch.nn.Linear(2, 2))
    model.train()
    try:
        with pytest.raises(UnsupportedOperation, match=r"model.eval\(\)"):
            Engine(model)
    finally:
        model.eval()


def test_max_bytes_sizes_the_pool(model):
    engine = Engine(model, block_size=8, max_bytes=10 * 2**20)
    assert engine.pool.nbytes <= 10 * 2**20 < engine.pool.nbytes + engine.pool.nbytes // engine.pool.total


# ---- other families -------------------------------------------------------------------------------------

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from families import build_model  # noqa: E402

SERVED = ["qwen2", "qwen3", "gemma", "smollm3", "olmo2", "granite", "glm", "cohere"]
REFUSED = {
    "bart": "differently from the row alone",
    "deepseek_v3": "multi-head latent attention",
    "jamba": "linear_attention layers",
    "gpt_neox": None,  # served or refused, never wrong
    "llama4_text": "attends in chunks",
}


@pytest.fixture(scope="module")
def family_models():
    return {}


def family(family_models, name):
    if name not in family_models:
        family_models[name] = build_model(name).eval()
    return family_models[name]


@pytest.mark.parametrize("name", SERVED)
def test_other_families_match_their_own_generate(family_models, name):
    model = family(family_models, name)
    prompts = [ids(3, 1), ids(9, 2), ids(9, 2)[:5] + ids(2, 3)]
    prompts = [[t % 100 + 3 for t in p] for p in prompts]
    engine = Engine(model, block_size=2, blocks=64, max_batch_tokens=8, max_seqs=3)
    handles = [engine.submit(p, max_new_tokens=4, eos_token_id=[]) for p in prompts]
    run_checked(engine)
    assert_all_match(model, prompts, handles, new=4)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_the_engine_cannot_serve_are_refused_by_name(family_models, name):
    model = family(family_models, name)
    match = REFUSED[name]
    if match is None:
        try:
            engine = Engine(model, block_size=2, blocks=32)
        except UnsupportedOperation:
            return
        prompt = [5, 9, 14, 3]
        handle = engine.submit(prompt, max_new_tokens=4, eos_token_id=[])
        run_checked(engine)
        same_or_near_tie(handle.result(), reference(model, prompt, 4))
        return
    with pytest.raises(UnsupportedOperation, match=match):
        Engine(model, block_size=2, blocks=32)


def test_a_sliding_window_model_serves_requests_within_its_window(family_models):
    model = family(family_models, "mistral")  # the tiny config's window: 4 tokens
    engine = Engine(model, block_size=2, blocks=16)
    handle = engine.submit([5, 6], max_new_tokens=3, eos_token_id=[])
    run_checked(engine)
    same_or_near_tie(handle.result(), reference(model, [5, 6], 3))
    with pytest.raises(UnsupportedOperation, match="sliding window of 4 tokens"):
        engine.submit([5, 6, 7], max_new_tokens=3)


def test_submit_does_not_wait_for_a_step_in_progress(model):
    """A step holds the engine lock for its whole forward pass; a submit from another thread queues
    its request without that lock (the next step takes it), so clients are not served one per step."""
    import threading

    engine = Engine(model, block_size=4, blocks=16, max_batch_tokens=64, max_seqs=4)
    handles = []
    with engine._lock:  # as a step in progress holds it
        submitter = threading.Thread(target=lambda: handles.append(engine.submit(ids(5, 60), max_new_tokens=2)))
        submitter.start()
        submitter.join(timeout=10)
        assert not submitter.is_alive() and len(handles) == 1, "submit waited for the engine lock"
        assert not engine.idle
    run_checked(engine)
    assert handles[0].result() == reference(model, ids(5, 60), 2)[0]


def sampled_reference(model, prompt: list[int], new: int, temperature: float, top_p: float, seed: int) -> list[int]:
    """Tokens of a plain loop: logits from a DynamicCache, each token drawn as ``sampling.py``
    says with a generator seeded by ``seed`` (the draw the engine must make for that request)."""
    from transformers import DynamicCache

    from kvcache.engine.sampling import Sampling, choose

    s = Sampling(temperature, top_p, seed)
    g = s.generator()
    cache, tokens = DynamicCache(config=model.config), list(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), **cache_kwargs(model, cache)).logits[0, -1:]
        for _ in range(new):
            tokens += choose(logits, [s], [g])
            logits = model(torch.tensor([tokens[-1:]]), **cache_kwargs(model, cache)).logits[0, -1:]
    return tokens[len(prompt) :]


def test_sampled_requests_draw_what_their_seed_draws_whatever_runs_beside_them(model):
    engine = Engine(model, block_size=4, blocks=64, max_batch_tokens=64, max_seqs=4)
    prompts = [ids(7, 70), ids(12, 71), ids(5, 72)]
    settings = [(1.0, 1.0, 1), (0.7, 0.9, 2), (0.0, 1.0, None)]
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[], temperature=t, top_p=tp, seed=sd)
               for p, (t, tp, sd) in zip(prompts, settings)]
    run_checked(engine)
    for p, (t, tp, sd), h in zip(prompts, settings, handles):
        expected = reference(model, p, NEW)[0] if t == 0 else sampled_reference(model, p, NEW, t, tp, sd)
        assert h.result() == expected
    again = Engine(model, block_size=4, blocks=64, max_batch_tokens=64, max_seqs=4)
    alone = again.submit(prompts[0], max_new_tokens=NEW, eos_token_id=[], temperature=1.0, seed=1)
    run_checked(again)
    assert alone.result() == handles[0].result(), "the same seed drew other tokens"


def test_a_tiny_top_p_keeps_only_the_top_token(model):
    engine = Engine(model, block_size=4, blocks=32, max_batch_tokens=64, max_seqs=2)
    handle = engine.submit(ids(9, 73), max_new_tokens=NEW, eos_token_id=[], temperature=2.0, top_p=1e-9)
    run_checked(engine)
    assert handle.result() == reference(model, ids(9, 73), NEW)[0]


@pytest.mark.parametrize("kw,match", [({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                                      ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed")])
def test_bad_sampling_is_refused_before_queueing(model, kw, match):
    engine = Engine(model, block_size=4, blocks=8)
    with pytest.raises(ValueError, match=match):
        engine.submit([5, 6], **kw)
    assert engine.idle


def test_on_update_is_told_of_each_token_and_of_the_end(model):
    engine = Engine(model, block_size=4, blocks=32, max_batch_tokens=64, max_seqs=2)
    seen = []
    handle = engine.submit(ids(6, 74), max_new_tokens=3, eos_token_id=[], on_update=lambda: seen.append(len(handle.tokens)))
    victim = engine.submit(ids(6, 75), max_new_tokens=9, eos_token_id=[], on_update=lambda: seen.append("victim"))
    engine.step()
    victim.cancel()
    run_checked(engine)
    assert seen == [1, "victim", "victim", 2, 3]
