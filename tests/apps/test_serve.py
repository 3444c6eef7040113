"""``kvcache serve``: a real server (a subprocess on a free loopback port) and real clients (the
official ``openai`` package and raw HTTP through ``httpx``), on the shipped tiny model (given a
ChatML template, so chat runs on it too).

Greedy answers (temperature 0) are compared with the text of the model's own ``generate`` in this
process, token for token: the tiny model is trained, its greedy choices are far from ties (a tie
would show here as a failure naming the prompt, not pass silently).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from kvcache.apps.trained import load_pretrained
from kvcache.attention.half_precision import HalfPrecision, half_precision_support
from serve_process import ServeProcess, greedy, tiny_chat_model, tiny_chat_server

openai = pytest.importorskip("openai")  # the test extra brings it; without it this file cannot run

PROMPTS = ["Once upon a time", "The pass key is 31415. The pass key is", "Alice and Bob went to", "In a hole in the ground"]
SYSTEM = "You are a helpful assistant. " * 12  # long enough to fill whole blocks of the pool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def local(model_dir):
    return load_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = tiny_chat_server(tmp_path_factory.mktemp("serve"), model_dir)
    yield process
    assert process.stop() == 0, process.output()


def client(server: ServeProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def completion_ids(local, prompt: str) -> list[int]:
    return local[1](prompt, add_special_tokens=True)["input_ids"]


def chat_ids(local, messages) -> list[int]:
    return list(local[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# ---- answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completions_equal_generate_streamed_or_not(server, local, prompt):
    c = client(server)
    expected = greedy(local, completion_ids(local, prompt), 24)
    whole = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(completion_ids(local, prompt))
    assert whole.usage.completion_tokens <= 24 and whole.choices[0].finish_reason in ("stop", "length")
    parts = [chunk.choices[0].text for chunk in c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24,
                                                                     temperature=0, stream=True) if chunk.choices]
    assert "".join(parts) == expected


def test_a_batch_of_prompts_gets_one_choice_each_in_order_streamed_or_not(server, local):
    # As lm-evaluation-harness sends them: a list of strings, or a list of token-id lists.
    c = client(server)
    expected = [greedy(local, completion_ids(local, p), 12) for p in PROMPTS]
    for batch in (PROMPTS, [completion_ids(local, p) for p in PROMPTS]):
        whole = c.completions.create(model="tiny-chat", prompt=batch, max_tokens=12, temperature=0)
        assert [ch.index for ch in whole.choices] == list(range(len(PROMPTS)))
        assert [ch.text for ch in whole.choices] == expected
        assert whole.usage.prompt_tokens == sum(len(completion_ids(local, p)) for p in PROMPTS)
        texts = {i: "" for i in range(len(PROMPTS))}
        finished = set()
        for chunk in c.completions.create(model="tiny-chat", prompt=batch, max_tokens=12, temperature=0, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.text
                if ch.finish_reason is not None:
                    finished.add(ch.index)
        assert [texts[i] for i in range(len(PROMPTS))] == expected and finished == set(range(len(PROMPTS)))


def log_softmax(local, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(local[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_and_logprobs_score_the_prompt_as_the_model_does(server, local):
    # lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1.
    prompts = [completion_ids(local, p)[1:] for p in PROMPTS[:3]]  # without <bos>, as a client tokenizes
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny-chat", "prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    for ids, choice in zip(prompts, r.json()["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = log_softmax(local, ids)
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4
            (alt, value), = lp["top_logprobs"][p].items()
            assert abs(value - ref[p - 1].max().item()) < 1e-4
        assert abs(lp["token_logprobs"][-1] - ref[-1].max().item()) < 1e-4  # greedy: the answer is the top token
        assert choice["text"].startswith(local[1].decode(ids)) and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 3


def pool_hits(server) -> int:
    text = httpx.get(server.url + "/metrics").text
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith('kvcache_cached_prompt_tokens_total{tier="pool"}')))


def test_n_choices_share_one_computed_prompt(server, local):
    c = client(server)
    prompt = "Choices share this. " * 10 + PROMPTS[2]  # whole blocks to share, in no other test
    expected = greedy(local, completion_ids(local, prompt), 8)
    before = pool_hits(server)
    whole = c.completions.create(model="tiny-chat", prompt=[prompt, PROMPTS[0]], max_tokens=8, temperature=0, n=3)
    blocks = len(completion_ids(local, prompt)) // 16  # the server's block size
    assert pool_hits(server) - before >= 2 * (blocks - 1) * 16  # the two later choices took the first's blocks
    assert [ch.index for ch in whole.choices] == list(range(6))
    assert [ch.text for ch in whole.choices[:3]] == [expected] * 3
    assert whole.usage.prompt_tokens == len(completion_ids(local, prompt)) + len(completion_ids(local, PROMPTS[0]))
    sampled = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Tell me a story."}],
                                        max_tokens=12, temperature=1.0, seed=7, n=3)  # fmt: skip
    again = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Tell me a story."}],
                                      max_tokens=12, temperature=1.0, seed=7, n=3)  # fmt: skip
    texts = [ch.message.content for ch in sampled.choices]
    assert texts == [ch.message.content for ch in again.choices] and len(set(texts)) > 1  # seeded, and independent


def test_max_tokens_0_with_echo_scores_the_prompt_only(server, local):
    c = client(server)
    whole = c.completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=0, temperature=0)
    ids = completion_ids(local, PROMPTS[1])
    assert whole.choices[0].text == PROMPTS[1] and whole.usage.completion_tokens == 0
    assert len(whole.choices[0].logprobs.token_logprobs) == len(ids)
    assert whole.choices[0].logprobs.top_logprobs[1] == {}
    streamed = c.completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=0, echo=True, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == PROMPTS[1]
    echoed = c.completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=6, echo=True, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in echoed if ch.choices) == PROMPTS[1] + greedy(local, ids, 6)


def test_streamed_logprobs_are_the_whole_answers_in_pieces(server, local):
    c = client(server)
    for prompt in PROMPTS[:2]:
        whole = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0, logprobs=2).choices[0].logprobs
        tokens, values, offsets = [], [], []
        for chunk in c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0, logprobs=2, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                lp = chunk.choices[0].logprobs
                tokens += lp.tokens
                values += lp.token_logprobs
                offsets += lp.text_offset
        # The two requests may be packed or reuse the pool differently: the same tokens, float32-near values.
        assert (tokens, offsets) == (whole.tokens, whole.text_offset)
        assert max(abs(a - b) for a, b in zip(values, whole.token_logprobs)) < 1e-4
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1)
    pieces = [t for chunk in c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                                       logprobs=True, top_logprobs=1, stream=True)
              if chunk.choices and chunk.choices[0].logprobs is not None for t in chunk.choices[0].logprobs.content]  # fmt: skip
    expected = whole.choices[0].logprobs.content
    assert [t.token for t in pieces] == [t.token for t in expected]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(pieces, expected)) < 1e-4


def test_chat_logprobs_with_top_alternatives(server, local):
    c = client(server)
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = chat_ids(local, messages)
    reply = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    text_ids = local[1](reply.choices[0].message.content, add_special_tokens=False)["input_ids"]
    ref = log_softmax(local, ids + text_ids)
    for i, t in enumerate(content):
        assert abs(t.logprob - ref[len(ids) - 1 + i].max().item()) < 1e-4 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and bytes(t.bytes).decode() == t.token


def test_chat_equals_generate_streamed_or_not(server, local):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    expected = greedy(local, chat_ids(local, messages), 20)
    whole = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_repeated_system_prompt_is_served_from_the_pool(server, local):
    c = client(server)
    first = c.chat.completions.create(model="tiny-chat", max_tokens=4, temperature=0,
                                      messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
    second = c.chat.completions.create(model="tiny-chat", max_tokens=4, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who?"}])
    assert second.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) // 2
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert first.usage.prompt_tokens > 0


def test_stop_strings_end_the_text_before_them(server, local):
    prompt = PROMPTS[2]
    full = greedy(local, completion_ids(local, prompt), 30)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {full!r}"
    got = client(server).completions.create(model="tiny-chat", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_answer(server):
    c = client(server)
    answers = [c.completions.create(model="tiny-chat", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=7).choices[0].text
               for _ in range(2)]  # fmt: skip
    assert answers[0] == answers[1]


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server).models.list().data] == ["tiny-chat"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvcache_requests_total", "kvcache_time_to_first_token_seconds_bucket", "kvcache_pool_blocks",
                 "kvcache_inter_token_latency_seconds_count", "kvcache_cached_prompt_tokens_total", "kvcache_preemptions_total"):  # fmt: skip
        assert name in text


# ---- bad requests -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": 42}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": ["hi", 3]}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": ["hi", ""]}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "logprobs": 1, "echo": True, "stream": True}, 400, "logprobs"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "max_tokens": 5000}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"model": "tiny-chat", "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "cache": "kvzip:budget=8"}, 400, "cache"),
    ],
)
def test_bad_requests_get_the_openai_error_shape(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_a_prompt_longer_than_the_context_says_so(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-chat", "prompt": "word " * 5000, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ---- many clients, and clients that leave ------------------------------------------------------


def test_thirty_two_clients_at_once_all_get_complete_right_answers(server, local):
    expected = {p: greedy(local, completion_ids(local, p), 12) for p in PROMPTS}
    failures, done = [], []

    def worker(i: int) -> None:  # three requests each, streamed and not, over the four prompts
        c = client(server)
        for n in range(3):
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            try:
                if (i + n) % 2:
                    text = "".join(ch.choices[0].text for ch in c.completions.create(
                        model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, stream=True) if ch.choices)
                else:
                    text = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
            except Exception as e:  # noqa: BLE001 - every failure is collected and reported
                failures.append(f"client {i}: {type(e).__name__}: {e}")
                return
            if text != expected[prompt]:
                failures.append(f"client {i}: {prompt!r} -> {text!r}, expected {expected[prompt]!r}")
        done.append(n + 1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:5]
    assert done == [3] * 32
    assert server.metric('kvcache_pool_blocks{state="used"}') == 0


def test_a_client_that_leaves_mid_stream_gives_its_blocks_back(server):
    used_before = server.metric('kvcache_pool_blocks{state="used"}')
    gone = server.metric("kvcache_client_disconnects_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": "tiny-chat", "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}) as r:  # fmt: skip
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert server.metric('kvcache_pool_blocks{state="used"}') > used_before
    deadline = time.monotonic() + 20
    while server.metric('kvcache_pool_blocks{state="used"}') != used_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric('kvcache_pool_blocks{state="used"}') == used_before
    assert server.metric("kvcache_client_disconnects_total") == gone + 1


# ---- servers of their own -----------------------------------------------------------------------


KEY = "s3cret"


@pytest.fixture(scope="module")
def narrow(model_dir, tmp_path_factory):
    """A server behind an API key that runs one request at a time and queues one more, its model in
    bfloat16 (float32 where half-precision matmul crashes here, and the bfloat16 test is skipped):
    one process for the three tests that need those settings; none changes what the others see."""
    dtype = "float32" if half_precision_support().status is HalfPrecision.BROKEN else "bfloat16"
    process = ServeProcess(tmp_path_factory.mktemp("narrow"), "--model", str(model_dir), "--max-bytes", "16M",
                           "--block-size", "16", "--max-seqs", "1", "--max-queue", "1", "--dtype", dtype,
                           env={"KVCACHE_API_KEY": KEY}).start()  # fmt: skip
    yield process
    assert process.stop() == 0, process.output()


def test_an_api_key_guards_every_endpoint_but_health(narrow):
    assert httpx.get(narrow.url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(narrow.url + path).status_code == 401
        assert httpx.get(narrow.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(narrow.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(narrow, "wrong").completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
    assert client(narrow, KEY).completions.create(model="tiny-chat", prompt="hi", max_tokens=2).choices


def test_ignore_eos_generates_past_the_end_of_sequence_token(model_dir, local, tmp_path):
    """vLLM's ``ignore_eos`` (load generators send it): on a copy of the model whose end-of-sequence
    token is the first one it answers, a request stops there, and with ``ignore_eos`` goes on to
    ``max_tokens`` with the model's own greedy tokens."""
    import shutil

    prompt = PROMPTS[2]
    ids = completion_ids(local, prompt)
    with torch.inference_mode():
        first = int(local[0](torch.tensor([ids])).logits[0, -1].argmax())
    folder = tmp_path / "eos" / "tiny-chat"  # served under its folder's name
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": first}))
    process = ServeProcess(tmp_path, "--model", str(folder), "--max-bytes", "16M").start()
    try:
        c = client(process)
        stopped = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0)
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
        going = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
        assert going.choices[0].finish_reason == "length" and going.usage.completion_tokens == 12
        assert going.choices[0].text == greedy(local, ids, 12)
    finally:
        assert process.stop() == 0


@pytest.mark.half_precision
def test_dtype_bfloat16_serves_the_engines_bfloat16_answers(local, model_dir, narrow):
    """``--dtype bfloat16`` (the narrow server's) loads the weights (and so the pool) in bfloat16,
    as the server's first line says; its greedy answer is the one an engine over the same model in
    bfloat16 gives in this process (bfloat16 rounds differently from float32, so float32's answer is
    no reference)."""
    from kvcache import Engine
    from kvcache.apps.trained import load_pretrained

    model, tokenizer = load_pretrained(model_dir, "cpu", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = completion_ids(local, PROMPTS[0])
    want = Engine(model, block_size=16, max_bytes=16 * 2**20).generate_batch([ids], max_new_tokens=10, eos_token_id=[])[0]
    got = client(narrow, KEY).completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert "model in bfloat16" in narrow.output() and "model in float32" not in narrow.output()


def test_a_full_queue_answers_503_with_retry_after(narrow):
    statuses, retry = [], []

    def one() -> None:
        r = httpx.post(narrow.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny-chat", "prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0})  # fmt: skip
        statuses.append(r.status_code)
        if r.status_code == 503:
            retry.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
    assert all(r is not None and int(r) >= 1 for r in retry)


def test_sigterm_drains_running_requests_then_exits_0(model_dir, tmp_path):
    process = ServeProcess(tmp_path, "--model", str(model_dir), "--max-bytes", "16M").start()
    got: dict = {}

    def long_request() -> None:
        with httpx.stream("POST", process.url + "/v1/completions", timeout=60,
                          json={"model": "tiny-chat", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
                                "stream": True}) as r:  # fmt: skip
            got["lines"] = [line for line in r.iter_lines() if line.startswith("data:")]

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while process.metric('kvcache_pool_blocks{state="used"}') == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    process.terminate()
    t.join(timeout=60)
    assert process.process.wait(60) == 0, process.output()
    assert got["lines"][-1] == "data: [DONE]", "the running request was cut off"
    finish = json.loads(got["lines"][-2][5:])["choices"][0]["finish_reason"]
    assert finish in ("stop", "length")
    with pytest.raises(httpx.ConnectError):
        httpx.post(process.url + "/v1/completions", json={"model": "tiny-chat", "prompt": "hi"}, timeout=5)
    process.stop()


def test_serve_compile_reaches_the_engine_which_refuses_coded_blocks_before_listening(capsys):
    from kvcache.apps.cli import main

    assert main(["serve", "--model", "tiny", "--compile", "--cache", "quantized:bits=8", "--port", "1"]) != 0
    err = capsys.readouterr().err
    assert "full-precision blocks" in err and "compile=False" in err
