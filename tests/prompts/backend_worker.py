"""A process hammering one store: ``python backend_worker.py LOCATION NAMESPACE SEED OPS KEYS [MAX_BYTES]``.

Puts self-checking values (``checked_value``) and reads them back, under a few shared keys.
Prints ``ok <puts> <hits>`` and exits 0, or prints the bad read and exits 1.

It loads only the store modules: the package's ``__init__`` (torch, transformers) would cost
seconds per process, and the store needs none of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import sys
import types

DIGEST = 32


def checked_value(rng: random.Random, max_body: int = 20000) -> bytes:
    body = rng.randbytes(rng.randrange(max_body))
    return hashlib.sha256(body).digest() + body


def verifies(value: bytes) -> bool:
    return len(value) >= DIGEST and hashlib.sha256(value[DIGEST:]).digest() == value[:DIGEST]


def load_store_modules():
    root = importlib.util.find_spec("kvcache").submodule_search_locations[0]
    # Empty packages in place of kvcache's, its persist's and its prompts' __init__ (which import torch).
    packages = (("kvcache", root), ("kvcache.persist", os.path.join(root, "persist")), ("kvcache.prompts", os.path.join(root, "prompts")))
    for name, folder in packages:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [folder]
            sys.modules[name] = package
    from kvcache.prompts import backends

    return backends


def run_workers(location: str, namespace: str, count: int, ops: int = 150, keys: int = 4, max_bytes: int = -1) -> None:
    """Run ``count`` of these workers at once on one store; assert each read only whole values."""
    import subprocess

    args = [location, namespace, "SEED", str(ops), str(keys), str(max_bytes)]
    workers = [
        subprocess.Popen([sys.executable, __file__, *(str(seed) if arg == "SEED" else arg for arg in args)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in range(count)
    ]
    outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * count, outputs
    assert all(output.startswith("ok") for output in outputs), outputs


def main(location: str, namespace: str, seed: int, ops: int, nkeys: int, max_bytes: int) -> int:
    backends = load_store_modules()
    budget = None if max_bytes < 0 else max_bytes
    if location.startswith("redis://"):
        store = backends.RedisBackend(location, namespace=namespace, max_bytes=budget)
    else:
        store = backends.FolderBackend(location, max_bytes=budget)
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(nkeys)]
    puts = hits = 0
    for _ in range(ops):
        key = rng.choice(keys)
        if rng.random() < 0.5:
            store.put(key, checked_value(rng))
            puts += 1
        else:
            value = store.get(key)
            if value is not None:
                hits += 1
                if not verifies(value):
                    print(f"torn value under {key}: {len(value)} bytes")
                    return 1
    store.close()
    print(f"ok {puts} {hits}")
    return 0


if __name__ == "__main__":
    location, namespace, seed, ops, nkeys = sys.argv[1:6]
    sys.exit(main(location, namespace, int(seed), int(ops), int(nkeys), int(sys.argv[6]) if len(sys.argv) > 6 else -1))
