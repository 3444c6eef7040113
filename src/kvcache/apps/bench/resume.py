"""Suite ``resume``: time and bytes to save a cache to a file and load it back, against its length.

The cache: ``kvcache.make_cache`` (growable, the default) on a Llama-shaped config from
``kvcache.apps.tiny.tiny_config("llama", ...)`` with 8 KV heads x 128, fp32, batch 1, and 1 layer by
default (so the figures are per layer; a model's file is that times its layer count), filled with
random keys and values through ``cache.update`` in one chunk per layer.

Contenders, each writing its own file in a temporary directory:

- ``kvcache``: ``cache.save(path)`` and ``kvcache.load_cache(path, config)``. Saving copies the
  stored tokens out of the buffer, hashes every tensor (SHA-256), writes header and metadata to a
  temporary file, fsyncs it and renames it into place; loading reads the file, checks header,
  checksums and config fingerprint, and rebuilds the cache.
- ``safetensors``: the floor: ``safetensors.torch.save_file`` of the same keys and values (made
  contiguous inside the timed call, as any saver of a buffer with headroom must), and ``load_file``
  followed by a ``clone`` of each tensor: ``load_file`` only maps the file (its bytes are read on
  first use, so alone it costs well under a millisecond at any length), and a cache must own its
  tensors to append to them. No metadata, checksums, fsync or rename.
- ``safetensors+fsync``: the floor plus an fsync of the written file, to separate the cost of
  durability from that of the checks.

Each repeat runs every contender (order rotated per repeat): a timed save, then a timed load of
what it just saved (so loads read from the page cache, alike for all). The report gives the median
milliseconds of save and load, file bytes, MB/s (file bytes / time), and the ratio to the
``safetensors`` floor; ``checksum_ms`` is the time to SHA-256 the tensors once, which the kvcache
save and load each pay. Every load is checked to give back exactly the saved keys and values.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ... import load_cache, make_cache
from ...persist import checksum
from .common import cache_config, clock, column_table, figure, finish_axes, human_bytes, median
from .harness import alternate, report
from ..run_options import RunOptions

CONTENDERS = ("kvcache", "safetensors", "safetensors+fsync")
FLOOR = "safetensors"


def filled_cache(config, tokens: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A growable cache holding ``tokens`` random tokens in every layer."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(config)
    shape = (1, config.num_key_value_heads, tokens, config.head_dim)
    for i in range(config.num_hidden_layers):
        k = torch.randn(shape, generator=gen, dtype=dtype).to(device)
        v = torch.randn(shape, generator=gen, dtype=dtype).to(device)
        cache.update(k, v, i)
    return cache


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """The stored keys and values as views, by the names the cache file uses."""
    out = {}
    for i, store in enumerate(cache.kv_layers):
        if store is not None:
            out[f"layer.{i}.keys"], out[f"layer.{i}.values"] = store.view()
    return out


def save_fn(name: str, cache, path: Path):
    views = cache_tensors(cache)

    def save() -> None:
        if name == "kvcache":
            cache.save(path)
        else:
            save_file({k: t.contiguous().cpu() for k, t in views.items()}, str(path))
        if name == "safetensors+fsync":
            with open(path, "rb") as f:
                os.fsync(f.fileno())

    return save


def load_fn(name: str, config, path: Path, device: str, sink: dict):
    def load() -> None:
        if name == "kvcache":
            sink[name] = cache_tensors(load_cache(path, config, device=device))
        else:
            # load_file maps the file; the bytes are read on first use. Copy them into memory the
            # process owns, as a cache that will be appended to must hold them.
            sink[name] = {k: t.clone() for k, t in load_file(str(path), device=str(device)).items()}

    return load


def identical(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> bool:
    return loaded.keys() == original.keys() and all(torch.equal(loaded[k].cpu(), original[k].cpu()) for k in original)


def run(
    options: RunOptions = RunOptions(),
    *,
    lengths: list[int] | None = None,
    layers: int = 1,
    repeats: int | None = None,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float32,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``resume.json``/``resume.md``/``resume.png`` into ``options.out`` if given.

    Files are written in a temporary directory under ``workdir`` (default: the system's temporary
    directory), removed at the end.
    """
    from tqdm.auto import tqdm

    lengths = lengths or options.pick([16, 32], [256, 1024, 4096], [256, 1024, 4096, 16384])
    repeats = repeats or options.pick(1, 5, 7)
    config = cache_config(layers, kv_heads, head_dim, max(lengths))
    bar = tqdm(total=len(lengths) * repeats * len(CONTENDERS), desc="resume", disable=not options.progress)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcache-resume-", dir=workdir) as tmp:
        for tokens in lengths:
            cache = filled_cache(config, tokens, dtype, options.device)
            original = {k: t.clone() for k, t in cache_tensors(cache).items()}
            paths = {name: Path(tmp) / f"{name.replace('+', '_')}-{tokens}.safetensors" for name in CONTENDERS}
            sink: dict[str, dict[str, torch.Tensor]] = {}
            for name in CONTENDERS:  # warm-up: first-call costs (imports, allocator) are not timed
                save_fn(name, cache, paths[name])()
                load_fn(name, config, paths[name], options.device, sink)()

            def save_and_load(name: str) -> tuple[float, float, bool]:
                save_s = clock(save_fn(name, cache, paths[name]), options.device)
                load_s = clock(load_fn(name, config, paths[name], options.device, sink), options.device)
                return save_s, load_s, identical(sink.pop(name), original)

            runs = alternate(CONTENDERS, repeats, save_and_load, bar)
            saves = {name: [s for s, _, _ in samples] for name, samples in runs.items()}
            loads = {name: [s for _, s, _ in samples] for name, samples in runs.items()}
            checksum_s = median([clock(lambda: [checksum(t.cpu()) for t in original.values()]) for _ in range(3)])
            for name, samples in runs.items():
                save_s, load_s = median(saves[name]), median(loads[name])
                nbytes = paths[name].stat().st_size
                rows.append(
                    {
                        "tokens": tokens,
                        "contender": name,
                        "save_ms": save_s * 1e3,
                        "load_ms": load_s * 1e3,
                        "file_bytes": nbytes,
                        "tensor_bytes": sum(t.nbytes for t in original.values()),
                        "save_MBps": nbytes / save_s / 1e6,
                        "load_MBps": nbytes / load_s / 1e6,
                        "save_x_floor": save_s / median(saves[FLOOR]),
                        "load_x_floor": load_s / median(loads[FLOOR]),
                        "checksum_ms": checksum_s * 1e3,
                        "identical": all(ok for _, _, ok in samples),
                        "save_samples_ms": [s * 1e3 for s in saves[name]],
                        "load_samples_ms": [s * 1e3 for s in loads[name]],
                    }
                )
            del cache, original, sink
    bar.close()
    config = {
        "model": f"llama-shaped: {layers} layer(s) x {kv_heads} KV heads x {head_dim}, {str(dtype).removeprefix('torch.')}, batch 1",
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype),
        "cache": "growable (make_cache default)",
        "lengths": lengths,
        "repeats": repeats,
        "workdir": str(workdir or tempfile.gettempdir()),
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("resume", options, config, rows, table, plot)


def table(result: dict[str, Any]) -> str:
    columns = {
        "tokens": "tokens",
        "contender": "contender",
        "file": lambda r: human_bytes(r["file_bytes"]),
        "save ms": "save_ms",
        "load ms": "load_ms",
        "save MB/s": "save_MBps",
        "load MB/s": "load_MBps",
        "save x floor": "save_x_floor",
        "load x floor": "load_x_floor",
        "identical": lambda r: "yes" if r["identical"] else "NO",
    }
    sums = ", ".join(f"{r['tokens']}: {r['checksum_ms']:.3g} ms" for r in result["rows"] if r["contender"] == "kvcache")
    return (
        column_table(result["rows"], columns)
        + f"\n{result['config']['model']}; floor = plain safetensors save_file / load_file + clone. "
        + f"SHA-256 of the tensors once (paid by kvcache's save and by its load): {sums}.\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    with figure(path, panels=2, size=(6, 4.5)) as axes:
        for ax, op in zip(axes, ("save", "load")):
            for name in CONTENDERS:
                pts = [(r["tokens"], r[f"{op}_ms"]) for r in result["rows"] if r["contender"] == name]
                ax.plot(*zip(*pts), marker="o", label=name)
            title = f"{op}: {c['layers']} layer(s) x {c['kv_heads']}x{c['head_dim']} {c['dtype'].removeprefix('torch.')}"
            finish_axes(ax, "tokens in cache", f"{op} time, ms (median)", title, log_y=True)
