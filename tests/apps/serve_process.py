"""A ``kvcache serve`` subprocess on a free loopback port, for the server tests: started with the
options given, ready once ``/health`` answers, stopped with SIGTERM (its exit code and log kept)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvcache.apps.bench.serve_workload import tiny_chat_folder
from redis_server import free_port


def tiny_chat_model(folder: Path) -> Path:
    """A copy of the shipped tiny model whose tokenizer has a ChatML template (it has none), so the
    chat endpoint can run on it: the one ``kvcache bench serve`` makes for its tiny runs."""
    target = folder / "tiny-chat"
    return target if target.exists() else tiny_chat_folder(folder)


def greedy(local, ids: list[int], new: int) -> str:
    """The text of ``new`` greedy tokens after ``ids`` by the model's own ``generate`` (``local``:
    ``(model, tokenizer)``), the reference a server's temperature-0 answer is held to."""
    import torch

    model, tokenizer = local
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def tiny_chat_server(folder: Path, model_dir: Path) -> ServeProcess:
    """The server the client tests share, started: ``model_dir``, 16-token blocks, 8 requests at
    once, a 64 MiB pool."""
    return ServeProcess(folder, "--model", str(model_dir), "--block-size", "16", "--max-seqs", "8",
                        "--max-bytes", "64M").start()  # fmt: skip


class ServeProcess:
    def __init__(self, folder: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"serve-{self.port}.log"
        self.args = [sys.executable, "-m", "kvcache", "serve", "--port", str(self.port), *args]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> ServeProcess:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvcache serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvcache serve did not answer /health in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def terminate(self) -> None:
        """SIGTERM (a drain), without waiting."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """One sample of ``/metrics``, by its full name with labels (``kvcache_pool_blocks{state="used"}``)."""
        text = httpx.get(self.url + "/metrics", headers=headers or {}, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(f"{name} not in /metrics:\n{text}")
