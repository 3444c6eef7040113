"""The synthetic retrieval tasks: seeded, exact lengths, needle where asked, scoring, split filler."""

import random
import re

import pytest

from kvcache.apps import tasks

LENGTHS = (256, 300, 1024, 2048)


def _instance(task, seed=0, length=512, depth=0.5, split="heldout"):
    return tasks.make_instance(task, seed, length=length, depth=depth, split=split)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_deterministic_per_seed(task):
    a, b = _instance(task, seed=7), _instance(task, seed=7)
    assert a == b and a.prompt == b.prompt and a.meta == b.meta
    others = {_instance(task, seed=s).prompt for s in range(1, 6)}
    assert a.prompt not in others and len(others) == 5
    assert _instance(task, seed=7, split="train").prompt != a.prompt


def test_content_is_pinned():
    """Same seed, same question on every machine: the content depends on the seed only."""
    assert tasks.passkey(0, length=256, depth=0.5).answer == tasks.passkey(0, length=2048, depth=0.0).answer
    assert tasks.passkey(0, length=256, depth=0.5).answer == " 60225"
    assert tasks.assoc_recall(0, length=512, depth=0.5).meta["queries"] == ["pxhz", "nvmx", "xzyn", "pxfe"]


@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_length_in_tokens(task, length):
    inst = _instance(task, seed=length, length=length, depth=0.3)
    assert inst.length == len(inst.prompt) == length
    assert len(inst.prompt.encode("utf-8")) == length  # ASCII: one byte token per character
    assert inst.prompt.isascii() and inst.answer.isascii()


QUESTION_MARKERS = {"passkey": "\nWhat is the pass key?", "assoc": "\nRecall:\n", "vartrack": "\nWhich variables"}


@pytest.mark.parametrize("task", tasks.TASKS)
def test_depth_places_the_needle(task):
    length = 1024
    starts = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        inst = _instance(task, seed=3, length=length, depth=depth)
        start, end = inst.needle
        question = inst.prompt.rfind(QUESTION_MARKERS[task])
        room = question - (end - start)  # all the filler, before and after the needle
        assert 0 < start + room and start == round(depth * room)
        starts.append(start)
    assert starts[0] == 0  # depth 0: the needle opens the prompt
    assert end == question  # depth 1: the needle ends where the question starts
    assert starts == sorted(starts) and len(set(starts)) == 5


def test_passkey_needle_and_answer():
    inst = tasks.passkey(11, length=700, depth=0.4)
    key = inst.meta["key"]
    assert re.fullmatch(r"\d{5}", key) and inst.answer == " " + key
    assert inst.prompt[slice(*inst.needle)] == f"\nThe pass key is {key}. Remember it.\n"
    assert inst.prompt.endswith("\nWhat is the pass key? The pass key is")
    assert inst.prompt.count(key) == 1


def test_assoc_recall_answers_come_from_the_pairs():
    inst = tasks.assoc_recall(5, length=800, depth=0.2, n_pairs=12, n_queries=5)
    pairs, queries = inst.meta["pairs"], inst.meta["queries"]
    block = inst.prompt[slice(*inst.needle)]
    assert len(pairs) == 12 and len(set(queries)) == 5 and set(queries) <= set(pairs)
    assert all(f"\n{k}: {v}\n" in block for k, v in pairs.items())
    assert inst.answer == " " + pairs[queries[-1]] and inst.prompt.endswith(f"\n{queries[-1]}:")
    # Every query's answer span, in order, holds that key's value; the last one is the answer.
    text = inst.text
    assert [text[a:b] for a, b in inst.spans] == [" " + pairs[k] for k in queries]
    assert inst.spans[-1] == (inst.length, len(text))


def test_var_tracking_chain_resolves_to_the_answer():
    inst = tasks.var_tracking(9, length=900, depth=0.6, hops=4, chains=3)
    env = {}
    for name, value in re.findall(r"^VAR ([A-Z]{3}) = (\w+)$", inst.prompt[slice(*inst.needle)], re.M):
        env[name] = env.get(value, value)
    target = inst.meta["value"]
    assert len(env) == 12
    assert inst.answer == " " + " ".join(n for n in env if env[n] == target)
    assert inst.answer.split() == inst.meta["chain"] and len(inst.meta["chain"]) == 4


def test_score():
    assert tasks.score(" 73914", " 73914")
    assert tasks.score(" 73914", "73914\nWhat is")
    assert tasks.score(" 73914", " 73914. Remember it."[:7])
    assert tasks.score(" 73914", " 73914.\n")
    assert tasks.score(" ABC DEF", " ABC DEF\n")
    assert not tasks.score(" 73914", " 7391")
    assert not tasks.score(" 73914", " 739145")
    assert not tasks.score(" 73914", " 73915")
    assert not tasks.score(" ABC DEF", " ABC DEF GHI")
    assert not tasks.score(" 481", "")
    assert not tasks.score(" 481", "\n481")


def test_train_and_heldout_filler_do_not_overlap():
    train, held = tasks.filler_files("train"), tasks.filler_files("heldout")
    assert train and held and not set(train) & set(held)
    assert 0.03 < len(held) / (len(train) + len(held)) < 0.2
    assert not any(re.search(r"(^|/)(site-packages|test|tests|idle_test|encodings)/", f) for f in train + held)
    train_text, held_text = tasks.filler_text("train"), tasks.filler_text("heldout")
    assert train_text.isascii() and held_text.isascii() and "\r" not in train_text
    rng = random.Random(0)
    for _ in range(20):
        chunk = tasks.filler(rng, 300, "heldout")
        if len(set(chunk.split("\n"))) > 8:  # skip boilerplate such as licence headers
            assert chunk in held_text and chunk not in train_text
    # A held-out instance's filler comes from held-out text only.
    inst = tasks.passkey(1, length=1500, depth=0.5, split="heldout")
    before = inst.prompt[: inst.needle[0]]
    assert before in held_text


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="too short"):
        tasks.passkey(0, length=40, depth=0.5)
    with pytest.raises(ValueError, match="depth"):
        tasks.passkey(0, length=512, depth=1.5)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_instance("nope", 0, length=512, depth=0.5)
    with pytest.raises(ValueError, match="split"):
        tasks.passkey(0, length=512, depth=0.5, split="test")
    with pytest.raises(ValueError, match="n_queries"):
        tasks.assoc_recall(0, length=512, depth=0.5, n_pairs=2, n_queries=3)
