"""Needles in prose for a real tokenizer (``apps/needles.py``) and the real-model harness's
bookkeeping (``apps/eval_real*.py``): where the needles sit, what the questions ask, how the two
passes' weights add up to the prompt's, and the report's arithmetic on a result made by hand."""

from __future__ import annotations

import json

import pytest
import torch

from kvcache.apps import eval_real, eval_real_plan, eval_real_report, needles


def test_paragraphs_read_as_prose_and_splits_do_not_share_any():
    train, heldout = needles.paragraphs("train"), needles.paragraphs("heldout")
    assert len(train) > 500 and len(heldout) > 50
    assert not set(train) & set(heldout)
    for p in train[:200]:
        assert 120 <= len(p) <= 800 and ">>>" not in p and p[0].isupper()


def test_the_reference_prose_is_another_text():
    reference = needles.reference_paragraphs()
    assert len(reference) > 300
    assert not set(reference) & (set(needles.paragraphs("train")) | set(needles.paragraphs("heldout")))


def test_digits_right_is_partial_credit_in_place():
    assert needles.digits_right("55454", "The key is 5545.") == 0.8
    assert needles.digits_right("55454", " 55454.") == 1.0
    assert needles.digits_right("75716", "729") == 0.2 and needles.digits_right("75716", "none") == 0.0


def test_answer_of_takes_the_first_number():
    assert needles.answer_of(" 39539.") == "39539"
    assert needles.answer_of(" is 12 or 13") == "12"
    assert needles.answer_of(" ...") is None


@pytest.mark.real_model
@pytest.mark.parametrize("length,seed,count", [(1024, 0, 3), (2048, 4, 3), (1024, 5, 1)])
def test_contexts_hold_their_needles_at_their_depths(length, seed, count):
    from kvcache.models import load

    _, tokenizer = load("smollm2", progress=False)
    ctx = needles.make_context(tokenizer, length, seed, count=count)
    assert len(ctx.prefix_ids) + max(len(q.ids) for q in ctx.questions) + eval_real_plan.ANSWER_TOKENS <= length
    assert len(ctx.prefix_ids) > 0.8 * length
    doc = ctx.prefix_ids[ctx.document :]
    assert tokenizer.decode(doc).startswith("<document>") and tokenizer.decode(doc).endswith("</document>")
    assert len({q.door for q in ctx.questions}) == len(ctx.questions) == count
    assert [q.depth for q in ctx.questions] == (list(needles.DEPTHS) if count == 3 else [needles.DEPTHS[seed % 3]])
    for q in ctx.questions:
        span = eval_real.needle_span(ctx.prefix_ids, tokenizer(" " + q.key, add_special_tokens=False)["input_ids"])
        assert span is not None
        where = (span[0] - ctx.document) / len(doc)
        assert abs(where - q.depth) < 0.1, (q.depth, where)
        assert tokenizer.decode(q.ids).rstrip().endswith(f"The pass key for the {q.door} door:")
    # The same seed at another length asks the same questions.
    again = needles.make_context(tokenizer, length + 512, seed, count=count)
    assert [(q.door, q.key) for q in again.questions] == [(q.door, q.key) for q in ctx.questions]


def test_prompt_weights_add_the_documents_pass_to_the_questions():
    """sum: both passes; last: the question's; a window longer than the question takes the
    document's last rows for the rest."""
    doc = {"sum": [torch.ones(1, 2, 5)], "window:3": [torch.full((1, 2, 5), 2.0)]}
    question = {"sum": [torch.ones(1, 2, 7)], "last": [torch.full((1, 2, 7), 3.0)], "window:5": [torch.ones(1, 2, 7)]}
    out = eval_real.prompt_weights(doc, question, q_len=2)
    assert torch.equal(out["sum"][0], torch.tensor([2.0] * 5 + [1.0] * 2).expand(1, 2, 7))
    assert torch.equal(out["last"][0], question["last"][0])
    assert torch.equal(out["window:5"][0], torch.tensor([3.0] * 5 + [1.0] * 2).expand(1, 2, 7))


def test_prompt_weights_put_the_documents_last_query_rows_before_the_questions():
    """``queries:N`` longer than the question: the document pass's last N - q rows, then the
    question's, as one pass over the whole prompt would report them."""
    rows = torch.arange(2 * 3 * 7 * 4, dtype=torch.float32).reshape(1, 2, 3, 7, 4)  # a whole prompt's query rows
    doc = {"queries:3": [rows[:, :, :, 2:5]]}
    question = {"queries:5": [rows[:, :, :, 5:7]], "queries:2": [rows[:, :, :, 5:7]]}
    out = eval_real.prompt_weights(doc, question, q_len=2)
    assert torch.equal(out["queries:5"][0], rows[:, :, :, 2:7])
    assert torch.equal(out["queries:2"][0], rows[:, :, :, 5:7])


def test_runs_cover_every_kind_budget_and_mode():
    plan = eval_real_plan.runs_for(("h2o", "kvzip", "quantized-int4"), ("h2o",), (0.5, 0.25))
    assert plan[0] == ("full", "question", None)
    assert ("h2o", "question", 0.25) in plan and ("h2o", "context", 0.5) in plan
    assert ("kvzip", "context", 0.5) in plan and ("kvzip", "question", 0.5) not in plan
    assert ("quantized-int4", "question", None) in plan
    with pytest.raises(ValueError, match="unknown cache kind 'nope'"):
        eval_real_plan.runs_for(("nope",), (), (0.5,))


def test_summary_averages_depths_per_length_and_reads_text_rows():
    runs = [
        {"length": 1024, "depth": d, "cache": "h2o", "mode": "question", "budget": 0.5, "correct": ok, "bytes_per_token": 10.0}
        for d, ok in ((0.1, False), (0.5, True), (0.9, True), (0.9, True))
    ]
    result = {"runs": runs, "text": [{"cache": "h2o", "budget": 0.5, "kl": 0.2, "top1": 0.9}],
              "config": {"lengths": [1024], "depths": [0.1, 0.5, 0.9]}}
    (line,) = eval_real_report.summary(result)
    assert line["by_depth"] == {0.1: 0.0, 0.5: 1.0, 0.9: 1.0}
    assert line["by_length"][1024] == pytest.approx(2 / 3)  # depths weigh alike
    assert line["accuracy"] == 0.75 and line["kl"] == 0.2 and line["top1"] == 0.9
    assert "| h2o | 50% | with question | 67% | 0% | 100% | 100% | 75% | - |" in eval_real_report.table(result)


@pytest.mark.real_model
@pytest.mark.slow  # SmolLM2 end to end (about 8 s); the README's `eval --model smollm2` runs the same harness in CI
def test_real_eval_runs_every_kind_and_writes_its_report(tmp_path):
    """A tiny run of the harness on SmolLM2: one row per run and question, budgets that hold
    (kept slots within the budget: bytes per token at most the budget's share of the full
    cache's, plus bookkeeping), KVzip only once-and-reused, and the report files."""
    from kvcache.apps.run_options import RunOptions

    result = eval_real.run(
        RunOptions(tiny=True, out=tmp_path, progress=False),
        kinds=("h2o", "kvzip", "quantized-int4"),
        context_kinds=("h2o",),
        lengths=(384,),
        contexts=1,
    )
    got = {(r["cache"], r["mode"], r["budget"]) for r in result["runs"]}
    assert got == set(eval_real_plan.runs_for(("h2o", "kvzip", "quantized-int4"), ("h2o",), (0.5,)))
    full = next(r for r in result["runs"] if r["cache"] == "full")
    for r in result["runs"]:
        if r["budget"] is not None:
            # Half the document kept, plus the answer's tokens and each slot's position and score.
            assert r["bytes_per_token"] < 0.7 * full["bytes_per_token"], r
    assert {t["cache"] for t in result["text"]} == {"full", "h2o", "kvzip", "quantized-int4"}
    assert (tmp_path / "eval.json").exists() and "| full |" in (tmp_path / "eval.md").read_text()


def test_paragraphs_are_kept_on_disk_and_read_back_unchanged(tmp_path, monkeypatch):
    """The first read parses and keeps the paragraphs under ``$KVCACHE_HOME/prose``; the next reads
    them back (nothing parsed) equal to a parse, and a file that is not a list of prose paragraphs
    (damaged, or written by hand) is parsed again and replaced."""
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    parsed = needles._parse("heldout")
    needles._paragraphs_of.cache_clear()
    try:
        assert needles._paragraphs_of("heldout") == parsed
        (kept,) = (tmp_path / "prose").glob("heldout-*.json")
        needles._paragraphs_of.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(needles, "_parse", lambda split: pytest.fail("parsed again"))
            assert needles._paragraphs_of("heldout") == parsed
        for damaged in ("[1, 2", '{"a": 1}', '["too short"]'):
            kept.write_text(damaged)
            needles._paragraphs_of.cache_clear()
            assert needles._paragraphs_of("heldout") == parsed
            assert tuple(json.loads(kept.read_text())) == parsed
    finally:
        needles._paragraphs_of.cache_clear()


@pytest.mark.real_model
@pytest.mark.parametrize("needle_set", list(needles.SETS))
def test_every_needle_set_asks_primed_and_as_a_chat_question(needle_set):
    from kvcache.models import load

    _, tokenizer = load("smollm2", progress=False)
    kind = needles.SETS[needle_set]
    ctx = needles.make_context(tokenizer, 1024, 4, split="heldout", needle_set=needle_set)
    (q,) = ctx.questions
    text = tokenizer.decode(ctx.prefix_ids)
    assert kind.needle.format(door=q.door, key=q.key) in text
    primed, chat = tokenizer.decode(q.asked("primed")), tokenizer.decode(q.asked("chat"))
    assert primed.rstrip().endswith(kind.answer.format(door=q.door)) and primed.startswith(chat)
    assert chat.rstrip().endswith("assistant") and kind.question.format(door=q.door) in chat
    assert len(ctx.prefix_ids) + len(q.ids) <= 1024
    with pytest.raises(ValueError, match="one of primed, chat"):
        q.asked("shouted")
    if not kind.doors:
        with pytest.raises(ValueError, match="one needle a context"):
            needles.make_context(tokenizer, 1024, 4, count=3, needle_set=needle_set)
    with pytest.raises(ValueError, match="unknown needle set"):
        needles.make_context(tokenizer, 1024, 4, needle_set="licences")
