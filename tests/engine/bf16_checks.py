"""What the bfloat16 library's tests share: counting calls of a library entry, and holding a bfloat16 engine's
greedy tokens to ``generate``'s but at its own near ties."""

from __future__ import annotations

from engine_reference import reference as generate_reference
from kvcache.attention import native

#: generate's two best bfloat16 logits closer than this are a near tie (a bfloat16 logit near 4
#: moves by 0.03 a rounding).
BF16_NEAR_TIE = 0.1


def count_calls(monkeypatch, entry: str, argument: int) -> list:
    """Record argument ``argument`` of every call of ``entry`` in the bfloat16 library (``native.library``
    wrapped for the test); the list fills as calls come."""
    real = native.library
    calls: list = []

    class Counted:
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            attribute = getattr(self.lib, name)
            if name != entry:
                return attribute
            return lambda *args: calls.append(args[argument]) or attribute(*args)

    monkeypatch.setattr(native, "library", lambda name, declare: Counted(real(name, declare)) if name == "bf16_attention" else real(name, declare))
    return calls


def assert_generate_but_near_ties(model, prompts, got, new_tokens: int) -> None:
    """Each request's tokens ``got`` are ``generate``'s for its prompt up to the first token where
    generate's own two best logits lie within ``BF16_NEAR_TIE``."""
    for i, (tokens, p) in enumerate(zip(got, prompts)):
        want, gaps = generate_reference(model, p, new_tokens)
        tokens = list(map(int, tokens))
        first = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        assert first is None or gaps[first] < BF16_NEAR_TIE, f"request {i}: {tokens} against {want}, gaps {gaps}"
