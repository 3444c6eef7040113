"""The other process of the reliability suite: saves that get killed, run out of disk or race.
The suite forks it (``forked.py``: ``main([...])``) except for ``load``, which measures its peak
memory and so runs as a fresh interpreter:

    python reliability_worker.py save-loop PATH SEED COUNT   # print "ready", then save COUNT times
    python reliability_worker.py save-limited PATH SEED BYTES  # RLIMIT_FSIZE=BYTES, SIGXFSZ ignored
    python reliability_worker.py load PATH...                # load each (model: tiny llama config), report

Each prints one JSON line with what happened. Caches are built without a model (keys and values
are seeded random tensors).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time

import torch

import kvcache
from kvcache.apps.tiny import tiny_config

CONFIG = tiny_config("llama")  # 4 full-attention layers, 2 KV heads of dim 16


def make(seed: int, tokens: int) -> kvcache.KVCache:
    """A growable cache of ``tokens`` seeded random keys/values per layer (~1 KiB a token)."""
    cache = kvcache.make_cache(CONFIG)
    g = torch.Generator().manual_seed(seed)
    past = [(torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g)) for _ in cache.kv_layers]
    cache.extend(past)
    return cache


def content(cache: kvcache.KVCache) -> list[torch.Tensor]:
    return [t for s in cache.kv_layers for t in s.view()]


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "save-loop":
        path, seed, count = argv[1], int(argv[2]), int(argv[3])
        cache = make(seed, 3000)
        print("ready", flush=True)
        for _ in range(count):
            cache.save(path)
        print(json.dumps({"saved": count}), flush=True)
    elif mode == "save-limited":
        path, seed, limit = argv[1], int(argv[2]), int(argv[3])
        cache = make(seed, 200)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            cache.save(path)
        except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
            mro = [c.__name__ for c in type(e).__mro__]
            print(json.dumps({"error": type(e).__name__, "mro": mro, "message": str(e), "errno": getattr(e, "errno", None)}))
        else:
            print(json.dumps({"error": None}))
    elif mode == "load":
        out = []
        for path in argv[1:]:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            try:
                kvcache.load_cache(path, CONFIG)
                error = None
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
            grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            out.append({"path": path, "error": error, "clean": isinstance_name(error), "seconds": time.perf_counter() - start, "rss_grew_kib": grew_kib})
        print(json.dumps(out))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def isinstance_name(error: str | None) -> bool:
    """Whether the error line names a CacheFileError subclass."""
    if error is None:
        return False
    name = error.split(":", 1)[0]
    cls = getattr(kvcache, name, None)
    return isinstance(cls, type) and issubclass(cls, kvcache.CacheFileError)


if __name__ == "__main__":
    main(sys.argv[1:])
