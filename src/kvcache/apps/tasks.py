"""Seeded synthetic long-context tasks: passkey retrieval, associative recall, variable tracking.

Shared by the training script of the small trained model (``tools/train_tiny.py``) and by the
quality harness that measures what bounded caches (eviction, quantization) cost in accuracy.

Every instance is a ``prompt`` and the ``answer`` its continuation should be, with one *needle*
(the fact to retrieve: the pass key, the block of key/value pairs, the block of assignments)
placed inside filler text at a controllable ``depth``:

* ``depth=0``: the needle opens the prompt ("early": the first thing a bounded cache evicts);
* ``depth=1``: the needle sits right before the question ("late").

Formats (kept simple for a tiny byte-level model)::

    passkey    ...filler...\\nThe pass key is 73914. Remember it.\\n...filler...
               \\nWhat is the pass key? The pass key is          -> " 73914"
    assoc      ...\\nKeys and values:\\nqzva: 481\\nmcte: 907\\n...\\n...filler...
               \\nRecall:\\nmcte: 907\\nqzva:                        -> " 481"
    vartrack   ...\\nVAR QXF = 48213\\nVAR KLM = 30517\\nVAR ZPR = QXF\\n...filler...
               \\nWhich variables equal 48213? Answer:           -> " QXF ZPR"

Associative recall asks several queries: all but the last are answered inside the prompt (so a
harness may score each of them by teacher forcing, see :attr:`Instance.spans`); the last one is
the ``answer``.

Lengths are counted in tokens of a byte-level tokenizer: every prompt is pure ASCII, so its
length in characters, in UTF-8 bytes and in byte tokens (not counting a ``<bos>``) is the same
number, and ``len(instance.prompt) == length`` exactly.

Filler is text of the Python standard library's own sources (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, PSF License), present on any machine with Python. Left out:
``site-packages``, test packages (directories named ``test``, ``tests``, ``idle_test``) and the
``encodings`` package (code-page tables). The files are split by a hash of their path relative to
the stdlib folder: ``sha256(path)`` with first byte ``< 26`` (about 10%) is ``"heldout"``, the rest
``"train"``; no file is in both. Training draws filler from ``"train"`` only, evaluation from
``"heldout"``. Non-ASCII characters become ``?`` and control characters other than newline and
tab are dropped. The set of files depends on the Python version; the rule does not.

Instances are a pure function of ``(task, split, seed, length, depth, options)``: the random
content (pass key, pairs, names) depends on ``(task, split, seed)`` only, so the same seed at
another length or depth asks the same question over different filler placement.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import string
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SPLITS",
    "TASKS",
    "Instance",
    "assoc_recall",
    "filler",
    "filler_files",
    "filler_text",
    "make_instance",
    "passkey",
    "score",
    "var_tracking",
]

TASKS: tuple[str, ...] = ("passkey", "assoc", "vartrack")
SPLITS: tuple[str, ...] = ("train", "heldout")

#: A file is held out when the first byte of sha256(relative path) is below this (26/256 ~ 10%).
HELDOUT_BYTE_BELOW = 26
_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"})
_DROP = {c: None for c in [*range(32), 127] if chr(c) not in "\n\t"}

PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
ASSOC_HEADER = "\nKeys and values:\n"
ASSOC_QUERY_HEADER = "\nRecall:\n"


@dataclass(frozen=True)
class Instance:
    """One task instance.

    ``prompt`` is exactly ``length`` ASCII characters (= byte tokens, without ``<bos>``);
    ``answer`` is what should follow it (with a leading space, as the prompt ends before it).
    ``needle`` is the ``[start, end)`` character span of the needle inside ``prompt``.
    ``spans`` are the ``[start, end)`` spans, inside ``prompt + answer``, of every answer the text
    states after a question: the earlier, already answered queries and the final ``answer`` (the
    last span). Training weights these; a harness may score each by teacher forcing.
    """

    task: str
    split: str
    seed: int
    depth: float
    prompt: str
    answer: str
    needle: tuple[int, int]
    spans: tuple[tuple[int, int], ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def length(self) -> int:
        return len(self.prompt)

    @property
    def text(self) -> str:
        """``prompt + answer``: the full text a model is trained on."""
        return self.prompt + self.answer


# ---- filler ------------------------------------------------------------------------------------


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


@functools.lru_cache(maxsize=None)
def filler_files(split: str) -> tuple[str, ...]:
    """Relative paths (POSIX) of the stdlib files in ``split``, sorted (the stdlib is walked once a
    process and split)."""
    _check_split(split)
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        for name in files:
            if name.endswith(".py"):
                rel = Path(folder, name).relative_to(root).as_posix()
                if (hashlib.sha256(rel.encode("utf-8")).digest()[0] < HELDOUT_BYTE_BELOW) == (split == "heldout"):
                    out.append(rel)
    if not out:
        raise RuntimeError(f"no Python sources found under {root} for split {split!r}")
    return tuple(sorted(out))


@functools.lru_cache(maxsize=None)
def filler_text(split: str) -> str:
    """All files of ``split``, cleaned to printable ASCII (``?`` for other characters, control
    characters but newline and tab dropped), joined by blank lines (one string)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for rel in filler_files(split):
        try:
            text = (root / rel).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text.replace("\r\n", "\n").encode("ascii", errors="replace").decode("ascii").translate(_DROP))
    return "\n\n".join(parts)


def filler(rng: random.Random, n: int, split: str) -> str:
    """``n`` characters of contiguous ``split`` text from a random line start."""
    if n < 0:
        raise ValueError(f"filler length must be >= 0, got {n}")
    if n == 0:
        return ""
    text = filler_text(split)
    if n > len(text):
        raise ValueError(f"asked for {n} characters of filler, the {split!r} text has {len(text)}")
    start = rng.randrange(len(text) - n + 1)
    line = text.rfind("\n", 0, start) + 1  # back to the start of that line
    return text[line : line + n]


# ---- placing a needle --------------------------------------------------------------------------


def _rng(task: str, split: str, seed: int) -> random.Random:
    _check_split(split)
    # The module's old name stays in the seed: it fixes every instance, the trained model's splits included.
    return random.Random(f"kvcache.tasks:{task}:{split}:{int(seed)}")


def _check_depth(depth: float) -> float:
    depth = float(depth)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return depth


def _instance(
    task: str, split: str, seed: int, depth: float, rng: random.Random, *, needle: str, question: str, answer: str,
    length: int, meta: dict, asked: tuple[tuple[int, int], ...] = (),
) -> Instance:
    """The instance whose prompt is ``filler[:k] + needle + filler[k:] + question``, exactly ``length``
    characters long; ``asked``: the spans, inside ``question``, of the answers it already states."""
    room = length - len(needle) - len(question)
    if room < 0:
        need = len(needle) + len(question)
        raise ValueError(f"{task}: length {length} is too short, needle and question alone take {need} tokens")
    text = filler(rng, room, split)
    k = round(depth * room)
    prompt = text[:k] + needle + text[k:] + question
    assert len(prompt) == length
    q0 = length - len(question)
    spans = tuple((q0 + a, q0 + b) for a, b in asked) + ((length, length + len(answer)),)
    return Instance(task, split, seed, depth, prompt, answer, (k, k + len(needle)), spans, meta)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def _distinct(count: int, draw: Callable[[], str]) -> list[str]:
    """``count`` different values of ``draw()``, in the order first drawn."""
    out: list[str] = []
    while len(out) < count:
        value = draw()
        if value not in out:
            out.append(value)
    return out


# ---- the tasks ---------------------------------------------------------------------------------


def passkey(seed: int, *, length: int, depth: float, split: str = "heldout", digits: int = 5) -> Instance:
    """Passkey retrieval: one ``The pass key is NNNNN. Remember it.`` line hidden in filler."""
    depth = _check_depth(depth)
    rng = _rng("passkey", split, seed)
    key = _digits(rng, digits)
    needle = f"\nThe pass key is {key}. Remember it.\n"
    return _instance("passkey", split, seed, depth, rng, needle=needle, question=PASSKEY_QUESTION, answer=" " + key,
                     length=length, meta={"key": key})


def assoc_recall(
    seed: int,
    *,
    length: int,
    depth: float,
    split: str = "heldout",
    n_pairs: int = 16,
    n_queries: int = 4,
) -> Instance:
    """Multi-query associative recall: ``n_pairs`` lines ``kkkk: vvv`` (4 lowercase letters,
    3 digits), then ``n_queries`` distinct keys asked back in random order."""
    depth = _check_depth(depth)
    if n_pairs < 1 or not 1 <= n_queries <= n_pairs:
        raise ValueError(f"assoc: need 1 <= n_queries <= n_pairs, got n_pairs={n_pairs}, n_queries={n_queries}")
    rng = _rng("assoc", split, seed)
    keys = _distinct(n_pairs, lambda: "".join(rng.choice(string.ascii_lowercase) for _ in range(4)))
    values = [_digits(rng, 3) for _ in keys]
    asked = rng.sample(range(n_pairs), n_queries)
    needle = ASSOC_HEADER + "".join(f"{k}: {v}\n" for k, v in zip(keys, values))
    question = ASSOC_QUERY_HEADER
    spans = []
    for i in asked[:-1]:
        question += f"{keys[i]}:"
        spans.append((len(question), len(question) + 4))
        question += f" {values[i]}\n"
    question += f"{keys[asked[-1]]}:"
    meta = {"pairs": dict(zip(keys, values)), "queries": [keys[i] for i in asked]}
    return _instance("assoc", split, seed, depth, rng, needle=needle, question=question, answer=" " + values[asked[-1]],
                     length=length, meta=meta, asked=tuple(spans))


def var_tracking(
    seed: int,
    *,
    length: int,
    depth: float,
    split: str = "heldout",
    hops: int = 3,
    chains: int = 2,
) -> Instance:
    """Variable tracking: ``chains`` chains of ``hops`` variables each (``VAR A = 12345``,
    ``VAR B = A``, ...), their lines interleaved in one block; the question asks for every
    variable of the first chain, in the order they were assigned."""
    depth = _check_depth(depth)
    if hops < 1 or chains < 1:
        raise ValueError(f"vartrack: need hops >= 1 and chains >= 1, got hops={hops}, chains={chains}")
    rng = _rng("vartrack", split, seed)
    names = _distinct(hops * chains, lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(3)))
    values = _distinct(chains, lambda: _digits(rng, 5))
    lines = []
    for c in range(chains):
        chain = names[c * hops : (c + 1) * hops]
        lines.append(iter([f"VAR {chain[0]} = {values[c]}\n"] + [f"VAR {b} = {a}\n" for a, b in zip(chain, chain[1:])]))
    # Interleave the chains at random, each keeping its own order.
    order = [c for c in range(chains) for _ in range(hops)]
    rng.shuffle(order)
    needle = "\n" + "".join(next(lines[c]) for c in order)
    question = f"\nWhich variables equal {values[0]}? Answer:"
    answer = " " + " ".join(names[:hops])
    return _instance("vartrack", split, seed, depth, rng, needle=needle, question=question, answer=answer,
                     length=length, meta={"value": values[0], "chain": names[:hops]})


_MAKERS = {"passkey": passkey, "assoc": assoc_recall, "vartrack": var_tracking}


def make_instance(task: str, seed: int, *, length: int, depth: float, split: str = "heldout", **options) -> Instance:
    """The instance of ``task`` (one of :data:`TASKS`) for ``seed``; ``options`` go to the
    task's own function (``digits``; ``n_pairs``, ``n_queries``; ``hops``, ``chains``)."""
    try:
        maker = _MAKERS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; expected one of: {', '.join(TASKS)}") from None
    return maker(seed, length=length, depth=depth, split=split, **options)


def passkey_choices(
    seed: int, *, length: int, depth: float, draw: int, wrong: int = 3
) -> tuple[Instance, list[str], int]:
    """Pass-key instance ``seed`` as a multiple-choice question: ``(instance, choices, index of the
    right one)``, the key among ``wrong`` other five-digit keys drawn and shuffled with seed
    ``draw`` (what the lm-evaluation-harness comparisons ask as a ``multiple_choice`` task)."""
    inst = make_instance("passkey", seed, length=length, depth=depth)
    rng = random.Random(draw)
    choices = [inst.answer] + [" " + str(rng.randrange(10000, 100000)) for _ in range(wrong)]
    rng.shuffle(choices)
    return inst, choices, choices.index(inst.answer)


def _normalise(text: str) -> str:
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def score(answer: str, generated: str) -> bool:
    """Exact match: ``generated`` cut at its first newline, stripped of surrounding whitespace and
    of one trailing period, must equal ``answer`` stripped the same way.

    So a harness may generate exactly as many tokens as the answer has, or more as long as the
    model ends its line there (the training text puts a newline after every answer); extra words
    on the same line (``" 73914 2"``, one variable too many) count as wrong.
    """
    return _normalise(generated.split("\n", 1)[0]) == _normalise(answer)
