"""``kvcache eval --model smollm2 --plain`` (``apps/eval_plain.py``): the plan, the degeneration
rule, the verdicts' arithmetic on results made by hand, the CLI's refusals, and a tiny real run."""

from __future__ import annotations

import pytest

from kvcache.apps import eval_plain
from kvcache.apps.cli import main


def test_degenerate_means_one_token_repeated_to_the_end():
    assert eval_plain.degenerate([5, 1, 1, 1, 1, 1, 1, 1, 1])
    assert not eval_plain.degenerate([1, 1, 1, 1, 1, 1, 1, 2])
    assert not eval_plain.degenerate([1, 1, 1])  # too short to tell


def test_plan_puts_the_reference_first_and_budgets_only_bounded_kinds():
    assert eval_plain.plan(("h2o", "quantized-int4", "growable"), (0.5, 0.25)) == [
        ("growable", None), ("h2o", 0.5), ("h2o", 0.25), ("quantized-int4", None)]
    with pytest.raises(ValueError, match="unknown kind.*bogus"):
        eval_plain.plan(("bogus",), (0.5,))


def test_specs_are_the_documented_ones():
    assert eval_plain.spec_of("kvzip", 0.5, 2000) == "kvzip:budget=0.5,queries=prompt"
    assert eval_plain.spec_of("window", 0.5, 2000) == "window:window=996,sinks=4"
    assert eval_plain.spec_of("static", None, 2000) == f"static:capacity={2000 + eval_plain.NEW_TOKENS}"
    assert eval_plain.spec_of("auto", 0.25, 2000) == "auto:bytes=0.25"


def test_position_kinds_are_judged_on_needles_inside_what_they_keep():
    assert eval_plain.judged("window", 0.5, 0.9) and not eval_plain.judged("window", 0.5, 0.5)
    assert eval_plain.judged("h2o", 0.5, 0.1)


def _row(cache, budget, context, depth, found, degenerate=False):
    return {"cache": cache, "budget": budget, "spec": f"{cache}:{budget}", "context": context, "depth": depth,
            "found": found, "degenerate": degenerate, "bytes": 100}


def _result(rows):
    return {"config": {"margin": 0.25, "checked": 0.5}, "runs": rows}


def test_verdicts_fail_a_kind_far_below_the_full_cache_or_degenerating():
    depths = [0.1, 0.5, 0.9, 0.1]
    rows = [_row("growable", None, c, d, True) for c, d in enumerate(depths)]
    rows += [_row("h2o", 0.5, c, d, c < 3) for c, d in enumerate(depths)]  # 75%: within 25 points
    rows += [_row("kvzip", 0.5, c, d, False, degenerate=True) for c, d in enumerate(depths)]
    rows += [_row("tova", 0.5, c, d, c == 0) for c, d in enumerate(depths)]  # 25%
    rows += [_row("tova", 0.25, c, d, False) for c, d in enumerate(depths)]  # reported, not judged
    rows += [_row("window", 0.5, c, d, d == 0.9) for c, d in enumerate(depths)]  # finds all it keeps
    got = {(v["cache"], v["budget"]): v for v in eval_plain.verdicts(_result(rows))}
    assert got[("h2o", 0.5)]["ok"] and got[("window", 0.5)]["ok"]
    assert got[("window", 0.5)]["judged"] == 1 and got[("window", 0.5)]["all"] == 0.25
    assert "degenerate" in got[("kvzip", 0.5)]["reason"] and "found" in got[("kvzip", 0.5)]["reason"]
    assert not got[("tova", 0.5)]["ok"] and "25% found against the full cache's 100%" in got[("tova", 0.5)]["reason"]
    assert got[("tova", 0.25)]["ok"] and not got[("tova", 0.25)]["checked"]
    assert eval_plain.failures(_result(rows) | {"verdicts": list(got.values())}) == [
        "kvzip:0.5: " + got[("kvzip", 0.5)]["reason"], "tova:0.5: " + got[("tova", 0.5)]["reason"]]


def test_a_kind_that_fails_one_needle_set_or_way_of_asking_fails():
    """Over 10 prompts a part, a kind that finds every primed key but 6 of 10 chat ones: 80% in all
    is within 25 points, the chat part is not."""
    rows = []
    for ask in ("primed", "chat"):
        for c in range(10):
            rows.append(_row("growable", None, c, 0.5, True) | {"set": "doors", "ask": ask, "digits": 1.0})
            found = ask == "primed" or c < 6
            rows.append(_row("kvzip", 0.5, c, 0.5, found) | {"set": "doors", "ask": ask, "digits": 1.0 if found else 0.6})
    (kvzip,) = [v for v in eval_plain.verdicts(_result(rows)) if v["cache"] == "kvzip"]
    assert kvzip["accuracy"] == 0.8 and kvzip["by_prompt"]["doors/chat"]["accuracy"] == 0.6
    assert not kvzip["ok"] and kvzip["reason"] == "doors/chat: 60% found against the full cache's 100%"
    assert kvzip["digits"] == pytest.approx(0.92)
    few = [r for r in rows if r["context"] < 5]  # 5 prompts a part: too few to judge a part alone
    (kvzip,) = [v for v in eval_plain.verdicts(_result(few)) if v["cache"] == "kvzip"]
    assert kvzip["ok"]
    assert "| doors/primed | doors/chat |" in eval_plain.table(_result(rows) | {"verdicts": eval_plain.verdicts(_result(rows))})


@pytest.mark.parametrize(("args", "words"), [
    (["--frontier"], "two different runs"),
    (["--lengths", "1024,2048"], "one length"),
    (["--reuse", "h2o"], "does not apply to --plain"),
    (["--caches", "bogus"], "unknown kind"),
])
def test_the_cli_refuses_what_plain_does_not_take(capsys, args, words):
    assert main(["eval", "--model", "smollm2", "--plain", *args, "--no-progress"]) != 0
    assert words in capsys.readouterr().err


def test_plain_is_refused_for_the_tiny_model(capsys):
    assert main(["eval", "--plain", "--no-progress"]) != 0
    assert "applies to a real model" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.slow  # SmolLM2 end to end (about 12 s); the plan, the verdicts and the refusals are checked above
def test_a_tiny_plain_run_on_smollm2_writes_its_report(tmp_path):
    from kvcache.apps.eval_plain import _prompt
    from kvcache.apps.run_options import RunOptions

    kinds = ("growable", "kvzip", "kvzip-context", "quantized-int4")
    result = eval_plain.run(RunOptions(tiny=True, out=tmp_path, progress=False), kinds=kinds)
    assert [(v["cache"], v["budget"]) for v in result["verdicts"]] == [("growable", None), ("kvzip", 0.5), ("kvzip-context", 0.5), ("quantized-int4", None)]
    for r in result["runs"]:
        assert r["prompt_tokens"] <= 384 and not r["degenerate"], r
    full = {_prompt(r): r["bytes"] for r in result["runs"] if r["cache"] == "growable"}
    for r in result["runs"]:
        if r["cache"] == "kvzip-context":  # half the context, plus the room for the question and answer
            assert r["bytes"] < 0.8 * full[_prompt(r)], r
    assert (tmp_path / "plain.json").exists() and "| kvzip | 50% |" in (tmp_path / "plain.md").read_text()
