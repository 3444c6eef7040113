"""No request field is silently ignored (issue 39): every field of the OpenAI request schemas of
``/v1/completions`` and ``/v1/chat/completions``, as the ``openai`` package types them, is honoured,
has no effect on what is generated, or is refused with a 400 naming it unless its value asks for
nothing; a field outside the schemas is refused too."""

from __future__ import annotations

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from kvcache.apps.serve import fields
from kvcache.apps.serve.protocol import ApiError, chat_params, completion_params

BASE = {fields.COMPLETIONS: {"model": "m", "prompt": "hi"}, fields.CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
PARSE = {fields.COMPLETIONS: completion_params, fields.CHAT: chat_params}
#: A value that asks for nothing, and one that asks for something, of every field not built.
NOTHING_AND_SOMETHING = {
    "n": (1, 2), "best_of": (1, 3),
    "suffix": ("", " end"), "frequency_penalty": (0, 0.5), "presence_penalty": (0.0, -1), "logit_bias": ({}, {"50": -100}),
    "tools": ([], [{"type": "function", "function": {"name": "f"}}]), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, "yes"), "functions": ([], [{"name": "f"}]), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"}, {"type": "json_object"}), "modalities": (["text"], ["text", "audio"]),
    "audio": (None, {"voice": "alloy", "format": "wav"}), "prediction": (None, {"type": "content", "content": "x"}),
    "web_search_options": (None, {}), "reasoning_effort": (None, "low"), "verbosity": (None, "high"),
    "store": (False, True), "metadata": ({}, {"k": "v"}), "service_tier": ("auto", "flex"),
    "moderation": (None, {"input": {"mode": "block"}}), "prompt_cache_retention": ("in_memory", "24h"),
    "prompt_cache_options": ({}, {"ttl": "1h"}),
    "repetition_penalty": (1.0, 1.2),
}


def schema_fields(module) -> set[str]:
    out: set[str] = set()
    for name in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        for cls in getattr(module, name).__mro__:
            out |= set(getattr(cls, "__annotations__", {}))
    return out


SCHEMAS = {fields.COMPLETIONS: schema_fields(completion_create_params), fields.CHAT: schema_fields(chat_create_params)}


@pytest.mark.parametrize("endpoint", [fields.COMPLETIONS, fields.CHAT])
def test_every_schema_field_is_known(endpoint):
    assert SCHEMAS[endpoint] <= set(fields.known(endpoint)), sorted(SCHEMAS[endpoint] - set(fields.known(endpoint)))


@pytest.mark.parametrize("endpoint,name", [(e, n) for e in SCHEMAS for n in sorted(SCHEMAS[e]) if n in fields.DEFAULTS])
def test_a_field_not_built_is_accepted_asking_nothing_and_refused_by_name_otherwise(endpoint, name):
    nothing, something = NOTHING_AND_SOMETHING[name]
    PARSE[endpoint]({**BASE[endpoint], name: nothing})
    PARSE[endpoint]({**BASE[endpoint], name: None})
    with pytest.raises(ApiError) as e:
        PARSE[endpoint]({**BASE[endpoint], name: something})
    assert e.value.status == 400 and e.value.param == name and name in e.value.message


@pytest.mark.parametrize("endpoint", [fields.COMPLETIONS, fields.CHAT])
def test_fields_without_effect_are_accepted(endpoint):
    for name, where in fields.NO_EFFECT.items():
        if endpoint in where:
            PARSE[endpoint]({**BASE[endpoint], name: "someone"})


@pytest.mark.parametrize("endpoint", [fields.COMPLETIONS, fields.CHAT])
def test_a_field_outside_the_schema_is_refused_by_name(endpoint):
    with pytest.raises(ApiError) as e:
        PARSE[endpoint]({**BASE[endpoint], "temprature": 0})
    assert e.value.param == "temprature" and "unknown field" in e.value.message


def test_chat_only_fields_are_refused_on_completions():
    with pytest.raises(ApiError) as e:
        completion_params({**BASE[fields.COMPLETIONS], "messages": []})
    assert e.value.param == "messages"


def test_lm_evals_loglikelihood_request_is_taken():
    # What lm-evaluation-harness's local-completions sends for a multiple-choice task.
    p = completion_params({"model": "m", "prompt": [[5, 6, 7], [5, 8]], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                           "echo": True, "seed": 1234})  # fmt: skip
    assert (p.logprobs, p.echo, p.max_tokens, p.prompts) == (1, True, 1, [[5, 6, 7], [5, 8]])


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"), ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0.0, "echo": True}, "max_tokens"), ({"logprobs": 1, "echo": True, "stream": True}, "logprobs"),
])
def test_bad_logprobs_requests_name_the_field(extra, param):
    with pytest.raises(ApiError) as e:
        completion_params({**BASE[fields.COMPLETIONS], **extra})
    assert e.value.param == param


@pytest.mark.parametrize("endpoint", [fields.COMPLETIONS, fields.CHAT])
def test_n_is_a_count_of_choices(endpoint):
    assert PARSE[endpoint]({**BASE[endpoint], "n": 3}).n == 3
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ApiError) as e:
            PARSE[endpoint]({**BASE[endpoint], "n": bad})
        assert e.value.param == "n"


def test_chat_logprobs_are_a_boolean_with_top_logprobs():
    assert chat_params({**BASE[fields.CHAT], "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert chat_params({**BASE[fields.CHAT], "logprobs": False}).logprobs is None
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs")):
        with pytest.raises(ApiError) as e:
            chat_params({**BASE[fields.CHAT], **extra})
        assert e.value.param == param


@pytest.mark.parametrize("endpoint", [fields.COMPLETIONS, fields.CHAT])
def test_vllm_extensions_that_load_generators_send(endpoint):
    """``vllm bench serve`` sends ``repetition_penalty: 1.0`` and, with ``--ignore-eos``,
    ``ignore_eos: true``: the first asks for nothing (any other value is refused by name), the second
    is honoured (``test_serve.py`` checks what it does)."""
    name = "repetition_penalty"
    nothing, something = NOTHING_AND_SOMETHING[name]
    PARSE[endpoint]({**BASE[endpoint], name: nothing})
    with pytest.raises(ApiError) as e:
        PARSE[endpoint]({**BASE[endpoint], name: something})
    assert e.value.param == name and name in e.value.message
    assert PARSE[endpoint]({**BASE[endpoint], "ignore_eos": True}).ignore_eos is True
    assert PARSE[endpoint](dict(BASE[endpoint])).ignore_eos is False
    with pytest.raises(ApiError) as e:
        PARSE[endpoint]({**BASE[endpoint], "ignore_eos": "yes"})
    assert e.value.param == "ignore_eos"
