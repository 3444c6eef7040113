"""Needles in natural prose, for a real tokenizer and an instruct model's chat template.

Prose: the docstrings of the Python standard library (``ast.get_docstring`` of every module,
class and function of its ``*.py`` sources, the files ``tasks.filler_files`` lists: PSF License),
present on any machine with Python. Paragraphs that read as English are kept (mostly letters and
spaces, no doctest lines, 120-800 characters). Haystacks draw from the ``"train"`` files, held-out
text for KL / top-1 from the ``"heldout"`` ones (the split rule of ``tasks.py``).

A context holds one needle, a pass key for a named door, at depth 0.1, 0.5 or 0.9 of its document
(turning with the seed), or three of them at all three depths, one question each: one context then
serves several questions (a compressed prefix reused by many requests). SmolLM2-135M tells three
doors apart at 1K tokens (13 of 15 found with the full cache) but not at 2K (5 of 12: it answers
another door's key), so the length sweep uses one needle per context.

The needle and the answer's opening put the key after a colon ("... door: 39539."). With "door is
39539" SmolLM2 at 4K tokens answered the first digit and a full stop for needles at depth 0.1 (the
full cache found 4 of 6); with the colon it copies the whole key (9 of 9 at 4K, seeds 0-8). The
key stays five digits, one a token: the answer's first token comes from the prompt pass, before
any cache compresses, so a one-token key would test no cache at all. The prompt is the model's chat template around::

    Read the document below. ... <document> ... </document>
    Question: What is the pass key for the {door} door? Answer with the number only.

``Context.prefix_ids`` ends with ``</document>``: everything before the question, shared by the
three questions (``Question.ids``: the question, the end of the user turn and the assistant's
opening, primed with the answer's start; ``Question.chat_ids`` the same without the priming, the
question as a user asks it in a chat). ``Context.document`` is where the document's tokens start,
for KVzip's repetition.

Needle sets (:data:`SETS`): ``doors`` is the above; ``secret`` hides one secret pass key ("The
secret pass key is 55454. ...", asked "What is the secret pass key?") in another text, paragraphs
of the Python Language Reference that ships with the standard library (``pydoc_data.topics``: PSF
License), which no rule of the project was tuned on (it has no train/held-out split).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import hashlib
import inspect
import itertools
import json
import os
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from . import tasks

DEPTHS = (0.1, 0.5, 0.9)
DOORS = ("blue", "green", "red", "amber", "violet", "silver", "copper", "white", "orange", "black")
NEEDLE = "The pass key for the {door} door: {key}. Remember it. {key} is the pass key for the {door} door."
QUESTION = "Question: What is the pass key for the {door} door? Answer with the number only."
#: The assistant's answer starts with this (as RULER primes its answers), so the key comes first.
ANSWER = "The pass key for the {door} door:"
INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there."
MARK = "\x00QUESTION\x00"


@dataclass(frozen=True)
class NeedleSet:
    """One way of hiding pass keys: the prose around them, the needle, the question and the
    primed opening of the answer (``{door}``, ``{key}`` filled in)."""

    name: str
    prose: str  # "docstrings" (train/held-out splits) or "reference" (one set, held out)
    needle: str
    question: str
    answer: str
    doors: bool  # whether a context may hold several needles, told apart by their doors


#: The needle sets, by name.
SETS = {
    "doors": NeedleSet("doors", "docstrings", NEEDLE, QUESTION, ANSWER, True),
    "secret": NeedleSet(
        "secret", "reference", "The secret pass key is {key}. Remember it. {key} is the secret pass key.",
        "Question: What is the secret pass key? Answer with the number only.", "The secret pass key is", False,
    ),
}
#: How a question is asked: its answer primed (``Question.ids``) or as a chat turn (``chat_ids``).
ASKS = ("primed", "chat")


@dataclass(frozen=True)
class Question:
    door: str
    key: str
    depth: float
    ids: list[int]  # the question and the assistant's opening, primed, after Context.prefix_ids
    chat_ids: list[int] | None = None  # the same, the assistant's turn opened with nothing in it (None: none made)

    def asked(self, ask: str) -> list[int]:
        """The question's ids as ``ask`` (one of :data:`ASKS`) asks it."""
        if ask not in ASKS:
            raise ValueError(f"unknown way of asking {ask!r}; one of {', '.join(ASKS)}")
        if ask == "chat" and self.chat_ids is None:
            raise ValueError("this question was made without a chat form (make_context makes one)")
        return self.ids if ask == "primed" else self.chat_ids


@dataclass(frozen=True)
class Context:
    length: int  # the nominal length: prefix + the longest question stay within it
    seed: int
    prefix_ids: list[int]
    document: int  # index in prefix_ids where the document's tokens start
    questions: tuple[Question, ...]


@functools.lru_cache(maxsize=None)
def paragraphs(split: str) -> tuple[str, ...]:
    """English-looking docstring paragraphs of the stdlib files of ``split``, in file order, unique;
    a paragraph that some ``"train"`` file also holds (docstrings are copied between modules) is
    left out of ``"heldout"``."""
    if split == "heldout":
        train = set(_paragraphs_of("train"))
        return tuple(p for p in _paragraphs_of("heldout") if p not in train)
    return _paragraphs_of(split)


#: Part of the key of the paragraphs kept on disk: bump it when the rule that picks them changes.
RULE = 1


@functools.lru_cache(maxsize=None)
def _paragraphs_of(split: str) -> tuple[str, ...]:
    """The paragraphs of ``split``, read from ``$KVCACHE_HOME/prose/<split>-<key>.json`` when the key
    (a digest of ``RULE``, the Python version and each stdlib file of ``split``: path, size,
    modification time) matches, else parsed (seconds) and kept there."""
    from ..models import kvcache_home

    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{RULE}\n{sys.version}\n{root}\n".encode())
    for rel in tasks.filler_files(split):
        stat = (root / rel).stat()
        key.update(f"{rel}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    kept = kvcache_home() / "prose" / f"{split}-{key.hexdigest()[:20]}.json"
    with contextlib.suppress(OSError, ValueError):
        stored = json.loads(kept.read_text())
        if isinstance(stored, list) and all(isinstance(p, str) and _prose(p) for p in stored):
            return tuple(stored)
    out = _parse(split)
    with contextlib.suppress(OSError):  # a read-only home: parse again next time
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, kept)
    return out


def _parse(split: str) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for rel in tasks.filler_files(split):
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in _documented(tree):
            doc = ast.get_docstring(node, clean=False)
            for para in re.split(r"\n\s*\n", inspect.cleandoc(doc) if doc else ""):
                para = " ".join(para.split())
                if _prose(para) and para not in seen:
                    seen.add(para)
                    out.append(para)
    return tuple(out)


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)


def _documented(tree: ast.Module):
    """The nodes that can hold a docstring, in ``ast.walk``'s order. Only statement lists are
    searched (a definition is a statement): walking every expression node costs most of the time."""
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, _DOCUMENTED):
            yield node
        for field in node._fields:
            value = getattr(node, field)
            if isinstance(value, list):
                todo.extend(child for child in value if isinstance(child, _STATEMENTS))


def _prose(text: str) -> bool:
    if not 120 <= len(text) <= 800 or ">>>" in text or not text.isascii():
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) >= 0.85 and text[0].isupper() and text.rstrip()[-1] in ".:)"


@functools.lru_cache(maxsize=None)
def reference_paragraphs() -> tuple[str, ...]:
    """English-looking paragraphs of the Python Language Reference's topics (``pydoc_data.topics``),
    by topic name, unique, none that a docstring also holds."""
    from pydoc_data.topics import topics

    seen: set[str] = set(_paragraphs_of("train")) | set(_paragraphs_of("heldout"))
    out: list[str] = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            para = " ".join(para.split())
            if _prose(para) and para not in seen:
                seen.add(para)
                out.append(para)
    return tuple(out)


def prose(tokenizer, tokens: int, seed: int, split: str = "train", source: str = "docstrings") -> list[str]:
    """Paragraphs of ``split`` (of ``source``: "docstrings", or "reference", which has no split)
    drawn in a seeded order until they hold about ``tokens`` tokens."""
    pool = list(paragraphs(split) if source == "docstrings" else reference_paragraphs())
    rng = random.Random(f"needles-{split}-{seed}")
    rng.shuffle(pool)
    out, total = [], 0
    for para in pool:
        if total >= tokens:
            break
        out.append(para)
        total += len(_ids(tokenizer, para)) + 1
    if total < tokens:
        raise RuntimeError(f"the standard library's {source} holds fewer than {tokens} tokens of prose here")
    return out


def haystack(tokenizer, tokens: int, seed: int, split: str, planted: list[tuple[float, str]], source: str = "docstrings") -> str:
    """Paragraphs of ``split`` (:func:`prose`) within ``tokens`` tokens, each planted ``(depth, text)`` at
    the paragraph boundary nearest its depth (boundary i: after paragraph i - 1), between document tags."""
    paras = prose(tokenizer, tokens, seed, split, source)
    sizes = [len(_ids(tokenizer, p)) + 1 for p in paras]
    while sum(sizes) > tokens and len(paras) > 1:  # drop the last paragraph while over
        paras, sizes = paras[:-1], sizes[:-1]
    bounds = list(itertools.accumulate(sizes, initial=0))
    at = [min(range(len(bounds)), key=lambda i: abs(bounds[i] - d * bounds[-1])) for d, _ in planted]
    body = [text for (_, text), b in zip(planted, at) if b == 0]
    for i, para in enumerate(paras, 1):
        body += [para] + [text for (_, text), b in zip(planted, at) if b == i]
    return "<document>\n" + "\n".join(body) + "\n</document>"


def make_context(
    tokenizer, length: int, seed: int, reserve: int = 48, count: int = 1, split: str = "train", needle_set: str = "doors"
) -> Context:
    """A context of about ``length - reserve`` tokens (the prefix) with ``count`` needles (3: one at
    each of ``DEPTHS``; 1: at ``DEPTHS[seed % 3]``) and one question per needle; ``reserve`` leaves
    room for the question and the answer; the prose comes from ``split``'s files (``needle_set``:
    one of :data:`SETS`, whose needles, questions and prose it uses; ``secret`` holds one needle)."""
    if needle_set not in SETS:
        raise ValueError(f"unknown needle set {needle_set!r}; one of {', '.join(SETS)}")
    kind = SETS[needle_set]
    if count != 1 and not kind.doors:
        raise ValueError(f"needle set {needle_set!r} holds one needle a context, got count={count}")
    rng = random.Random(f"needles-keys-{seed}" if needle_set == "doors" else f"needles-keys-{needle_set}-{seed}")
    doors = rng.sample(DOORS, len(DEPTHS))
    keys = [str(rng.randrange(10000, 100000)) for _ in DEPTHS]
    depths = DEPTHS if count == 3 else (DEPTHS[seed % 3],)
    doors, keys = doors[: len(depths)], keys[: len(depths)]
    # The prose leaves room for the template, the introduction, the document tags and three needles.
    room = " ".join(kind.needle.format(door="violet", key="12345") for _ in DEPTHS)
    overhead = len(_ids(tokenizer, _chat(tokenizer, f"{INTRO}\n\n<document>\n{room}\n</document>", prompt=False)))
    planted = [(depth, kind.needle.format(door=door, key=key)) for depth, door, key in zip(depths, doors, keys)]
    doc = haystack(tokenizer, length - reserve - overhead, seed, split, planted, kind.prose)
    head, tail = _chat(tokenizer, f"{INTRO}\n\n{doc}{MARK}").split(MARK)
    intro_at = head.index("<document>")
    intro = _ids(tokenizer, head[:intro_at])
    prefix_ids = intro + _ids(tokenizer, head[intro_at:])
    questions = tuple(
        Question(
            door if kind.doors else "", key, depth,
            _ids(tokenizer, "\n\n" + kind.question.format(door=door) + tail + kind.answer.format(door=door)),
            _ids(tokenizer, "\n\n" + kind.question.format(door=door) + tail),
        )
        for door, key, depth in zip(doors, keys, depths)
    )
    return Context(length, seed, prefix_ids, len(intro), questions)


def _chat(tokenizer, *turns: str, prompt: bool = True) -> str:
    """The chat template around user turns ``turns``, as text (with the generation prompt if ``prompt``)."""
    messages = [{"role": "user", "content": turn} for turn in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_of(text: str) -> str | None:
    """The first whole number in a generated answer, or None."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


def digits_right(key: str, text: str) -> float:
    """The share of ``key``'s digits that the answer's number (:func:`answer_of`) has in the same
    places: partial credit, shown beside exact answers, never instead of them."""
    got = answer_of(text) or ""
    return sum(a == b for a, b in zip(key, got)) / len(key)


def heldout_text(tokenizer, tokens: int, seed: int) -> list[int]:
    """About ``tokens`` token ids of held-out prose (for KL / top-1), exactly ``tokens`` long."""
    ids = _ids(tokenizer, "\n".join(prose(tokenizer, tokens + 16, seed, split="heldout")))
    return ids[:tokens]
