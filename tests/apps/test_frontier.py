"""The quality-per-byte frontier (``apps/eval_frontier.py``): each fixed mix's spec allocates no
more than its byte budget (measured on a tiny model), the Pareto front and the report's arithmetic
on a result made by hand, and the CLI's refusals. (The run itself needs the real model and takes
minutes: ``kvcache eval --model smollm2 --frontier``.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvcache
from kvcache import cache_kwargs
from kvcache.apps import eval_frontier, frontier_points
from kvcache.apps.bench.common import can_plot
from kvcache.apps.cli import main

from helpers import model_for, prompt


@pytest.mark.parametrize("share", [0.5, 0.125, 0.0625])
@pytest.mark.parametrize("mix", frontier_points.mixes(frontier_points.EVICTION) + list(frontier_points.AUTO)
                         + ["snapkv/int4h", "adakv/int2h", "auto,codes=rotated", "auto-heads,codes=rotated",
                            "adakv/int8@0.25+int4", "snapkv/full@0.1+int2", "h2o/int8@0.5+int2",
                            "auto,fine_share=0.25", "auto-heads,fine_share=0.25"])
def test_each_point_allocates_within_its_byte_budget(mix, share):
    model = model_for("llama")
    g = frontier_points.geometry_of(model)
    tokens = 400
    spec = frontier_points.spec_for(mix, share, tokens, g)
    cache = kvcache.make_cache(model, spec)
    with torch.no_grad(), kvcache.use_kvcache_attention(model):
        model.generate(prompt(tokens), **cache_kwargs(model, cache), max_new_tokens=3, do_sample=False)
    fp32 = frontier_points.fp32_per_token(model, g)
    assert cache.nbytes <= share * fp32 * cache.kv_layers[0].seen, (spec, cache.nbytes / (fp32 * cache.kv_layers[0].seen))


def test_a_mix_that_affords_every_token_keeps_every_token():
    g = frontier_points.geometry_of(model_for("llama"))
    assert frontier_points.spec_for("snapkv/int4", 0.5, 300, g) == "snapkv:budget=300,storage=int4"
    assert frontier_points.spec_for("full", None, 300, g, room=5) == "static:capacity=305"
    assert frontier_points.spec_for("auto", 0.125, 300, g) == "auto:bytes=0.125"
    assert frontier_points.spec_for("auto-heads", 0.125, 300, g) == "auto-heads:bytes=0.125"
    assert frontier_points.spec_for("adakv/int8@0.25+int4", 0.5, 300, g) == "adakv:budget=300,storage=int4,fine=int8,fine_share=0.25"


def line(point, budget, b, acc):
    return {"point": point, "budget": budget, "bytes": b, "accuracy": acc}


def test_the_pareto_front_keeps_what_nothing_beats():
    lines = [line("a", 0.5, 0.5, 0.9), line("b", 0.25, 0.2, 0.9), line("c", 0.25, 0.25, 0.8), line("d", 0.1, 0.1, 0.5), line("e", 0.1, 0.1, 0.5)]
    front = {l["point"] for l in lines if id(l) in eval_frontier.pareto(lines)}
    assert front == {"b", "d", "e"}  # a: b finds as many in fewer bytes; c: b is better and smaller; d, e tie


def test_the_report_counts_answers_bytes_and_the_best_fixed_mix():
    fp32 = 1000
    runs = []
    for point, budget, per_token, found in [("full", None, 1000, [1, 1, 1, 0]), ("auto", 0.25, 240, [1, 1, 0, 0]),
                                            ("snapkv/full", 0.25, 245, [1, 0, 0, 0]), ("snapkv/int4", 0.25, 180, [1, 1, 1, 0]),
                                            ("h2o/int8", 0.25, 260, [1, 1, 1, 1])]:  # fmt: skip
        for i, hit in enumerate(found):
            runs.append({"cache": point, "budget": budget, "length": 1024 * (1 + i % 2), "depth": (0.1, 0.9)[i // 2],
                         "correct": bool(hit), "bytes_per_token": per_token, "storages": {"int4": 2} if point == "auto" else None})  # fmt: skip
    result = {"config": {"fp32_bytes_per_token": fp32, "budgets": [0.25], "lengths": [1024, 2048], "depths": [0.1, 0.9]}, "runs": runs,
              "text": [{"cache": "auto", "budget": 0.25, "kl": 0.5, "top1": 0.75}]}  # fmt: skip
    lines = {l["point"]: l for l in eval_frontier.points_of(result)}
    assert lines["auto"]["accuracy"] == 0.5 and lines["auto"]["bytes"] == pytest.approx(0.24)
    assert lines["auto"]["by_depth"] == {0.1: 1.0, 0.9: 0.0} and lines["auto"]["mix"] == {"int4": 8}
    assert lines["auto"]["kl"] == 0.5 and math.isnan(lines["full"]["kl"])
    table = eval_frontier.budget_table(list(lines.values()), [0.25])
    # h2o/int8 found more but took 0.26 of fp32, over the budget: the best within it is snapkv/int4.
    assert "| 0.25 | 50% | 0.240 | int4 8 | snapkv/int4 | 75% | 0.180 | 25% | 75% |" in table
    assert {p for p, l in lines.items() if l["pareto"]} == {"snapkv/int4", "h2o/int8"}


@pytest.mark.parametrize("argv,message", [(["eval", "--frontier"], "applies to a real model"),
                                          (["eval", "--model", "smollm2", "--frontier", "--reuse", "h2o"], "--reuse does not apply"),
                                          (["eval", "--model", "smollm2", "--frontier", "--caches", "window"], "unknown kind"),
                                          (["eval", "--model", "smollm2", "--frontier", "--tasks", "needles"], "unknown task family(ies) needles"),
                                          (["eval", "--model", "smollm2", "--frontier", "--split", "tuned"], "--split applies to --tasks"),
                                          (["eval", "--model", "smollm2", "--tasks", "turn"], "--tasks applies to --frontier"),
                                          (["eval", "--model", "smollm2", "--autos", "auto"], "--autos applies to --frontier"),
                                          (["eval", "--model", "smollm2", "--frontier", "--autos", "auto;snapkv"],
                                           "--autos: auto point 'snapkv': the kind must be one of"),
                                          (["eval", "--model", "smollm2", "--frontier", "--autos", "auto-heads,drop=2,margin=0.1"],
                                           "drop=2 compares by distortion"),
                                          (["eval", "--model", "smollm2", "--frontier", "--autos", "auto,nope=1"], "unknown option 'nope'"),
                                          (["eval", "--model", "smollm2", "--frontier", "--autos", ";"], "no auto points given"),
                                          (["eval", "--model", "smollm2", "--frontier", "--autos", "auto", "--merge", "x"],
                                           "--merge runs nothing: give one"),
                                          (["eval", "--model", "smollm2", "--storages", "int4"], "--storages applies to --frontier"),
                                          (["eval", "--model", "smollm2", "--frontier", "--storages", "int4,int3"], "unknown slot storage 'int3'"),
                                          (["eval", "--model", "smollm2", "--frontier", "--storages", "int4@0.5+int8"],
                                           "int4 must be finer than int8"),
                                          (["eval", "--model", "smollm2", "--frontier", "--storages", "int8@half+int4"],
                                           "write it fine@share+coarse"),
                                          (["eval", "--model", "smollm2", "--frontier", "--storages", "int8@1+int4"],
                                           "the fine share must be in (0, 1)")])  # fmt: skip
def test_the_cli_refuses_what_the_frontier_does_not_take(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def result_of(runs, seeds, lengths=(1024,)):
    config = {"model": "m", "questions_per_context": 1, "depths": [0.1, 0.9], "budgets": [0.25], "kinds": ["snapkv"], "storages": ["full"],
              "fp32_bytes_per_token": 1000, "answer_tokens": 8, "text_steps": 4, "lengths": list(lengths),
              "contexts": {str(L): list(seeds) for L in lengths}}  # fmt: skip
    return {"suite": "frontier", "config": config, "runs": runs, "text": []}


def answer(point, budget, context, door, correct, length=1024, per_token=1000):
    return {"cache": point, "budget": budget, "length": length, "context": context, "door": door, "depth": 0.1,
            "correct": correct, "bytes_per_token": per_token, "storages": None}  # fmt: skip


def test_merge_joins_runs_of_other_contexts_and_lengths_and_refuses_a_context_twice():
    a = result_of([answer("full", None, 0, "red", True)], [0, 1])
    b = result_of([answer("full", None, 2, "red", False)], [2])
    c = result_of([answer("full", None, 0, "red", True, length=2048)], [0], lengths=(2048,))
    merged = eval_frontier.merge([a, b, c])
    assert merged["config"]["lengths"] == [1024, 2048] and merged["config"]["contexts"] == {"1024": [0, 1, 2], "2048": [0]}
    assert len(merged["runs"]) == 3
    with pytest.raises(ValueError, match=r"contexts \[0, 1\] at 1024 tokens are in two runs"):
        eval_frontier.merge([a, a])
    other = result_of([], [5])
    other["config"]["budgets"] = [0.5]
    with pytest.raises(ValueError, match="differ in budgets"):
        eval_frontier.merge([a, other])


def test_an_older_result_that_counts_its_contexts_merges_as_seeds_from_zero():
    old = result_of([], [])
    old["config"]["contexts"] = 2
    assert eval_frontier.merge([old, result_of([], [2])])["config"]["contexts"] == {"1024": [0, 1, 2]}


def test_the_paired_difference_counts_only_questions_both_answered():
    runs = [answer("full", None, c, d, True) for c in range(2) for d in ("red", "blue")]
    runs += [answer("auto", 0.25, 0, "red", True), answer("auto", 0.25, 0, "blue", False), answer("auto", 0.25, 1, "red", True),
             answer("auto", 0.25, 1, "blue", True), answer("auto", 0.25, 9, "red", False)]  # fmt: skip
    diff, half, n = eval_frontier.paired_difference(runs, ("auto", 0.25), ("full", None))
    # d = 0, -1, 0, 0: mean -0.25, sample sd 0.5, half-width 1.96 * 0.5 / 2
    assert n == 4 and diff == pytest.approx(-0.25) and half == pytest.approx(1.96 * 0.25)


def test_the_length_table_reports_auto_against_the_full_cache_at_each_length():
    runs = [answer("full", None, c, "red", True, length=L) for c in range(4) for L in (1024, 2048)]
    runs += [answer("auto", 0.25, c, "red", c != 0, length=1024, per_token=200 + c) for c in range(4)]
    runs += [answer("auto", 0.25, c, "red", True, length=2048, per_token=250) for c in range(4)]
    runs += [answer("snapkv/full", 0.25, c, "red", c < 2, length=L, per_token=240) for c in range(4) for L in (1024, 2048)]
    table = eval_frontier.length_table(result_of(runs, range(4), lengths=(1024, 2048)))
    # auto - snapkv/full at 1024: d = -1, 0, 1, 1 (mean 0.25, sample sd 0.957)
    assert ("| 1024 | 0.25 | 75% | -25.0 ± 49.0 pts | 75% (depth 0.1) | 0.202 / 0.203 | snapkv/full (0.240) | 50% "
            "| +25.0 ± 93.8 pts | - | - | 50% | - | 100% | 4 |") in table
    assert "| 2048 | 0.25 | 100% | +0.0 ± 0.0 pts |" in table


def test_the_cli_merges_frontier_folders(tmp_path, capsys):
    for name, seeds, length in (("a", [0], 1024), ("b", [1], 1024), ("c", [0], 2048)):
        (tmp_path / name).mkdir()
        runs = [answer("full", None, seeds[0], "red", True, length=length), answer("auto", 0.25, seeds[0], "red", True, length=length, per_token=200)]
        (tmp_path / name / "frontier.json").write_text(json.dumps(result_of(runs, seeds, lengths=(length,))))
    out = tmp_path / "all"
    folders = ",".join(str(tmp_path / n) for n in "abc")
    assert main(["eval", "--model", "smollm2", "--frontier", "--merge", folders, "--out", str(out), "--no-progress"]) == 0
    report = (out / "frontier.md").read_text()
    assert "| 1024 | 0.25 | 100% | +0.0 ± 0.0 pts |" in report and "| 2048 | 0.25 | 100% |" in report
    assert "contexts per length: 2 at 1024, 1 at 2048" in report
    if can_plot():
        assert (out / "frontier.png").stat().st_size > 0  # one panel per length
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["eval", "--model", "smollm2", "--frontier", "--merge", str(tmp_path / "bad.json"), "--no-progress"]) == 2
    assert "is not a frontier result" in capsys.readouterr().err


def test_merge_and_first_context_apply_only_to_the_frontier(capsys):
    assert main(["eval", "--model", "smollm2", "--merge", "x"]) == 2
    assert "--merge applies to --frontier" in capsys.readouterr().err
    assert main(["eval", "--first-context", "3"]) == 2
    assert "--first-context applies to --frontier" in capsys.readouterr().err


def test_a_family_table_per_task_family(tmp_path):
    runs = [{**answer("full", None, c, f, True), "family": f} for c in range(2) for f in ("turn", "kv-lookup")]
    runs += [{**answer("auto", 0.25, c, f, f == "turn", per_token=200), "family": f} for c in range(2) for f in ("turn", "kv-lookup")]
    result = result_of(runs, range(2))
    result["config"].update(tasks=["turn", "kv-lookup"], split="held-out")
    eval_frontier.write(result, tmp_path)
    report = (tmp_path / "frontier.md").read_text()
    turn, lookup = report.split("## turn")[1].split("## kv-lookup")
    assert "| 1024 | 0.25 | 100% | +0.0 ± 0.0 pts |" in turn
    assert "| 1024 | 0.25 | 0% | -100.0 ± 0.0 pts |" in lookup.split("## All")[0]
    assert "| 1024 | 0.25 | 50% | -50.0 ± " in report.split("## All families together")[1]
    assert [title for title, _ in eval_frontier.panels_of(result)] == ["all families, 1024 tokens", "turn, 1024 tokens", "kv-lookup, 1024 tokens"]


@pytest.mark.real_model
@pytest.mark.slow  # a frontier run on SmolLM2 (about 25 s); its report code is checked above on results made by hand
def test_the_family_frontier_answers_as_generate_does(tmp_path):
    """A family item through the frontier's recorded pass and compression: the full cache's answer is
    ``generate``'s with Hugging Face's own cache, and every row is scored by the family's rule."""
    from kvcache.apps import families
    from kvcache.apps.run_options import RunOptions
    from kvcache.models import load

    result = eval_frontier.run(RunOptions(tiny=True, progress=False, out=tmp_path), tasks=("needle-digits", "turn"),
                               kinds=("snapkv",), budgets=(0.25,), split="tuned", storages=("full", "int4h"),
                               autos=("auto", "auto-heads,tolerance=0.3,margin=0.01"))  # fmt: skip
    assert {(r["family"], r["split"]) for r in result["runs"]} == {("needle-digits", "tuned"), ("turn", "tuned")}
    assert {r["cache"] for r in result["runs"]} == {"full", "auto", "auto-heads,tolerance=0.3,margin=0.01", "snapkv/full", "snapkv/int4h"}
    assert result["config"]["storages"] == ["full", "int4h"]
    model, tokenizer = load("smollm2", progress=False)
    for family in ("needle-digits", "turn"):
        item = families.make_item(tokenizer, family, 384, 0, "tuned")
        with torch.no_grad():
            out = model.generate(torch.tensor([item.prompt_ids]), max_new_tokens=frontier_points.FAMILY_ANSWER_TOKENS, do_sample=False)
        expected = tokenizer.decode(out[0, len(item.prompt_ids) :], skip_special_tokens=True)
        (full,) = [r for r in result["runs"] if r["family"] == family and r["cache"] == "full"]
        assert expected.strip() and full["answer"].startswith(expected.strip())  # (generate stops at the end of the turn)
        for r in result["runs"]:
            if r["family"] == family:
                assert r["correct"] == families.score(item, r["answer"])
    assert "## needle-digits" in (tmp_path / "frontier.md").read_text()
