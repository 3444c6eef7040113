"""The engine on a real pretrained model (SmolLM2-135M-Instruct, fp32): sixteen chat requests that
share a system prompt, with the pool sized so that they cannot all run at once, each against its
own greedy ``generate`` with ``DynamicCache`` (the near-tie rule of ``engine_reference.py``).

Not skipped when the model is missing: that is a failure naming the ModelUnavailableError.
Deselect with ``-m "not real_model"``.
"""

from __future__ import annotations

import pytest

from engine_reference import reference, same_or_near_tie
from kvcache import Engine
from kvcache.models import load

#: SmolLM2 through the engine, each request against its own generate (about 40 s): the slow lane's; the
#: engine against generate on tiny models (tests/engine/test_engine*.py) runs on every run.
pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SYSTEM = (
    "You are a concise assistant for a hardware shop. Answer in one sentence, name the aisle where the "
    "item is kept (aisles 1 to 9), and never invent prices. Tools are in aisles 1 to 3, paint in 4, garden "
    "supplies in 5 and 6, electrical parts in 7, plumbing in 8 and fasteners in 9."
)
QUESTIONS = [
    "Where are the hammers?", "Do you sell garden hoses?", "I need wood screws.", "Where is white paint?",
    "Light switches?", "A pipe wrench, please.", "Where are the shovels?", "Do you have extension cords?",
    "Nails for drywall?", "Where can I find a drill?", "Flower seeds?", "Copper pipe fittings?",
    "Paint brushes?", "Where are the saws?", "Light bulbs?", "Bolts and nuts?",
]
NEW = 12


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2", progress=True)


def chat(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_sixteen_chats_sharing_a_system_prompt_match_their_own_generate(smollm2):
    model, tokenizer = smollm2
    prompts = [list(chat(tokenizer, q)) for q in QUESTIONS]
    longest = max(len(p) for p in prompts) + NEW
    # Room for about ten requests at once: the rest wait, and some running ones are preempted.
    engine = Engine(model, block_size=16, blocks=10 * -(-longest // 16), max_batch_tokens=256, max_seqs=16)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0
    ties = sum(
        same_or_near_tie(h.result(), reference(model, p, NEW), q) for q, p, h in zip(QUESTIONS, prompts, handles)
    )
    assert ties <= 1
    shared = min(len(p) for p in prompts)
    reused = [h.stats.reused_pool for h in handles]
    assert reused[0] == 0 and min(reused[1:]) >= (shared // 16 - 1) * 16, reused


def test_sixteen_chats_over_int8_blocks_match_the_coded_reference(smollm2):
    """int8 blocks on the real model: each request against ``coded_reference`` (DynamicCache with
    the engine's storage rule applied by hand) in the chunks the engine ran it in."""
    from coded_reference import coded_reference
    from test_engine_coded import recorded_chunks, reference_chunks

    model, tokenizer = smollm2
    prompts = [list(chat(tokenizer, q)) for q in QUESTIONS]
    engine = Engine(model, "quantized:bits=8", block_size=16, blocks=256, max_batch_tokens=256, max_seqs=16)
    chunks = recorded_chunks(engine)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0 and engine.stats.preemptions == 0
    ties = sum(
        same_or_near_tie(h.result(), coded_reference(model, p, NEW, 16, 8, 64, reference_chunks(chunks[h.id])), q)
        for q, p, h in zip(QUESTIONS, prompts, handles)
    )
    assert ties <= 1
    assert min(h.stats.reused_pool for h in handles[1:]) > 0
