"""The OpenAI API's shapes: a request body checked into ``Params``, and the response bodies and
stream chunks of ``/v1/completions`` and ``/v1/chat/completions``.

A body that is not a JSON object, a known field of the wrong type or out of range, or a missing
required field is an ``ApiError`` (HTTP 400 unless said otherwise) that names the field; the
server answers it in the OpenAI error shape (``ApiError.body``). A field this server does not
honour, at a value that asks for something, is refused by name, never ignored (``fields.py``).
Extension fields: ``cache`` (a cache spec: the server's own, or ``growable`` or a bounded kind,
``snapkv:budget=0.25``, for this request when the server's pool is full precision).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...engine import check_top
from .fields import CHAT, COMPLETIONS, refusal


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = message, status, param, kind, code
        self.headers = headers or {}

    @property
    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """A checked completion or chat request."""

    model: str
    prompts: list[str | list[int]] | None = None  # completions: one choice each, in order
    messages: list[dict[str, Any]] | None = None  # chat
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache: str | None = None
    #: Alternatives per token when log-probabilities are asked (completions: ``logprobs``; chat:
    #: ``top_logprobs`` with ``logprobs: true``), else None.
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt before the completion, its tokens scored too
    n: int = 1  # choices per prompt: independent samples
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens, past end-of-sequence tokens

    @property
    def scoring_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt is scored; the one token drawn is no answer."""
        return self.max_tokens == 0


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


#: Prompts one completions request may carry (each one engine request).
MAX_PROMPTS = 256
#: Choices per prompt (``n``).
MAX_CHOICES = 16


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def completion_params(body: dict[str, Any]) -> Params:
    """``prompt`` as the OpenAI API takes it: a string, a list of token ids, or a batch (a list of
    strings or of token-id lists), each prompt one choice."""
    p = _common(body, COMPLETIONS)
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    prompts = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(x, str) or _token_ids(x) for x in prompts):
        raise ApiError("prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts a request, got {len(prompts)}", param="prompt")
    empty = next((i for i, x in enumerate(prompts) if x == ""), None)
    if empty is not None:
        raise ApiError("prompt is empty" if len(prompts) == 1 else f"prompt[{empty}] is empty", param="prompt")
    p.prompts = [x if isinstance(x, str) else list(x) for x in prompts]
    p.logprobs = _alternatives(body, "logprobs")
    p.echo = _boolean(body, "echo", False)
    if type(body.get("max_tokens")) is int and body["max_tokens"] == 0:
        if not p.echo:
            raise ApiError("max_tokens 0 (scoring the prompt only) needs echo: true", param="max_tokens")
        p.max_tokens = 0
    if p.logprobs is not None and p.echo and p.stream:
        raise ApiError("echo with logprobs while streaming is not supported yet; ask without streaming", param="logprobs")
    if p.max_tokens is None:
        p.max_tokens = 16  # the OpenAI API's default for completions
    return p


def chat_params(body: dict[str, Any]) -> Params:
    p = _common(body, CHAT)
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = [part.get("text") for part in content if isinstance(part, dict)]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ApiError(f"messages[{i}].content parts must be text parts", param=f"messages[{i}].content")
            m = {**m, "content": "".join(texts)}
            messages[i] = m
        elif not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
    p.messages = messages
    wanted = _boolean(body, "logprobs", None)
    top = _alternatives(body, "top_logprobs")
    if top and not wanted:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if wanted:
        p.logprobs = top or 0
    return p


def _alternatives(body: dict[str, Any], name: str) -> int | None:
    """``body[name]``, a count of alternatives per token, checked as the engine checks it."""
    try:
        return check_top(name, body.get(name))
    except ValueError as e:
        raise ApiError(str(e), param=name) from None


def _common(body: dict[str, Any], endpoint: str) -> Params:
    refused = refusal(body, endpoint)
    if refused is not None:
        raise ApiError(refused[1], param=refused[0], code="unsupported_field")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required and must be a string", param="model")
    p = Params(model=model)
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    # 0 is allowed on completions with echo (completion_params checks)
    if tokens is not None and not (endpoint == COMPLETIONS and type(tokens) is int and tokens == 0):
        if type(tokens) is not int or tokens < 1:
            raise ApiError(f"max_tokens must be an integer >= 1, got {tokens!r}", param="max_tokens")
        p.max_tokens = tokens
    p.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    p.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if p.top_p == 0:
        raise ApiError("top_p must be above 0", param="top_p")
    p.seed = body.get("seed")
    if p.seed is not None and type(p.seed) is not int:
        raise ApiError(f"seed must be an integer, got {p.seed!r}", param="seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)):
        raise ApiError("stop must be a string or a list of at most 4 strings", param="stop")
    p.stop = [s for s in stop or [] if s]
    p.stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ApiError("stream_options must be an object with a boolean include_usage", param="stream_options")
        p.include_usage = bool(options.get("include_usage", False))
    p.n = 1 if body.get("n") is None else body["n"]
    if type(p.n) is not int or not 1 <= p.n <= MAX_CHOICES:
        raise ApiError(f"n must be an integer in [1, {MAX_CHOICES}], got {p.n!r}", param="n")
    p.ignore_eos = _boolean(body, "ignore_eos", False)
    cache = body.get("cache")
    if cache is not None and not isinstance(cache, str):
        raise ApiError(f"cache must be a cache spec string such as 'snapkv:budget=0.25', got {cache!r}", param="cache")
    p.cache = cache
    return p


def _boolean(body: dict[str, Any], name: str, default: bool | None) -> bool | None:
    """``body[name]``, which must be a boolean when given (``default`` when not)."""
    value = body.get(name, default)
    if value is not default and not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise ApiError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


# ---- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(parts: list[tuple[int, int, int]]) -> dict[str, Any]:
    """A response's usage: its choices' ``(prompt, completion, cached)`` tokens, summed."""
    prompt, completion, cached = (sum(column) for column in zip(*parts))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def completion_body(rid: str, model: str, choices: list[tuple[str, str, Any]], use: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The whole answer: ``choices`` ``(text, finish, logprobs)`` in index order."""
    key, kind = ("message", "chat.completion") if chat else ("text", "text_completion")
    out = [{"index": i, key: {"role": "assistant", "content": text} if chat else text, "finish_reason": finish,
            "logprobs": lp} for i, (text, finish, lp) in enumerate(choices)]  # fmt: skip
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": out, "usage": use}


def chunk_body(rid: str, model: str, text: str | None, finish: str | None, chat: bool, first: bool = False,
               use: dict[str, Any] | None = None, index: int = 0, logprobs: Any = None) -> dict[str, Any]:  # fmt: skip
    """One stream chunk of choice ``index``: new ``text`` (or None) with its tokens' ``logprobs``, a
    ``finish`` reason on the last, or (``use``) the usage chunk with no choices."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    if use is not None:
        return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": use}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
