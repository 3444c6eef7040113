"""The parts of suite ``serve``: the chat requests (real text), a server as a subprocess on a free
loopback port, and a load of concurrent streaming clients timed from the server-sent events they get.

A request is timed on the client (``time.perf_counter``): when it is sent, when each event that
carries text arrives (before it is parsed), and when the stream ends. Its time to first token
(TTFT) is sent to the first text event. Its inter-token latencies are the gaps between consecutive
text events; tokens that came in one event (``usage.completion_tokens`` more than the text events)
count as 0 s apart, since the client got them together, so a request of ``n`` tokens gives ``n - 1``
gaps whichever way a server groups its tokens into events. A request is an error when the answer
is not HTTP 200, the stream carries an error event, breaks, or ends without a ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import KVCacheError
from ..run_options import RunOptions
from ..serve.text import chat_ids
from .prompt_request import Prompts

#: What the system message opens with, before the source text (as suite ``prompt``'s system turn).
SYSTEM_HEAD = "You are a helpful assistant. Answer questions about this source code:\n"
USER_HEAD = "What does this do?\n"


# ---- the chat requests ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTexts:
    """The messages: one shared ``system`` message, distinct ``users`` (request ``i`` takes user
    ``i`` modulo their number), and ``other_system``, a system message of the same size sharing no
    text with ``system`` (for warm-up requests: it leaves no block of the measured prompts behind).
    Token counts are the model's chat template's: ``system_turn`` (the templated system message
    alone) and ``prompt`` (the largest templated request: system, user and the assistant's opening)."""

    system: str
    users: tuple[str, ...]
    other_system: str
    system_turn: int
    user_turn: int
    prompt: int

    def messages(self, i: int, system: str | None = None) -> list[dict[str, str]]:
        """Request ``i``'s messages (``system``: another system message instead of the shared one)."""
        return [{"role": "system", "content": self.system if system is None else system},
                {"role": "user", "content": self.users[i % len(self.users)]}]  # fmt: skip


def chat_texts(tokenizer: Any, system_tokens: int, user_tokens: int, users: int) -> ChatTexts:
    """Messages of the package's source text (suite ``prompt``'s corpus, ``Prompts.text``): a system
    message of about ``system_tokens`` tokens from the corpus' start, ``users`` user messages of
    about ``user_tokens`` each from its far half (997 tokens apart, as ``Prompts.user`` takes
    them), and a warm-up system message from its first quarter (without the system head)."""
    tokenizer.model_max_length = 2**62  # our own copy: the corpus is tokenized whole, never run through a model
    corpus = Prompts(tokenizer, len(tokenizer)).text
    if not corpus:
        raise KVCacheError("the tokenizer made no tokens of the prompt text")

    def text(head: str, tokens: int, where: int) -> str:
        n = max(1, tokens - len(tokenizer.encode(head, add_special_tokens=False)))
        start = where % len(corpus)
        return head + tokenizer.decode((corpus[start:] + corpus)[:n])

    system = text(SYSTEM_HEAD, system_tokens, 0)
    user_texts = tuple(text(USER_HEAD, user_tokens, len(corpus) // 2 + i * 997) for i in range(users))
    other = text("", system_tokens, len(corpus) // 4)  # not even the head in common: no shared block
    texts = ChatTexts(system, user_texts, other, 0, 0, 0)
    turn = len(tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=True, return_dict=False))
    prompts = [len(chat_ids(tokenizer, texts.messages(i))) for i in range(users)]
    return ChatTexts(system, user_texts, other, turn, prompts[0] - turn, max(prompts))


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The request every server gets: greedy, streamed, usage in the stream (a server that always
    sends usage may ignore ``stream_options``)."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


# ---- one streamed request --------------------------------------------------------------------


@dataclass
class Sample:
    """One request as its client saw it: ``perf_counter`` seconds when it was ``sent``, when each
    text event arrived (``texts``) and when it ended; tokens generated (``usage.completion_tokens``,
    else the text events); the usage's prompt and cached tokens where sent; ``error`` (empty: none)."""

    sent: float
    texts: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish: str | None = None
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.texts[0] - self.sent if self.texts else None

    def gaps_s(self) -> list[float]:
        """Inter-token latencies (``tokens - 1``; see the module docstring)."""
        gaps = [b - a for a, b in zip(self.texts, self.texts[1:])]
        return gaps + [0.0] * max(0, self.tokens - len(self.texts))

    def summary(self) -> dict[str, Any]:
        """The JSON form: times in seconds from ``sent``."""
        return {"ttft_s": self.ttft_s, "e2e_s": self.end - self.sent, "tokens": self.tokens, "text_events": len(self.texts),
                "cached_tokens": self.cached_tokens, "finish": self.finish, "error": self.error}  # fmt: skip


def read_event(sample: Sample, data: str, now: float) -> bool:
    """Note one ``data:`` payload arriving at ``now`` into ``sample``; True when the stream is over
    (``[DONE]`` or an error event)."""
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if not isinstance(event, dict) or "error" in event:
        sample.error = f"error event: {json.dumps(event)[:300]}"
        return True
    choices = event.get("choices") or []
    if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
        sample.texts.append(now)
    sample.finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), sample.finish)
    usage = event.get("usage")
    if usage:
        sample.tokens = int(usage.get("completion_tokens", 0))
        sample.prompt_tokens = usage.get("prompt_tokens")
        sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return False


async def stream_chat(client: Any, url: str, body: dict[str, Any]) -> Sample:
    """POST ``body`` to ``url`` and read its event stream to the end (``client``: an
    ``httpx.AsyncClient``). Never raises for the server's faults: they are the sample's ``error``."""
    import httpx

    sample = Sample(time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                sample.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:") and read_event(sample, line[5:].strip(), now):
                        break
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        sample.error = f"broken stream: {type(e).__name__}: {e}"
    sample.end = time.perf_counter()
    if not sample.error and sample.finish is None:
        sample.error = "broken stream: it ended without a finish_reason"
    if not sample.tokens:
        sample.tokens = len(sample.texts)
    return sample


# ---- a load of concurrent clients -------------------------------------------------------------


@dataclass
class Load:
    """One load on one server: ``clients`` clients each sending requests one after another until
    ``window_s`` seconds after ``start``; every request sent by then is awaited (``samples``, in
    the order they ended). ``reason``: why it could not run (then nothing else)."""

    clients: int
    start: float = 0.0
    window_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    warm_up: list[Sample] = field(default_factory=list)
    reason: str = ""


def http_client(connections: int, timeout_s: float) -> Any:
    """An ``httpx.AsyncClient`` for loopback servers: ``connections`` connections, ``timeout_s`` to
    wait for any byte, no proxies from the environment."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False)


async def _one_client(client: Any, url: str, body: Callable[[int], dict], numbers: Iterator[int], deadline: float,
                      out: list[Sample]) -> None:  # fmt: skip
    while time.perf_counter() < deadline:
        sample = await stream_chat(client, url, body(next(numbers)))
        out.append(sample)
        if sample.error:  # a refusal comes back at once: pace the retries
            await asyncio.sleep(0.1)


def run_load(url: str, body: Callable[[int], dict], clients: int, window_s: float, timeout_s: float = 600.0) -> Load:
    """``clients`` concurrent clients streaming ``body(i)`` (request ``i``, numbered in the order
    sent) to ``url`` for ``window_s`` seconds (see ``Load``)."""
    numbers = itertools.count()  # request i takes user message i: the same sequence on every server

    async def load() -> Load:
        out = Load(clients, time.perf_counter(), window_s)
        async with http_client(clients, timeout_s) as client:
            deadline = out.start + window_s
            tasks = [_one_client(client, url, body, numbers, deadline, out.samples) for _ in range(clients)]
            await asyncio.gather(*tasks)
        return out

    return asyncio.run(load())


def send_together(url: str, bodies: Sequence[dict], timeout_s: float = 600.0) -> list[Sample]:
    """Each of ``bodies`` streamed to ``url`` at once; their samples in order."""

    async def send() -> list[Sample]:
        async with http_client(len(bodies), timeout_s) as client:
            return list(await asyncio.gather(*(stream_chat(client, url, b) for b in bodies)))

    return asyncio.run(send())


# ---- a server subprocess -----------------------------------------------------------------------


class ServerError(KVCacheError):
    """A server that did not start or answer; the message ends with its log's last lines."""


def log_tail(path: Path, lines: int = 8) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


@contextlib.contextmanager
def serving(command: Callable[[int], list[str]], env: dict[str, str], log: Path, startup_s: float = 300.0) -> Iterator[str]:
    """``command(port)`` run on a free loopback port, output to ``log``; yields its base URL once
    ``GET /health`` answers 200; stopped on exit (SIGTERM, then SIGKILL after 30 s). ``ServerError``
    if it exits or does not answer within ``startup_s`` seconds."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        process = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(process, url, log, startup_s)
            yield url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30.0)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_healthy(process: subprocess.Popen, url: str, log: Path, startup_s: float) -> None:
    import httpx

    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"failed to start (exit code {process.returncode}): {log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise ServerError(f"did not answer /health within {startup_s:g} s: {log_tail(log)}")


def server_env(threads: int, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment for a server: ``threads`` OpenMP/MKL threads, the Hugging Face hub
    offline and its update check off, and the names in ``drop`` removed (an API key)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                "HF_HUB_DISABLE_UPDATE_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    return env


# ---- the model folder ----------------------------------------------------------------------------

#: A ChatML template for the shipped tiny model (its tokenizer has none), for ``tiny`` runs. It
#: starts with ``<bos>`` as the tokenizer's own encoding does: a chat template is rendered without
#: special tokens, so a template that left it out would give the model text it never saw unprefixed.
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def kv_bytes_per_token(folder: Path) -> int:
    """Bytes of one token's fp32 keys and values over every layer, from the folder's config.json."""
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def tiny_chat_folder(parent: Path) -> Path:
    """A copy of the shipped tiny model whose tokenizer has a ChatML template."""
    from ..trained import MODEL_DIR

    target = parent / "tiny-chat"
    shutil.copytree(MODEL_DIR, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": CHATML}))
    return target


def model_folder(options: RunOptions, scratch: Path) -> tuple[Path, str]:
    """(folder, name in words): SmolLM2-135M-Instruct as converted here, or the tiny chat copy."""
    if options.tiny:
        return tiny_chat_folder(scratch), "the shipped tiny model (a ChatML template added)"
    from ... import models

    return models.model_path("smollm2", progress=options.progress), "smollm2 (SmolLM2-135M-Instruct, fp32)"


@contextlib.contextmanager
def scratch_folder() -> Iterator[Path]:
    """A temporary folder for a run's model copy and server logs."""
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-serve-") as folder:
        yield Path(folder)
