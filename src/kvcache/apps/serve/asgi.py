"""Call an ASGI app in process: one HTTP request in, its answer out as ``(status, headers)`` and then
the body's chunks (how a Ray Serve replica runs ``kvcache serve``'s app, ``ray_app.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def call(app: Any, method: str, path: str, query: str, headers: tuple[tuple[bytes, bytes], ...], body: bytes) -> AsyncIterator[Any]:
    """Run ``app`` on one request; yields ``(status, headers)`` (headers as ``(bytes, bytes)``
    pairs), then each non-empty body chunk as bytes. If the consumer stops early, the app is told
    the client went away (``http.disconnect``), as a server would."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower(), v) for k, v in headers], "client": None, "server": None,
    }  # fmt: skip
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(task, timeout=5)
