"""Two offline lm-evaluation-harness tasks over held-out pass keys (``tasks.passkey_choices``),
written once: as task files for the harness's command line (``benchmarks/lm_eval_against_hf.py``)
and as documents and settings for its model classes (``tests/apps/test_lm_eval_client.py``).

- ``kv_mc``: multiple choice, four five-digit keys, scored by loglikelihood;
- ``kv_gen``: generate-until (``UNTIL``), the first five-digit number of the answer kept.

A task file is JSON, which YAML (the harness's task format) reads as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import tasks

#: What ``kv_gen`` asks of a model: greedy, at most 12 tokens, stopping at a newline.
UNTIL: dict[str, Any] = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}


def documents(count: int, first: int, length: int, depths: int) -> list[dict[str, Any]]:
    """``count`` documents ``{"prompt", "choices" (four keys), "answer" (the right one's index),
    "target" (the key)}``: document ``i`` is held-out pass key ``first + i`` in ``length`` tokens,
    at depth ``(i % depths) / (depths - 1)``."""
    out = []
    for i in range(count):
        inst, choices, right = tasks.passkey_choices(first + i, length=length, depth=(i % depths) / (depths - 1), draw=i)
        out.append({"prompt": inst.prompt, "choices": choices, "answer": right, "target": inst.answer.strip()})
    return out


def write(folder: Path, docs: list[dict[str, Any]]) -> None:
    """``docs`` as ``docs.jsonl`` in ``folder``, and the task files ``kv_mc.yaml`` and ``kv_gen.yaml``
    reading it (for ``lm_eval --include_path folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / "docs.jsonl")}},
            "test_split": "test", "doc_to_text": "{{prompt}}"}  # fmt: skip
    mc = {"task": "kv_mc", **data, "output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
          "doc_to_target": "{{answer}}", "target_delimiter": "", "metric_list": [{"metric": "acc"}]}  # fmt: skip
    key = [{"function": "regex", "regex_pattern": r"(\d{5})"}, {"function": "take_first"}]
    gen = {"task": "kv_gen", **data, "output_type": "generate_until", "doc_to_target": "{{target}}",
           "generation_kwargs": UNTIL, "filter_list": [{"name": "key", "filter": key}],
           "metric_list": [{"metric": "exact_match"}]}  # fmt: skip
    for task in (mc, gen):
        (folder / f"{task['task']}.yaml").write_text(json.dumps(task, indent=1) + "\n")
