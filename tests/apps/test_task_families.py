"""Task families for quality per byte (``apps/families.py``): each item holds its answer where it
says, its two splits share no phrasing, prose file or seed, items are reproducible, and ``score``
takes exactly the answer."""

from __future__ import annotations

import pytest

from kvcache.apps import families, needles


def test_the_splits_share_no_phrasing():
    tuned = {part for phrase in families.PHRASES["tuned"] for part in phrase}
    held = {part for phrase in families.PHRASES["held-out"] for part in phrase}
    assert not tuned & held
    assert not set(needles.paragraphs("train")) & set(needles.paragraphs("heldout"))  # the prose files


def item(family="needle-digits", answer="12345"):
    return families.Item(family, "tuned", 0, 1024, [], 0, answer, 0.5)


def test_score_takes_the_answer_and_nothing_else():
    assert families.score(item(), "12345.")
    assert families.score(item(answer="maple delta"), " Maple, Delta!\nmore")
    assert not families.score(item(), "1234")
    assert not families.score(item(), "Sure.\n12345")  # only the first line counts for one key
    multi = item("multi-key", "11111 22222")
    assert families.score(multi, ":\n- first: 11111\n- second: 22222")
    assert not families.score(multi, "11111 and 33333")


def test_bad_families_and_splits_are_refused():
    with pytest.raises(ValueError, match="unknown task family 'needle'"):
        families.make_item(None, "needle", 1024, 0, "tuned")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        families.make_item(None, "turn", 1024, 0, "test")


@pytest.mark.real_model
@pytest.mark.parametrize("family", families.FAMILIES)
@pytest.mark.parametrize("split", families.SPLITS)
def test_items_hold_their_answer_within_their_length(family, split):
    from kvcache.models import load

    _, tokenizer = load("smollm2", progress=False)
    a, b = (families.make_item(tokenizer, family, 1024, seed, split) for seed in (3, 3))
    assert a == b  # reproducible
    text = tokenizer.decode(a.prompt_ids)
    for part in a.answer.split() if family in ("multi-key", "needle-words") else [a.answer]:
        assert text.count(part) >= 1, (part, family)
    assert 0.6 * 1024 < len(a.prompt_ids) <= 1024
    at = text.index(a.answer.split()[0]) / len(text)
    if family not in ("multi-key",):
        assert abs(at - a.depth) < 0.25, (at, a.depth)
    ctx = families.as_context(a)
    (question,) = ctx.questions
    assert ctx.prefix_ids + question.ids == a.prompt_ids
    assert "Answer with the value only." in tokenizer.decode(question.ids)
    assert "Answer with" not in tokenizer.decode(ctx.prefix_ids) and len(question.ids) < 80
    other = families.make_item(tokenizer, family, 1024, 3, families.SPLITS[split == "tuned"])
    assert other.seed != a.seed and other.prompt_ids != a.prompt_ids
