"""The OpenAI-compatible HTTP app over one ``kvcache.Engine`` (Starlette; ``server.py`` runs it).

A request is checked (``protocol.py``), tokenized, and submitted to the engine (a completions
request with a batch of prompts: one engine request each, their text merged into one response by
choice index), which steps on its own thread; the engine's ``on_update`` wakes the request's
handler on the event loop, which turns new tokens into text (``text.py``: stop strings, whole
characters) and sends it, streamed as server-sent events or not. A client that goes away mid-stream
cancels its request, so its blocks return to the pool at once. With an API key every endpoint but
``/health`` wants ``Authorization: Bearer KEY``. When the engine's queue holds ``max_queue``
requests, or the server is draining, a request gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ...errors import KVCacheError
from .metrics import Metrics
from .protocol import (ApiError, Params, chat_params, chunk_body, completion_body, completion_params, new_id,
                       parse_body, usage)
from .text import TextStream, chat_ids, chat_logprobs, completion_logprobs, covered, length_of, text_ids


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


def make_app(served: Served) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "draining" if served.draining else "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(served.metrics.text(served.engine), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        data = [{"id": served.model_name, "object": "model", "created": 0, "owned_by": "kvcache"}]
        return JSONResponse({"object": "list", "data": data})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", _guarded(served, "metrics", metrics), methods=["GET"]),
        Route("/v1/models", _guarded(served, "models", models), methods=["GET"]),
        Route("/v1/completions", _guarded(served, "completions", partial(_generate, served, chat=False)),
              methods=["POST"]),
        Route("/v1/chat/completions", _guarded(served, "chat", partial(_generate, served, chat=True)),
              methods=["POST"]),
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
    if params.model not in {served.model_name, *served.aliases}:
        raise ApiError(f"the model {params.model!r} does not exist here; this server serves {served.model_name!r}",
                       status=404, param="model", code="model_not_found")  # fmt: skip
    prompts = [_chat_tokens(served, params)] if chat else [_prompt_tokens(served, p) for p in params.prompts or []]
    if params.max_tokens is None:  # chat without a limit: what the context and the pool leave
        room = min(served.context or served.engine.max_request_tokens, served.engine.max_request_tokens)
        params.max_tokens = max(1, room - len(prompts[0]))
    for i, ids in enumerate(prompts):
        if served.context is not None and len(ids) + params.max_tokens > served.context:
            which = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(
                f"this model's context is {served.context} tokens; {which} has {len(ids)} and max_tokens asks for "
                f"{params.max_tokens}", param="messages" if chat else "prompt", code="context_length_exceeded",
            )  # fmt: skip
    rid = new_id("chatcmpl" if chat else "cmpl")
    texts = [None] * len(prompts) if chat else [p if isinstance(p, str) else None for p in params.prompts or []]
    # n choices a prompt, prompt-major: submitted together, the later ones wait for the first to
    # compute the prompt's blocks and share them (the engine's prefix sharing); sample j seeded seed + j.
    runs = [_Run(served, ids, params, chat, i * params.n + j, text, None if params.seed is None else params.seed + j)
            for i, (ids, text) in enumerate(zip(prompts, texts)) for j in range(params.n)]  # fmt: skip
    _start(served, runs)  # refusals (503, 400) before any response starts
    if params.stream:
        return StreamingResponse(_stream(served, runs, rid, params, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    return JSONResponse(await _whole(runs, rid, params, chat))


def _chat_tokens(served: Served, params: Params) -> list[int]:
    try:
        return chat_ids(served.tokenizer, params.messages)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (roles out of order, ...)
        raise ApiError(f"the model's chat template refused these messages: {e}", param="messages") from None


def _prompt_tokens(served: Served, prompt: str | list[int]) -> list[int]:
    tokenizer = served.tokenizer
    if isinstance(prompt, list):
        vocab = len(tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return prompt
    return text_ids(tokenizer, prompt)


def _start(served: Served, runs: list[_Run]) -> None:
    """Submit every run's request, or none (``ApiError``: draining, a full queue, a refused spec)."""
    if served.draining:
        served.metrics.count("rejected")
        raise ApiError("the server is shutting down", status=503, kind="server_error", code="draining",
                       headers={"Retry-After": "5"})  # fmt: skip
    if len(runs) > served.max_queue:
        raise ApiError(f"{len(runs)} choices (prompts x n) in one request; this server queues at most {served.max_queue}",
                       param="prompt")
    if served.engine.waiting_count + len(runs) > served.max_queue:
        served.metrics.count("rejected")
        raise ApiError(f"the server is full ({served.max_queue} requests waiting); retry shortly", status=503,
                       kind="server_error", code="overloaded", headers={"Retry-After": "1"})  # fmt: skip
    started: list[_Run] = []
    try:
        for run in runs:
            run.start()
            started.append(run)
    except ApiError:
        for run in started:
            run.handle.cancel(wait=False)
        raise


async def _merged(runs: list[_Run]) -> AsyncIterator[tuple[_Run, str | None]]:
    """Every run's new text as it comes, ``(run, text)``; ``(run, None)`` once a run has ended."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            async for new in run.updates():
                await queue.put((run, new))
        finally:
            queue.put_nowait((run, None))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        left = len(runs)
        while left:
            run, new = await queue.get()
            left -= new is None
            yield run, new
    finally:
        for task in tasks:
            task.cancel()


async def _whole(runs: list[_Run], rid: str, params: Params, chat: bool) -> dict[str, Any]:
    texts: dict[int, list[str]] = {run.index: [] for run in runs}
    try:
        async for run, new in _merged(runs):
            if new is not None:
                texts[run.index].append(new)
    finally:
        _cancel_unfinished(runs)  # the client went away (the handler was cancelled)
    failed = next((run for run in runs if run.finish == "error"), None)
    if failed is not None:
        raise ApiError(f"the engine failed this request: {failed.handle.error}", status=500, kind="server_error")
    choices = [run.choice("".join(texts[run.index])) for run in runs]
    return completion_body(rid, params.model, choices, usage([run.usage() for run in runs]), chat)


async def _stream(served: Served, runs: list[_Run], rid: str, params: Params, chat: bool) -> AsyncIterator[str]:
    name = params.model
    try:
        if chat:
            yield _event(chunk_body(rid, name, None, None, True, first=True))
        for run in runs if params.echo else ():
            yield _event(chunk_body(rid, name, run.prompt_text(), None, chat, index=run.index))
        shown = {run.index: "" for run in runs}
        async for run, new in _merged(runs):
            if new is not None:
                shown[run.index] += new
                yield _event(chunk_body(rid, name, new, None, chat, index=run.index, logprobs=run.streamed(shown[run.index])))
            elif run.finish == "error":
                yield _event(ApiError(f"the engine failed this request: {run.handle.error}", status=500, kind="server_error").body)
                return
            else:
                last = run.streamed(shown[run.index], final=True)
                yield _event(chunk_body(rid, name, None, run.finish or "stop", chat, index=run.index, logprobs=last))
        use = usage([run.usage() for run in runs])
        if params.include_usage:
            yield _event(chunk_body(rid, name, None, None, chat, use=use))
        yield "data: [DONE]\n\n"
    finally:
        if any(run.finish is None for run in runs):  # the client went away mid-stream: blocks back now
            served.metrics.count("disconnects")
        _cancel_unfinished(runs)


def _cancel_unfinished(runs: list[_Run]) -> None:
    for run in runs:
        if run.finish is None:
            with contextlib.suppress(Exception):
                run.handle.cancel(wait=False)


class _Run:
    """One prompt through the engine (choice ``index`` of its response): submit, wake on each
    update, text out."""

    def __init__(self, served: Served, ids: list[int], params: Params, chat: bool, index: int = 0, prompt: str | None = None,
                 seed: int | None = None):  # fmt: skip
        """``prompt``: the prompt's text as given (echoed as it came), None for token ids; ``seed``:
        this choice's sampling seed."""
        self.served, self.ids, self.params, self.chat, self.index = served, ids, params, chat, index
        self.prompt, self.seed = prompt, seed
        self.sent = 0  # generated tokens whose log-probabilities a stream chunk carried ...
        self.sent_text = 0  # ... and the characters they decode to
        self.text = TextStream(served.tokenizer, params.stop)
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None
        self.seen = 0
        self.finish: str | None = None

    def start(self) -> None:
        """Submit the request to the engine (``ApiError`` if it refuses its spec)."""
        served, params = self.served, self.params
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        options: dict[str, Any] = {} if params.cache is None else {"cache": params.cache}
        if params.ignore_eos:
            options["eos_token_id"] = []
        if params.logprobs is not None:
            options["logprobs"] = params.logprobs
            if params.echo:
                options["prompt_logprobs"] = params.logprobs
        try:
            self.handle = served.engine.submit(  # max_tokens 0 (echo: scoring only): the token is dropped
                self.ids, max_new_tokens=max(1, params.max_tokens), temperature=params.temperature, top_p=params.top_p,
                seed=self.seed, on_update=lambda: loop.call_soon_threadsafe(woken.set), **options,
            )  # fmt: skip
        except (KVCacheError, ValueError) as e:
            raise ApiError(str(e), param="cache" if params.cache else None) from None
        self.woken = woken

    async def updates(self) -> AsyncIterator[str]:
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
                self.finish = handle.finish_reason if handle.finish_reason in ("length", "error") else "stop"
            if new and not self.params.scoring_only:
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

    @property
    def generated(self) -> list[int]:
        """The tokens this choice answers with (none when only the prompt was to be scored)."""
        return [] if self.params.scoring_only else self.handle.tokens

    def choice(self, text: str) -> tuple[str, str, Any]:
        """``(text, finish, logprobs)`` of the whole answer, ``text`` the completion's (the prompt's
        text put before it with ``echo``)."""
        params, tokenizer, handle = self.params, self.served.tokenizer, self.handle
        generated = self.generated[: covered(tokenizer, self.generated, text)]
        logprobs = None
        if params.logprobs is not None and self.chat:
            logprobs = chat_logprobs(tokenizer, handle.logprobs[: len(generated)])
        elif params.logprobs is not None:
            ids, scores = list(generated), handle.logprobs[: len(generated)]
            if params.echo:
                ids, scores = self.ids + ids, handle.prompt_logprobs + scores
            logprobs = completion_logprobs(tokenizer, ids, scores)
        if params.echo:
            text = self.prompt_text() + text
        return text, self.finish or "stop", logprobs

    def streamed(self, text: str, final: bool = False) -> Any:
        """The log-probabilities of the generated tokens that ``text`` (the stream's text so far)
        now covers and that no earlier chunk carried (None when none were asked)."""
        params, tokenizer = self.params, self.served.tokenizer
        if params.logprobs is None or params.scoring_only:
            return None
        scores = self.handle.logprobs
        ids = self.handle.tokens[: len(scores)]
        start, at = self.sent, self.sent_text  # only the tokens past those sent are decoded again
        upto = start + covered(tokenizer, ids[start:], text[at:], whole=not final)
        self.sent, self.sent_text = upto, at + length_of(tokenizer, ids[start:upto])
        if self.chat:
            return chat_logprobs(tokenizer, scores[start:upto])
        return completion_logprobs(tokenizer, ids[start:upto], scores[start:upto], at)

    def prompt_text(self) -> str:
        """The prompt as it came (token ids decoded), for ``echo``."""
        return self.prompt if self.prompt is not None else self.served.tokenizer.decode(self.ids)

    def usage(self) -> tuple[int, int, int]:
        """This request's ``(prompt, completion, cached)`` tokens (counted into the metrics once,
        when asked)."""
        stats, generated = self.handle.stats, len(self.generated)
        self.served.metrics.finished(len(self.ids), generated, stats.reused)
        if self.index % self.params.n:  # a prompt counts once, whatever its n choices
            return 0, generated, 0
        return len(self.ids), generated, stats.reused_pool + stats.reused_store


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
