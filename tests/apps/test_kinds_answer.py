"""Every documented kind, used plainly, still lets the shipped model answer (issue 38).

Each kind of ``eval_plain.PLAIN`` (the kinds table's, one spec each) at a generous budget (half the
prompt) runs through ``make_cache`` and ``generate`` on 20 held-out pass-key prompts of 512 tokens,
as the README shows it. A key counts only when it is answered whole (issue 61). The shipped model
is byte-level: a five-digit key is copied one digit a token, so a cache that drops one digit's slot
turns an exact answer wrong although the model read most of the needle; the share of the key's
digits answered in place is checked beside, as a second column. A kind fails when

- its exact answers, on the needles it is judged on (``eval_plain.judged``: for window and lastrec
  those inside the half they keep), are more than ``MARGIN`` (0.45) below the full cache's; measured
  (AVX-512): the full cache, adakv and int8/int4 1.00, auto-heads 0.95, window and lastrec 0.90 of
  the 10 they keep, int2 0.90, snapkv 0.85, auto 0.80, pyramidkv 0.65; or
- its digits in place are more than ``MARGIN`` below the full cache's (the kvzip of before issue
  38's fix: 0.02); or
- its answers stop being answers: the line after the prompt is not a number of the key's length
  (kvzip before the fix answered "22222" or "cees p"; measured: every passing kind answers 20 of 20
  as numbers).

Known failures, marked strict so that a change that makes one pass is noticed: H2O keeps the key's
first digits and drops others on this model (exact 0.30); plain ``kvzip`` the same (0.35: its
scores come from the prompt's own queries, not KVzip's reconstruction, issue 61).

TOVA (``tova`` per head, ``tova-layer`` as its paper has it) fails here as a known limit: on this
model the last query's weights do not point at the needle (exact 0.00 and 0.00, digit accuracy 0.00
and 0.29; ``tova`` loses the question itself and answers "the context ..."); on SmolLM2
``tova-layer`` answers (docs/quality.md).
"""

from __future__ import annotations

import re

import pytest
import torch

import kvcache
from kvcache import cache_kwargs
from kvcache.apps import eval_plain, tasks
from kvcache.apps.eval_real import answer_after
from kvcache.apps.trained import load_trained
from kvcache.hf import kvzip

LENGTH, N, SHARE = 512, 20, 0.5
#: Where a pass-key prompt's question starts (its context is what comes before).
QUESTION = "\nWhat is the pass key?"
#: Digit accuracy a kind may lose against the full cache. Measured here (AVX-512): gaps 0.00-0.28
#: (h2o the largest), the defect 0.98, TOVA 0.71-1.00. One prompt is 0.05 of it, and greedy answers
#: of a tiny model may flip on near-ties between CPUs, so h2o gets three prompts of room beyond 0.28.
MARGIN = 0.45
#: Share of answers that must have the answer's form.
ANSWERED = 0.9
KNOWN = {
    "tova": "TOVA's last-query scores miss the needle on the shipped model (docs/limits.md)",
    "tova-layer": "TOVA's last-query scores miss the needle on the shipped model (docs/limits.md)",
    "h2o": "H2O drops digits of the key on the shipped model: exact 0.30 (docs/limits.md)",
    "kvzip": "plain kvzip drops digits of the key on the shipped model: exact 0.35 (issue 61, docs/limits.md)",
}


@pytest.fixture(scope="module")
def prompts():
    model, tokenizer = load_trained()
    insts = [tasks.make_instance("passkey", 1000 + i, length=LENGTH, depth=i / (N - 1)) for i in range(N)]
    ids = torch.tensor([tokenizer.encode(inst.prompt) for inst in insts])
    return model, tokenizer, insts, ids


def answers(prompts, spec: str) -> list[str]:
    model, tokenizer, insts, ids = prompts
    new = max(len(inst.answer) for inst in insts) + 1
    if spec.startswith("kvzip.compress_context"):  # eval_plain.CONTEXT_KVZIP: the context compressed, then the question
        return _compressed_answers(model, tokenizer, insts, SHARE, new)
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, kvcache.make_cache(model, spec)),
                             max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]


def _compressed_answers(model, tokenizer, insts, share: float, new: int) -> list[str]:
    """KVzip proper: each prompt's context (up to its question) through ``kvzip.compress_context``,
    then the question on the compressed cache, greedy."""
    out = []
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        for inst in insts:
            cut = inst.prompt.rindex(QUESTION)
            context, question = tokenizer.encode(inst.prompt[:cut]), tokenizer.encode(inst.prompt[cut:])
            cache = kvzip.compress_context(model, tokenizer, context, share, room=len(question) + new)
            out.append(tokenizer.decode(answer_after(model, cache, question, new), skip_special_tokens=True))
    return out


def exact(answer: str, text: str) -> bool:
    """Whether ``text``'s first line is the whole answer."""
    return text.split("\n", 1)[0].strip() == answer.strip()


def digits_right(answer: str, text: str) -> float:
    """The share of ``answer``'s characters that ``text`` (its first line) has in the same places."""
    want, got = answer.strip(), text.split("\n", 1)[0].strip()
    return sum(a == b for a, b in zip(want, got)) / len(want)


def answered(answer: str, text: str) -> bool:
    return re.fullmatch(r"\d{%d}" % len(answer.strip()), text.split("\n", 1)[0].strip()) is not None


@pytest.fixture(scope="module")
def full_answers(prompts):
    return answers(prompts, "growable")


@pytest.fixture(scope="module")
def full(prompts, full_answers):
    return [digits_right(i.answer, t) for i, t in zip(prompts[2], full_answers)]


@pytest.fixture(scope="module")
def full_exact(prompts, full_answers):
    return [exact(i.answer, t) for i, t in zip(prompts[2], full_answers)]


def _param(kind):
    marks = [pytest.mark.xfail(reason=KNOWN[kind], strict=True)] if kind in KNOWN else []
    return pytest.param(kind, marks=marks, id=kind)


def test_the_full_cache_reads_every_key(full, full_exact):
    assert sum(full_exact) / N >= 0.95 and sum(full) / N >= 0.95  # the reference the kinds are held against


@pytest.mark.parametrize("kind", [_param(k) for k in eval_plain.PLAIN if k != eval_plain.REFERENCE])
def test_every_documented_kind_answers_at_half_the_prompt(prompts, full, full_exact, kind):
    insts, ids = prompts[2], prompts[3]
    share = None if kind in eval_plain.UNBUDGETED else SHARE
    spec = eval_plain.spec_of(kind, share, ids.shape[1])
    texts = answers(prompts, spec)
    judged = [i for i, inst in enumerate(insts) if eval_plain.judged(kind, share, inst.depth)]
    whole = sum(exact(insts[i].answer, texts[i]) for i in judged) / len(judged)
    whole_reference = sum(full_exact[i] for i in judged) / len(judged)
    mine = sum(digits_right(insts[i].answer, texts[i]) for i in judged) / len(judged)
    reference = sum(full[i] for i in judged) / len(judged)
    formed = sum(answered(inst.answer, t) for inst, t in zip(insts, texts)) / N
    assert formed >= ANSWERED, f"{spec}: {formed:.0%} of answers are numbers: {texts[:6]}"
    assert whole_reference - whole <= MARGIN, f"{spec}: keys answered whole {whole:.2f} against the full cache's {whole_reference:.2f}: {texts[:6]}"
    assert reference - mine <= MARGIN, f"{spec}: digits right {mine:.2f} against the full cache's {reference:.2f}: {texts[:6]}"


def test_the_plain_table_covers_every_spec_kind():
    named = {eval_plain.PLAIN[k].split(":")[0] for k in eval_plain.PLAIN}
    assert set(kvcache.layers.registry.spec_kinds()) <= named


def test_the_kvzip_of_before_the_fix_is_caught(prompts, full):
    # recent=0 is what kvzip protected before issue 38: the check must see that defect.
    insts = prompts[2]
    texts = answers(prompts, f"kvzip:budget={SHARE},recent=0,queries=prompt")
    formed = sum(answered(inst.answer, t) for inst, t in zip(insts, texts)) / N
    right = sum(digits_right(inst.answer, t) for inst, t in zip(insts, texts)) / N
    assert formed < ANSWERED and sum(full) / N - right > MARGIN
