"""Two ``kvcache serve`` replicas on one real ``redis-server`` prompt store: a prompt one computed
is served from the store by the other (``cached_tokens`` > 0), with the same text; and a replica
whose Redis goes away keeps serving, with one warning."""

from __future__ import annotations

import pytest

from redis_server import RedisServer
from serve_process import ServeProcess, tiny_chat_model

openai = pytest.importorskip("openai")

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4


def ask(process: ServeProcess, question: str):
    c = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12, temperature=0)


@pytest.mark.slow  # two server processes and a redis-server (about 18 s); test_engine_tier.py covers the store's sharing and loss in process
def test_replicas_share_prompts_through_redis_and_survive_its_loss(tmp_path):
    redis = RedisServer(tmp_path)
    redis.start()
    model = tiny_chat_model(tmp_path)
    options = ("--model", str(model), "--max-bytes", "16M", "--block-size", "16", "--prompt-store", redis.url(), "--store-chunk", "32")
    first = ServeProcess(tmp_path, *options).start()
    second = ServeProcess(tmp_path, *options).start()
    try:
        computed = ask(first, "What is a cache?")
        assert computed.usage.prompt_tokens_details.cached_tokens == 0
        served = ask(second, "What is a cache?")
        assert served.usage.prompt_tokens_details.cached_tokens >= 64, served.usage
        assert served.choices[0].message.content == computed.choices[0].message.content
        assert second.metric('kvcache_cached_prompt_tokens_total{tier="store"}') >= 64

        redis.stop()
        for question in ("Where is it kept?", "Why does it help?"):
            assert ask(second, question).choices[0].message.content is not None
        assert second.output().count("prompt store unavailable") == 1, second.output()
    finally:
        codes = first.stop(), second.stop()
        redis.stop()
    assert codes == (0, 0)
