"""The quality-per-byte frontier (``apps/eval_frontier.py``): each fixed mix's spec allocates no
more than its byte budget (measured on a tiny model), the Pareto front and the report's arithmetic
on a result made by hand, and the CLI's refusals. (The run itself needs the real model and takes
minutes: ``kvcache eval --model smollm2 --frontier``.)"""

from __future__ import annotations

import math

import pytest
import torch

import kvcache
from kvcache.apps import eval_frontier
from kvcache.apps.cli import main

from helpers import model_for, prompt


@pytest.mark.parametrize("share", [0.5, 0.125, 0.0625])
@pytest.mark.parametrize("mix", eval_frontier.mixes(eval_frontier.EVICTION) + ["auto"])
def test_each_point_allocates_within_its_byte_budget(mix, share):
    model = model_for("llama")
    g = eval_frontier.geometry_of(model)
    tokens = 400
    spec = eval_frontier.spec_for(mix, share, tokens, g)
    cache = kvcache.make_cache(model, spec)
    with torch.no_grad(), kvcache.use_kvcache_attention(model):
        model.generate(prompt(tokens), past_key_values=cache, max_new_tokens=3, do_sample=False)
    fp32 = eval_frontier.fp32_per_token(model, g)
    assert cache.nbytes <= share * fp32 * cache.kv_layers[0].seen, (spec, cache.nbytes / (fp32 * cache.kv_layers[0].seen))


def test_a_mix_that_affords_every_token_keeps_every_token():
    g = eval_frontier.geometry_of(model_for("llama"))
    assert eval_frontier.spec_for("snapkv/int4", 0.5, 300, g) == "snapkv:budget=300,storage=int4"
    assert eval_frontier.spec_for("full", None, 300, g, room=5) == "static:capacity=305"
    assert eval_frontier.spec_for("auto", 0.125, 300, g) == "auto:bytes=0.125"


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
                                          (["eval", "--model", "smollm2", "--frontier", "--caches", "window"], "unknown kind")])  # fmt: skip
def test_the_cli_refuses_what_the_frontier_does_not_take(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
