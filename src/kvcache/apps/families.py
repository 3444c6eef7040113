"""Task families for quality per byte, each made two ways: a ``tuned`` split and a ``held-out`` one.

Every family hides what the question needs in prose (``needles.prose``: the standard library's
docstrings) and asks for it at the end of a chat. The two splits differ in everything a rule could
be tuned on: the prose comes from other files (``tasks.py``'s file split), the needle and question
are phrased with other templates, and the seeds are disjoint. A rule chosen on ``tuned`` is judged
on ``held-out``.

- ``needle-digits``, ``needle-words``, ``needle-mixed``: one needle whose key is five digits, two
  words, or a mixed code (``K7Q-42X``);
- ``multi-key``: a code in two halves at two depths; the answer needs both;
- ``kv-lookup``: a block of ``KV_PAIRS`` ``key: value`` lines (word-pair keys, five-digit values) at one
  depth, one key asked (RULER's key-value retrieval);
- ``turn``: the needle in an earlier user turn (the document) and the question in a later one,
  after the assistant's reply (a reused prefix), against ``needle-digits`` (one turn).

``make_item(tokenizer, family, length, seed, split)`` returns the prompt's token ids (the chat
template with the generation prompt and the answer's opening), the expected answer, and the depth.
``score(item, generated)`` says whether a generated text holds the answer; ``as_context(item)`` puts
an item in the needle eval's terms (``needles.Context``), for ``kvcache eval --frontier --tasks``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from . import needles

FAMILIES = ("needle-digits", "needle-words", "needle-mixed", "multi-key", "kv-lookup", "turn")
SPLITS = ("tuned", "held-out")
DEPTHS = (0.1, 0.5, 0.9)
#: Seeds of the held-out split start here (tuned seeds stay below).
HELD_OUT_SEEDS = 1_000_000

#: Needle and question phrasings per split: ``{what}`` names the secret, ``{key}`` is it.
PHRASES = {
    "tuned": (
        ("The secret {what} is: {key}. Remember it. {key} is the secret {what}.", "What is the secret {what}?", "The secret {what} is:"),
        ("Note for later: the {what} reads {key}. Again, the {what} reads {key}.", "What does the {what} read?", "The {what} reads"),
        ("Important: {key} is the {what}. Keep it in mind: the {what} is {key}.", "Which value is the {what}?", "The {what} is"),
    ),
    "held-out": (
        ("Hidden fact. The {what} has been set to {key}; it is {key}.", "Tell me the value the {what} has been set to.", "It has been set to"),
        ("Write this down: {what} = {key}. Repeat: {what} = {key}.", "Give the {what}, exactly as written.", "{What} ="),
    ),
}
THINGS = ("vault code", "door key", "launch word", "access token", "safe combination", "locker code", "gate password")
WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kettle", "lantern",
    "maple", "nectar", "orchid", "pepper", "quartz", "raven", "saffron", "timber", "umber", "velvet", "willow", "zephyr",
)
INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it."
ASK = "Answer with the value only."
ACK = "I have read the document and memorized the important information."
#: Tokens kept free for the question, the answer's opening and the answer.
RESERVE = 96
#: Lines of the key-value list.
KV_PAIRS = 8


@dataclass(frozen=True)
class Item:
    family: str
    split: str
    seed: int
    length: int
    prompt_ids: list[int]  # the whole prompt, ending with the assistant's opening
    question_start: int  # index in prompt_ids where the question's turn text begins
    answer: str  # what the generated text must hold (both halves for multi-key, space-separated)
    depth: float


def make_item(tokenizer, family: str, length: int, seed: int, split: str) -> Item:
    """One prompt of about ``length`` tokens of family ``family`` from split ``split``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose one of {FAMILIES}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    seed = seed + (HELD_OUT_SEEDS if split == "held-out" else 0)
    rng = random.Random(f"families-{family}-{seed}")
    needle_text, question, opening = rng.choice(PHRASES[split])
    what = rng.choice(THINGS)
    depth = DEPTHS[seed % len(DEPTHS)]
    if family == "multi-key":
        first, second = _key(rng, "digits"), _key(rng, "digits")
        planted = [
            (depth, f"The first half of the {what} is {first}. Only the first half: {first}."),
            (DEPTHS[(seed + 1) % len(DEPTHS)], f"The second half of the {what} is {second}. Only the second half: {second}."),
        ]
        question, opening, answer = f"What are the first and second halves of the {what}?", f"The halves of the {what} are", f"{first} {second}"
    elif family == "kv-lookup":
        pairs = {}
        while len(pairs) < KV_PAIRS:
            pairs[f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"] = _key(rng, "digits")
        asked = rng.choice(sorted(pairs))
        block = "A list of keys and their values:\n" + "\n".join(f"{k}: {v}" for k, v in pairs.items())
        planted = [(depth, block)]
        question, opening, answer = f"In the list, what is the value of the key {asked}?", f"The value of {asked} is", pairs[asked]
    else:
        kind = {"needle-words": "words", "needle-mixed": "mixed"}.get(family, "digits")
        answer = _key(rng, kind)
        planted = [(depth, needle_text.format(what=what, key=answer))]
        question, opening = question.format(what=what), opening.format(what=what, What=what.capitalize())
    planted_tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 for _, text in planted)
    budget = max(length - RESERVE - planted_tokens - 48, 64)  # 48: the template and the introduction
    document = needles.haystack(tokenizer, budget, seed, "train" if split == "tuned" else "heldout", planted)
    question = f"{question} {ASK}"
    if family == "turn":
        messages = [
            {"role": "user", "content": f"{INTRO}\n\n{document}"},
            {"role": "assistant", "content": ACK},
            {"role": "user", "content": question},
        ]
    else:
        messages = [{"role": "user", "content": f"{INTRO}\n\n{document}\n\n{question}"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered + opening, add_special_tokens=False)["input_ids"]
    before = tokenizer(rendered[: rendered.rindex(question)], add_special_tokens=False)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(before, ids)) if a != b), len(before))
    return Item(family, split, seed, length, ids, start, answer, depth)


def as_context(item: Item) -> needles.Context:
    """``item`` as the needle eval's context: the prompt up to its question as the prefix, the rest
    (the question and the answer's opening) as its one question, ``door`` the family's name."""
    question = needles.Question(item.family, item.answer, item.depth, item.prompt_ids[item.question_start :])
    return needles.Context(item.length, item.seed, item.prompt_ids[: item.question_start], 0, (question,))


def _key(rng: random.Random, kind: str) -> str:
    if kind == "words":
        return f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    if kind == "mixed":
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        return f"{rng.choice(letters)}{rng.randrange(10)}{rng.choice(letters)}-{rng.randrange(10, 100)}{rng.choice(letters)}"
    return str(rng.randrange(10000, 100000))


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def score(item: Item, generated: str) -> bool:
    """Whether ``generated`` holds the answer, case, spacing and punctuation aside: its first line
    for one key, the whole text for both halves of multi-key (a model lists them on lines)."""
    if item.family == "multi-key":
        text = _normal(generated)
        return all(part in text for part in item.answer.split())
    return _normal(item.answer) in _normal(generated.strip().split("\n")[0])
