"""lm-evaluation-harness as a client of ``kvcache serve``, against the harness's own ``hf`` backend.

The harness's model classes are used as its evaluator uses them: ``local-completions`` and
``local-chat-completions`` (``lm_eval.models.openai_completions``) talk to a real server
subprocess, ``hf`` (``lm_eval.models.huggingface.HFLM``) runs the same model folder in this process,
and each answers the same requests — loglikelihoods (what every multiple-choice task asks) and
generate-until. The harness is installed without its task dependencies (``pip install --no-deps
lm-eval``; its API models need only ``aiohttp``, ``tenacity`` and ``requests``, in the test extra),
so the tasks are not read by its ``datasets`` loader: the requests are built here from the
documents and settings of the command-line run's task files (``kvcache.apps.bench.lm_eval_tasks``),
as a task's ``doc_to_text``/``doc_to_choice`` would. That whole run is
``benchmarks/lm_eval_against_hf.py``.

Targets (issue 39): identical generations, loglikelihoods within 1e-3 in fp32, the same greedy flags.
"""

from __future__ import annotations

import copy

import pytest

from kvcache.apps.bench import lm_eval_tasks
from serve_process import tiny_chat_model, tiny_chat_server

pytest.importorskip("aiohttp")
openai_completions = pytest.importorskip(
    "lm_eval.models.openai_completions", reason="the README's test set-up installs lm-eval==0.4.13 (--no-deps)"
)
huggingface = pytest.importorskip("lm_eval.models.huggingface")
from lm_eval.api.instance import Instance  # noqa: E402

DOCS = 6
TOLERANCE = 1e-3


def _loglikelihood_requests(docs) -> list[Instance]:
    return [
        Instance("loglikelihood", doc, (doc["prompt"], choice), idx=j)
        for doc in docs
        for j, choice in enumerate(doc["choices"])
    ]


def _generate_requests(docs, lm) -> list[Instance]:
    """What a generate-until task with ``--apply_chat_template`` asks of ``lm``, or without it when
    ``lm`` is None: each backend renders the chat turn its own way (text, or messages as JSON)."""
    out = []
    for i, doc in enumerate(docs):
        context = doc["prompt"] if lm is None else lm.apply_chat_template([{"role": "user", "content": doc["prompt"]}])
        out.append(Instance("generate_until", doc, (context, copy.deepcopy(lm_eval_tasks.UNTIL)), idx=i))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = tiny_chat_server(tmp_path_factory.mktemp("serve"), model_dir)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def hf(model_dir):
    return huggingface.HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=4)


@pytest.fixture(scope="module")
def docs():
    return lm_eval_tasks.documents(DOCS, 7100, 160, 3)


@pytest.fixture(scope="module")
def reference(hf, docs):
    return {
        "loglikelihood": hf.loglikelihood(_loglikelihood_requests(docs), disable_tqdm=True),
        "generate": hf.generate_until(_generate_requests(docs, None), disable_tqdm=True),
        "chat": hf.generate_until(_generate_requests(docs, hf), disable_tqdm=True),
    }


def completions(server, model_dir, **settings):
    # add_bos_token: the hf backend puts this tokenizer's <bos> first; without it the two backends
    # would score different token sequences (a client-side tokenization setting, not the server's)
    return openai_completions.LocalCompletionsAPI(
        model="tiny-chat", base_url=server.url + "/v1/completions", tokenizer=str(model_dir), add_bos_token=True,
        **settings,
    )  # fmt: skip


@pytest.mark.parametrize("settings", [{}, {"batch_size": 8, "num_concurrent": 2}], ids=["defaults", "batch8x2"])
def test_loglikelihoods_match_hf_backend(server, model_dir, docs, reference, settings):
    lm = completions(server, model_dir, **settings)
    got = lm.loglikelihood(_loglikelihood_requests(docs), disable_tqdm=True)
    want = reference["loglikelihood"]
    assert len(got) == len(want) == DOCS * 4
    worst = max(abs(a[0] - b[0]) for a, b in zip(got, want))
    assert worst < TOLERANCE, f"largest loglikelihood difference {worst:.2e}"
    assert [a[1] for a in got] == [b[1] for b in want]
    # the same multiple-choice answers: the argmax over each document's four choices
    pick = lambda lls: [max(range(4), key=lambda j: lls[4 * d + j][0]) for d in range(DOCS)]  # noqa: E731
    assert pick(got) == pick(want)


@pytest.mark.parametrize("settings", [{}, {"batch_size": 4, "num_concurrent": 2}], ids=["defaults", "batch4x2"])
def test_generate_until_matches_hf_backend(server, model_dir, docs, reference, settings):
    lm = completions(server, model_dir, **settings)
    assert lm.generate_until(_generate_requests(docs, None), disable_tqdm=True) == reference["generate"]


def test_chat_generate_until_matches_hf_backend(server, model_dir, docs, reference):
    lm = openai_completions.LocalChatCompletion(model="tiny-chat", base_url=server.url + "/v1/chat/completions",
                                                num_concurrent=2)  # fmt: skip
    assert lm.generate_until(_generate_requests(docs, lm), disable_tqdm=True) == reference["chat"]
