"""lm-evaluation-harness against ``kvcache serve``, compared with the harness's own ``hf`` backend.

Writes two offline tasks from the shipped tiny model's held-out pass keys (``lm_eval_tasks``:
``kv_mc``, multiple choice, scored by loglikelihood; ``kv_gen``, generate-until a newline), starts
``kvcache serve --model MODEL`` on a free loopback port (its log: ``OUT/server.log``), runs
``lm_eval`` with ``local-completions`` (default settings, then batches of 8 with 2 concurrent
requests), with ``local-chat-completions`` (``--apply_chat_template``, ``kv_gen``) and with ``hf``
on the same model folder (with and without the chat template), and prints per-sample agreement:
the largest loglikelihood difference, ``is_greedy`` agreement, identical generations, each
backend's accuracy.

lm-eval lives in its own environment (it pins its own dependencies)::

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 \\
        && /tmp/lmeval/bin/pip install 'lm-eval[api]' accelerate 'transformers<5.24'
    .venv/bin/python benchmarks/lm_eval_against_hf.py --lm-eval /tmp/lmeval/bin/lm_eval --out /tmp/lm-check
    .venv/bin/python benchmarks/lm_eval_against_hf.py --lm-eval /tmp/lmeval/bin/lm_eval --out /tmp/lm-smol --model smollm2

``add_bos_token=True`` is passed to ``local-completions`` for the tiny model so that it tokenizes
as the ``hf`` backend does (``<bos>`` first); without it the two backends score different token
sequences. SmolLM2's tokenizer adds no special token, so there every setting is the default.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvcache.apps.bench import lm_eval_tasks
from kvcache.apps.bench.serve_workload import serving, tiny_chat_folder
from kvcache.apps.bench.workload import resolve_model


def samples(folder: Path, task: str) -> dict[int, dict]:
    path = sorted(glob.glob(f"{folder}/**/samples_{task}_*.jsonl", recursive=True))[-1]
    return {row["doc_id"]: row for row in map(json.loads, Path(path).read_text().splitlines())}


def compare(reference: Path, run: Path, chat: bool) -> dict:
    gen_ref, gen_got = samples(reference, "kv_gen"), samples(run, "kv_gen")
    out = {
        "generations": len(gen_ref),
        "generations_identical": sum(gen_ref[d]["resps"] == gen_got[d]["resps"] for d in gen_ref),
        "gen_exact_match": [accuracy(gen_ref, "exact_match"), accuracy(gen_got, "exact_match")],
    }
    if chat:
        return out
    ref, got = samples(reference, "kv_mc"), samples(run, "kv_mc")
    pairs = [(a[0], b[0]) for d in ref for a, b in zip(ref[d]["resps"], got[d]["resps"])]
    return {
        "loglikelihoods": len(pairs),
        "max_abs_diff": max(abs(float(a[0]) - float(b[0])) for a, b in pairs),
        "is_greedy_agree": sum(a[1] == b[1] for a, b in pairs),
        "mc_acc": [accuracy(ref, "acc"), accuracy(got, "acc")],
        **out,
    }


def accuracy(rows: dict[int, dict], metric: str) -> float:
    return sum(float(row[metric]) for row in rows.values()) / len(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", required=True, help="the lm_eval executable of its own environment")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=12)
    p.add_argument("--model", default="tiny", help="tiny, a registered name (smollm2) or a model folder")
    args = p.parse_args()
    # the tiny model's tokenizer has no chat template: the copy bench serve makes gives it ChatML
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = tiny_chat_folder(out) if args.model == "tiny" else resolve_model(args.model)
    lm_eval_tasks.write(out / "tasks", lm_eval_tasks.documents(args.count, 2000, 384, 4))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    serve = lambda port: [sys.executable, "-m", "kvcache", "serve", "--model", str(folder), "--port", str(port)]  # noqa: E731
    with serving(serve, dict(os.environ), out / "server.log") as root:
        url = f"{root}/v1"
        bos = ",add_bos_token=True" if args.model == "tiny" else ""
        base = f"model={folder.name},base_url={url}/completions,tokenizer={folder},tokenizer_backend=huggingface{bos}"
        hf = ["--model", "hf", "--model_args", f"pretrained={folder},dtype=float32", "--device", "cpu"]
        chat = ["--apply_chat_template", "--tasks", "kv_gen"]
        runs = {
            "hf": [*hf, "--tasks", "kv_mc,kv_gen"],
            "hf, chat template": [*hf, *chat],
            "serve, defaults": ["--model", "local-completions", "--model_args", base, "--tasks", "kv_mc,kv_gen"],
            "serve, batch 8 x 2 concurrent": ["--model", "local-completions", "--model_args", base + ",num_concurrent=2",
                                              "--batch_size", "8", "--tasks", "kv_mc,kv_gen"],
            "serve chat, 2 concurrent": ["--model", "local-chat-completions", "--model_args",
                                         f"model={folder.name},base_url={url}/chat/completions,num_concurrent=2", *chat],
        }  # fmt: skip
        folders = {name: out / f"run{i}" for i, name in enumerate(runs)}
        for name, extra in runs.items():
            cmd = [args.lm_eval, *extra, "--include_path", str(out / "tasks"),
                   "--output_path", str(folders[name]), "--log_samples"]  # fmt: skip
            started = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            print(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)
    report = {name: compare(folders["hf, chat template" if "chat" in name else "hf"], run, "chat" in name)
              for name, run in folders.items() if name.startswith("serve")}  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, r in report.items():
        line = f"{name}: generations identical {r['generations_identical']}/{r['generations']}, exact match (hf, serve) {r['gen_exact_match']}"
        if "loglikelihoods" in r:
            line += (f"; {r['loglikelihoods']} loglikelihoods, max |diff| from hf {r['max_abs_diff']:.1e}, is_greedy agree "
                     f"{r['is_greedy_agree']}/{r['loglikelihoods']}, acc (hf, serve) {r['mc_acc']}")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
