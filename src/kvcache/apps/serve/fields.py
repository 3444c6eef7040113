"""Every field of the OpenAI request schemas of ``/v1/completions`` and ``/v1/chat/completions``:
honoured (``HONOURED``), without effect on what is generated (``NO_EFFECT``: an end user's id, a
prompt-cache routing hint, as prefixes are cached here by content), or not built (``DEFAULTS``) and
then accepted only at the value that asks for nothing (``best_of: 1``, ``frequency_penalty: 0``,
``tools: []`` ...). Any other value, or a field in none of them (not in the schemas, a typo, another
server's extension), is refused with a 400 naming the field. A field given as ``null`` counts as
not given, as the OpenAI API treats it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMPLETIONS, CHAT = "completions", "chat"
BOTH = (COMPLETIONS, CHAT)

#: Field -> the endpoints that honour it (``cache`` is kvcache's own extension; ``ignore_eos`` is
#: vLLM's, which load generators such as ``vllm bench serve`` send).
HONOURED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "cache",
                     "logprobs", "n", "ignore_eos"), BOTH),  # fmt: skip
    **dict.fromkeys(("prompt", "echo"), (COMPLETIONS,)),
    **dict.fromkeys(("messages", "max_completion_tokens", "top_logprobs"), (CHAT,)),
}

#: Field -> endpoints, for fields that do not change what is generated.
NO_EFFECT: dict[str, tuple[str, ...]] = {"user": BOTH, "safety_identifier": (CHAT,), "prompt_cache_key": (CHAT,)}


def _is(*values: Any) -> Callable[[Any], bool]:
    """A value equal to one of ``values`` and of its type (``0`` is not ``False``, ``[]`` not ``{}``)."""
    return lambda v: any(v == x and type(v) is type(x) for x in values)


_EMPTY = _is({}, [], "")
_ZERO = _is(0, 0.0)

#: Field -> (endpoints, whether a value asks for nothing, what a value that does not is refused as).
DEFAULTS: dict[str, tuple[tuple[str, ...], Callable[[Any], bool], str]] = {
    "best_of": ((COMPLETIONS,), _is(1), "best_of is not supported (it must be 1)"),
    "suffix": ((COMPLETIONS,), _EMPTY, "suffix (insertion) is not supported"),
    "frequency_penalty": (BOTH, _ZERO, "frequency_penalty is not supported (it must be 0)"),
    "presence_penalty": (BOTH, _ZERO, "presence_penalty is not supported (it must be 0)"),
    "logit_bias": (BOTH, _EMPTY, "logit_bias is not supported (it must be empty)"),
    "tools": ((CHAT,), _EMPTY, "tools are not supported"),
    "tool_choice": ((CHAT,), _is("none"), "tools are not supported (tool_choice must be 'none')"),
    "parallel_tool_calls": ((CHAT,), lambda v: isinstance(v, bool), "parallel_tool_calls must be a boolean (no tools are called)"),
    "functions": ((CHAT,), _EMPTY, "functions are not supported"),
    "function_call": ((CHAT,), _is("none"), "functions are not supported (function_call must be 'none')"),
    "response_format": ((CHAT,), lambda v: v == {"type": "text"}, "response_format other than text is not supported"),
    "modalities": ((CHAT,), lambda v: v == ["text"], "only the text modality is served"),
    "audio": ((CHAT,), lambda v: False, "audio output is not supported"),
    "prediction": ((CHAT,), lambda v: False, "predicted outputs are not supported"),
    "web_search_options": ((CHAT,), lambda v: False, "web search is not supported"),
    "reasoning_effort": ((CHAT,), lambda v: False, "reasoning_effort is not supported (the model does not reason)"),
    "verbosity": ((CHAT,), lambda v: False, "verbosity is not supported"),
    "store": ((CHAT,), _is(False), "storing completions is not supported (store must be false)"),
    "metadata": ((CHAT,), _EMPTY, "metadata is only kept with store, which is not supported"),
    "service_tier": ((CHAT,), _is("auto", "default"), "service_tier must be 'auto' or 'default'"),
    "moderation": ((CHAT,), lambda v: False, "moderation is not supported"),
    "prompt_cache_retention": ((CHAT,), _is("in_memory"), "prompts are cached in memory only (prompt_cache_retention must be 'in_memory')"),
    "prompt_cache_options": ((CHAT,), _EMPTY,
                             "prompt cache options are not supported (prefixes are cached by content)"),
    # vLLM's extension, sent at 1.0 by `vllm bench serve`
    "repetition_penalty": (BOTH, _is(1, 1.0), "repetition_penalty is not supported (it must be 1)"),
}


def known(endpoint: str) -> list[str]:
    """Every field ``endpoint`` knows, sorted."""
    tables = (HONOURED, NO_EFFECT, {k: v[0] for k, v in DEFAULTS.items()})
    return sorted(name for table in tables for name, where in table.items() if endpoint in where)


def refusal(body: dict[str, Any], endpoint: str) -> tuple[str, str] | None:
    """The first field of ``body`` that ``endpoint`` does not honour at the value given, as
    ``(field, message)``; None when every field is honoured, has no effect, or asks for nothing."""
    for name, value in body.items():
        if value is None or endpoint in HONOURED.get(name, ()) or endpoint in NO_EFFECT.get(name, ()):
            continue
        if name in DEFAULTS and endpoint in DEFAULTS[name][0]:
            _, asks_nothing, message = DEFAULTS[name]
            if asks_nothing(value):
                continue
            return name, f"{message}; got {name}={value!r}"
        where = "the completions" if endpoint == COMPLETIONS else "the chat completions"
        return name, f"unknown field {name!r} for {where} endpoint (known: {', '.join(known(endpoint))})"
    return None
