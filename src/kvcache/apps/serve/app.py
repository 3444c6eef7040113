"""The OpenAI-compatible HTTP app over one ``kvcache.Engine`` (Starlette; ``server.py`` runs it).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template),
streamed as server-sent events or not; ``GET /v1/models``; ``GET /health``; ``GET /metrics``
(Prometheus text). With an API key every endpoint but ``/health`` wants ``Authorization: Bearer
KEY``.

A request is checked (``protocol.py``), tokenized, and submitted to the engine, which steps on its
own thread; the engine's ``on_update`` wakes the request's handler on the event loop, which turns
new tokens into text (``text.py``: stop strings, whole characters) and sends it. A client that goes
away mid-stream cancels its request, so its blocks return to the pool at once. When the engine's
queue holds ``max_queue`` requests, or the server is draining, a request gets 503 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ...errors import KVCacheError
from .metrics import Metrics
from .protocol import ApiError, Params, chat_params, chunk_body, completion_body, completion_params, new_id, parse_body, usage
from .text import TextStream


@dataclass
class Served:
    """What the app serves: the engine (stepping on its background thread), the model's tokenizer,
    the names the model answers to, and the server's settings."""

    engine: Any
    tokenizer: Any
    model_name: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int = 64
    context: int | None = None  # the model's context length (max_position_embeddings)
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False

    def names(self) -> set[str]:
        return {self.model_name, *self.aliases}


def make_app(served: Served) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "draining" if served.draining else "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(served.metrics.text(served.engine), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        data = [{"id": served.model_name, "object": "model", "created": 0, "owned_by": "kvcache"}]
        return JSONResponse({"object": "list", "data": data})

    async def completions(request: Request) -> Response:
        return await _generate(served, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(served, request, chat=True)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", _guarded(served, "metrics", metrics), methods=["GET"]),
        Route("/v1/models", _guarded(served, "models", models), methods=["GET"]),
        Route("/v1/completions", _guarded(served, "completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(served, "chat", chat), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _guarded(served: Served, endpoint: str, handler):
    """``handler`` behind the API key, with ``ApiError`` answered in the OpenAI shape and counted."""

    async def run(request: Request) -> Response:
        try:
            if served.api_key is not None and request.headers.get("authorization", "") != f"Bearer {served.api_key}":
                raise ApiError("missing or wrong API key (Authorization: Bearer KEY)", status=401,
                               kind="authentication_error", code="invalid_api_key")  # fmt: skip
            response = await handler(request)
        except ApiError as e:
            response = JSONResponse(e.body, status_code=e.status, headers=e.headers)
        served.metrics.request(endpoint, response.status_code)
        return response

    return run


# ---- generation ----------------------------------------------------------------------------------


async def _generate(served: Served, request: Request, chat: bool) -> Response:
    body = parse_body(await request.body())
    params = chat_params(body) if chat else completion_params(body)
    if params.model not in served.names():
        raise ApiError(f"the model {params.model!r} does not exist here; this server serves {served.model_name!r}",
                       status=404, param="model", code="model_not_found")  # fmt: skip
    ids = _tokens(served, params, chat)
    if params.max_tokens is None:  # chat without a limit: what the context and the pool leave
        room = min(served.context or served.engine.max_request_tokens, served.engine.max_request_tokens)
        params.max_tokens = max(1, room - len(ids))
    if served.context is not None and len(ids) + params.max_tokens > served.context:
        raise ApiError(
            f"this model's context is {served.context} tokens; the prompt has {len(ids)} and max_tokens asks for "
            f"{params.max_tokens}", param="messages" if chat else "prompt", code="context_length_exceeded",
        )  # fmt: skip
    run = _Run(served, ids, params, chat)
    run.start()  # refusals (503, 400) before any response starts
    if params.stream:
        return StreamingResponse(run.stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    return JSONResponse(await run.whole(request))


def _tokens(served: Served, params: Params, chat: bool) -> list[int]:
    tokenizer = served.tokenizer
    if chat:
        try:
            ids = tokenizer.apply_chat_template(params.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (roles out of order, ...)
            raise ApiError(f"the model's chat template refused these messages: {e}", param="messages") from None
        return list(ids)
    if isinstance(params.prompt, list):
        vocab = len(tokenizer)
        bad = next((t for t in params.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return params.prompt
    return tokenizer(params.prompt, add_special_tokens=True)["input_ids"]


class _Run:
    """One request through the engine: submit, wake on each update, text out."""

    def __init__(self, served: Served, ids: list[int], params: Params, chat: bool):
        self.served, self.ids, self.params, self.chat = served, ids, params, chat
        self.rid = new_id("chatcmpl" if chat else "cmpl")
        self.text = TextStream(served.tokenizer, params.stop)
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None
        self.seen = 0
        self.finish: str | None = None

    def start(self) -> None:
        """Submit the request to the engine (``ApiError`` if it cannot take it)."""
        served, params = self.served, self.params
        if served.draining:
            served.metrics.count("rejected")
            raise ApiError("the server is shutting down", status=503, kind="server_error", code="draining",
                           headers={"Retry-After": "5"})  # fmt: skip
        if served.engine.waiting_count >= served.max_queue:
            served.metrics.count("rejected")
            raise ApiError(f"the server is full ({served.max_queue} requests waiting); retry shortly", status=503,
                           kind="server_error", code="overloaded", headers={"Retry-After": "1"})  # fmt: skip
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        options = {} if params.cache is None else {"cache": params.cache}
        try:
            self.handle = served.engine.submit(
                self.ids, max_new_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                seed=params.seed, on_update=lambda: loop.call_soon_threadsafe(woken.set), **options,
            )  # fmt: skip
        except (KVCacheError, ValueError) as e:
            raise ApiError(str(e), param="cache" if params.cache else None) from None
        self.woken = woken

    async def _updates(self) -> AsyncIterator[str]:
        """New text as tokens come, until the request ends (``self.finish`` set)."""
        handle, woken = self.handle, self.woken
        while True:
            await woken.wait()
            woken.clear()
            tokens = handle.tokens
            self._timing(len(tokens))
            done = handle.done
            new = self.text.update(tokens, final=done)
            if self.text.stopped and not done:
                handle.cancel(wait=False)  # a stop string: the rest is not wanted
                self.finish = "stop"
            elif done:
                self.finish = "length" if handle.finish_reason == "length" else handle.finish_reason
                self.finish = self.finish if self.finish in ("length", "error") else "stop"
            if new:
                yield new
            if self.finish is not None:
                return

    def _timing(self, count: int) -> None:
        now = time.perf_counter()
        fresh = count - self.seen
        if fresh > 0:
            if self.seen == 0:
                self.served.metrics.first_token(now - self.arrived)
                fresh -= 1
            elif self.last_token_at is not None:
                self.served.metrics.between_tokens(now - self.last_token_at, fresh)
            self.last_token_at, self.seen = now, count

    def _usage(self, handle: Any) -> dict[str, Any]:
        stats = handle.stats
        cached = stats.reused_pool + stats.reused_store
        self.served.metrics.finished(len(self.ids), len(handle.tokens), stats.reused)
        return usage(len(self.ids), len(handle.tokens), cached)

    async def whole(self, request: Request) -> dict[str, Any]:
        handle, parts = self.handle, []
        try:
            async for new in self._updates():
                parts.append(new)
        finally:
            if self.finish is None:
                handle.cancel(wait=False)  # the client went away (the handler was cancelled)
        if self.finish == "error":
            raise ApiError(f"the engine failed this request: {handle.error}", status=500, kind="server_error")
        return completion_body(self.rid, self.params.model, "".join(parts), self.finish or "stop", self._usage(handle), self.chat)

    async def stream(self, request: Request) -> AsyncIterator[str]:
        handle, name, first = self.handle, self.params.model, True
        try:
            if self.chat:
                yield _event(chunk_body(self.rid, name, None, None, True, first=True))
                first = False
            async for new in self._updates():
                yield _event(chunk_body(self.rid, name, new, None, self.chat, first=first))
                first = False
            if self.finish == "error":
                error = ApiError(f"the engine failed this request: {handle.error}", status=500, kind="server_error")
                yield _event(error.body)
                return
            yield _event(chunk_body(self.rid, name, None, self.finish, self.chat, first=first))
            use = self._usage(handle)
            if self.params.include_usage:
                yield _event(chunk_body(self.rid, name, None, None, self.chat, use=use))
            yield "data: [DONE]\n\n"
        finally:
            if self.finish is None:  # the client went away mid-stream: give the blocks back now
                self.served.metrics.count("disconnects")
                with contextlib.suppress(Exception):
                    handle.cancel(wait=False)


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
