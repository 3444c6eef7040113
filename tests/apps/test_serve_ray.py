"""``kvcache serve --ray``: two engine replicas on a local Ray Serve cluster (a subprocess, one torch
thread a replica) behind one address, reached by the official ``openai`` client.

- greedy answers equal the model's own ``generate`` (the tiny model's choices are far from ties);
- prefix affinity: a system prompt's later requests find it in their replica's pool
  (``cached_tokens``), with no prompt store to carry it between replicas;
- a replica killed (SIGKILL) under load loses no request (those it held are sent again), and Ray
  starts it again;
- SIGTERM stops the replicas and the cluster, exit code 0.

These run in one test on one cluster; the rest need no cluster.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest

from kvcache.apps.serve.ray_app import routing_text
from kvcache.apps.trained import load_pretrained
from serve_process import ServeProcess, greedy, tiny_chat_model

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve", reason="the ray extra (pip install kvcache[ray])")

BLOCK = 16
SYSTEMS = [f"You are assistant number {i}. Answer every question about caches in one short sentence. " * 3 for i in range(4)]


def replica_pids(root: int) -> list[int]:
    """The engine replicas among ``root``'s descendants (Ray titles them
    ``ray::ServeReplica:kvcache:kvcache-engine``): another cluster's are not counted."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    family, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return sorted(pid for pid in family if is_replica(pid))


def is_replica(pid: int) -> bool:
    try:
        return b"ServeReplica:kvcache:kvcache-engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def chat(server: ServeProcess, system: str, question: str, max_tokens: int = 12):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=max_tokens, temperature=0)


def chat_ids(local, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(local[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.slow  # a Ray cluster: about 20 s to start alone, a minute beside other tests
def test_two_replicas_answer_as_generate_keep_prefixes_survive_a_kill_and_stop_on_sigterm(tmp_path):
    """One cluster for every check (a cluster takes about half a minute to start, and one test
    keeps it on one xdist worker)."""
    model_dir = tiny_chat_model(tmp_path)
    local = load_pretrained(model_dir)
    server = ServeProcess(tmp_path, "--ray", "--replicas", "2", "--model", str(model_dir), "--block-size", str(BLOCK),
                          "--max-seqs", "8", "--max-bytes", "16M").start(timeout=240)  # fmt: skip
    try:
        replicas = replica_pids(server.process.pid)
        assert len(replicas) == 2, replicas
        answers_equal_generate_and_a_system_prompt_stays_on_its_replica(server, local)
        a_replica_killed_under_load_loses_no_request_and_comes_back(server, replicas[0])
        replicas = replica_pids(server.process.pid)
    finally:
        code = server.stop(timeout=120)
    assert code == 0, server.output()
    assert not [pid for pid in replicas if is_replica(pid)], "replicas left running after SIGTERM"


def answers_equal_generate_and_a_system_prompt_stays_on_its_replica(server, local):
    for system in SYSTEMS:
        shared = os.path.commonprefix([chat_ids(local, system, "What is a cache?"), chat_ids(local, system, "Why?")])
        whole_blocks = len(shared) // BLOCK * BLOCK
        for i, question in enumerate(("What is a cache?", "Where is it kept?", "Why does it help?")):
            answer = chat(server, system, question)
            assert answer.choices[0].message.content == greedy(local, chat_ids(local, system, question), 12), (system, question)
            cached = answer.usage.prompt_tokens_details.cached_tokens
            if i > 0:  # the replica that computed this system prompt serves it again
                assert cached >= whole_blocks, (system, question, cached, whole_blocks)


def a_replica_killed_under_load_loses_no_request_and_comes_back(server, victim: int):
    questions = [f"Question {i}: what does a cache keep?" for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat, server, SYSTEMS[i % 2], q, 24) for i, q in enumerate(questions)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        answers = [f.result() for f in futures]  # none raises: a request its replica held is sent again
    assert all(a.choices[0].message.content is not None for a in answers)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(set(replica_pids(server.process.pid)) - {victim}) < 2:
        time.sleep(1)
    assert len(set(replica_pids(server.process.pid)) - {victim}) == 2, "Ray did not start the killed replica again within 60 s"
    assert chat(server, SYSTEMS[0], "Still there?").choices[0].message.content is not None


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]}]}', "system: S\nuser: Q\n"),
        ("/v1/completions", b'{"prompt": "Once"}', "Once"),
        ("/v1/completions", b'{"prompt": ["Once", "Twice"]}', "Once"),
        ("/v1/completions", b'{"prompt": [1, 2, 3]}', "1 2 3"),
        ("/v1/completions", b"not json", ""),
        ("/v1/models", b"", ""),
    ],
)
def test_the_text_a_request_is_routed_by(path, body, text):
    assert routing_text(path, body) == text


def test_the_application_builder_takes_text_arguments_and_refuses_unknown_ones():
    from kvcache.apps.serve.ray_app import ENGINE, app_builder

    app = app_builder({"model": "tiny", "replicas": "3", "router": "default", "max_bytes": "1048576", "cpus": "0.5"})
    engine = app._bound_deployment.init_args[0]._bound_deployment  # the engine deployment the ingress is bound to
    assert engine.name == ENGINE and engine.num_replicas == 3 and engine.ray_actor_options["num_cpus"] == 0.5
    assert engine.init_args[0]["max_bytes"] == 1048576 and engine.init_args[0]["model"] == "tiny"
    scaled = app_builder({"model": "tiny", "replicas": "1", "max_replicas": "3", "max_seqs": "8"})._bound_deployment.init_args[0]._bound_deployment
    scaling = scaled._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 8)
    with pytest.raises(ValueError, match="max_replicas must be at least replicas"):
        app_builder({"replicas": "2", "max_replicas": "1"})
    with pytest.raises(ValueError, match="unknown arguments \\['replica'\\]"):
        app_builder({"replica": "2"})
    with pytest.raises(ValueError, match="router must be one of"):
        app_builder({"router": "random"})


def test_the_shipped_serve_config_builds():
    import yaml

    from kvcache.apps.serve.ray_app import app_builder

    config = yaml.safe_load((Path(__file__).parents[2] / "docs" / "ray-serve.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "kvcache.apps.serve.ray_app:app_builder"
    assert app_builder(application["args"]) is not None


@pytest.mark.parametrize("args", [["--replicas", "2"], ["--max-replicas", "3"], ["--router", "prefix"], ["--ray-address", "auto"]])
def test_ray_options_without_ray_are_refused(capsys, args):
    from kvcache.apps.cli import main

    assert main(["serve", "--model", "tiny", *args]) != 0
    assert "only apply with --ray" in capsys.readouterr().err


def test_the_bench_counts_a_system_messages_whole_blocks_on_its_later_requests_only():
    from kvcache.apps.bench.serve_ray import FULL, Workload, summarize
    from kvcache.apps.bench.serve_workload import Sample

    s = FULL.__class__(**{**FULL.__dict__, "systems": 2, "requests": 5, "block_size": 16})
    w = Workload(Path("."), ("a", "b"), ("u",), "o", (1, 0, 1, 1, 0), 3, 100, s)  # 3 whole blocks: 48 tokens a system message
    cached = [0, 0, 48, 64, 16]  # the first two are first requests; 64 counts as 48 (a user block too)
    samples = [Sample(sent=0.0, texts=[0.1 * (i + 1)], end=1.0, tokens=4, cached_tokens=c) for i, c in enumerate(cached)]
    got = summarize(w, samples, wall=2.0)
    assert got["cached_share"] == (48 + 48 + 16) / (3 * 48)
    assert got["tokens_per_s"] == 20 / 2.0
    assert got["ttft_p50_s"] == pytest.approx(0.4) and got["ttft_p95_s"] == pytest.approx(0.5)  # the later three: 0.3, 0.4, 0.5
    assert got["ttft_p50_all_s"] == pytest.approx(0.3) and got["ttft_p95_all_s"] == pytest.approx(0.5)


@pytest.mark.parametrize(("args", "message"), [(["--replicas", "0"], "--replicas must be at least 1"),
                                               (["--replicas", "3", "--max-replicas", "2"], "--max-replicas must be at least --replicas"),
                                               (["--imbalance", "0"], "--imbalance must be positive")])  # fmt: skip
def test_bad_ray_options_are_refused_before_ray_starts(capsys, args, message):
    from kvcache.apps.cli import main

    assert main(["serve", "--model", "tiny", "--ray", *args]) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "messages"),
    [(b'{"ok": true}', [(200, [(b"content-type", b"application/json")], b'{"ok": true}')]),
     (b"", [(200, [(b"content-type", b"application/json")], b"")])],
)  # fmt: skip
def test_a_replica_sends_the_status_with_the_first_chunk(body, messages):
    """The status never travels alone: a replica killed after sending it would leave the client an
    empty 200 (what CI once saw under the kill)."""
    import asyncio
    from types import SimpleNamespace

    from kvcache.apps.serve.ray_app import Call, Replica

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def collect():
        call = Call("POST", "/v1/x", "", (), b"{}", "", ())
        return [part async for part in Replica.handle(SimpleNamespace(app=app), call)]

    assert asyncio.run(collect()) == messages
