"""Every kind the README, ``valid_specs()`` and ``kvcache generate --help`` name exists in a fresh
process that imported nothing but ``kvcache``: it builds there, runs a forward pass, and a file
saved of it loads there. (A kind that registered itself only when some other module happened to
be imported, as ``kvzip`` once did, fails here.)

The files are saved by this test's own process. One fresh process lists the kinds it knows right
after ``import kvcache`` (before any kind has run, so no kind's imports can help another to exist),
then loads and builds each kind in turn, in a shuffled order, reporting each on its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import kvcache
from kvcache import cache_kwargs
from kvcache.apps.cli import main as cli_main
from kvcache.hf.spec import valid_specs

ROOT = Path(__file__).resolve().parents[2]

#: Options that make a small cache of each kind (the rest keep their defaults).
OPTIONS = {
    "static": "capacity=64", "window": "window=8", "quantized": "bits=4,group_size=4,residual=4",
    "adakv": "budget=6,window=2", "snapkv": "budget=6,window=2", "pyramidkv": "budget=6,window=2", "auto": "bytes=0.25,window=2",
    "auto-heads": "bytes=0.25,window=2", "kvzip": "budget=6,queries=prompt",
}
BUDGETED = "budget=6"


def documented_kinds() -> set[str]:
    """The kinds the kinds tables of the README and docs/kinds.md (the first cell of each row, up to ``:``), the spec listing
    and ``kvcache generate --help`` name."""
    from_readme = set()
    for page, heading in ((ROOT / "README.md", "## Cache kinds"), (ROOT / "docs" / "kinds.md", "## Cache kinds")):
        text = page.read_text()
        section = text[text.index(heading) :]
        section = section[: section.index("\n## ", 1)]
        from_readme |= {m.group(1) for m in re.finditer(r"^\| `([a-z0-9-]+)[:`]", section, flags=re.M)}
    from_listing = {line.split()[0] for line in valid_specs().splitlines()}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["generate", "--help"]) == 0
    help_text = out.getvalue()
    from_help = {k for k in from_listing if re.search(rf"\b{re.escape(k)}\b", help_text)}
    assert from_readme and from_listing, "no kinds found: did the README's kinds table move?"
    assert from_help == from_listing, f"--help does not name {sorted(from_listing - from_help)}"
    return from_readme | from_listing


def spec_of(kind: str) -> str:
    if kind in OPTIONS:
        return f"{kind}:{OPTIONS[kind]}"
    return f"{kind}:{BUDGETED}" if "budget" in kvcache.layers.registry.spec_kind(kind).required else kind


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


#: Run in a fresh interpreter: imports kvcache alone (transformers and torch come with it), lists the
#: spec kinds it knows then, and for each job (kind, spec, file) loads the file saved for the kind,
#: then builds the kind and runs a forward pass through it. One JSON line: the kinds, then per kind
#: its report or the error it raised.
FRESH = textwrap.dedent(
    """
    import json, random, sys, traceback
    import kvcache
    known = sorted(kvcache.layers.registry.spec_kinds())
    import torch, transformers
    jobs, config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    random.shuffle(jobs)
    reports = {}
    for kind, spec, path in jobs:
        try:
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
            loaded = kvcache.load_cache(path, model)
            cache = kvcache.make_cache(model, spec)
            with torch.no_grad(), kvcache.use_kvcache_attention(model):
                model(torch.arange(10).view(1, 10) + 3, **kvcache.cache_kwargs(model, cache))
            reports[kind] = {"loaded": [s.kind for s in loaded.kv_layers], "seen": loaded.seen,
                             "built": [s.kind for s in cache.kv_layers], "after": cache.seen}
        except Exception:
            reports[kind] = traceback.format_exc()[-2000:]
    print(json.dumps({"known": known, "reports": reports}))
    """
)


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory) -> tuple[list[str], dict[str, tuple[str, dict | str]]]:
    """The spec kinds a fresh process knows after ``import kvcache``; kind -> (spec, the fresh
    process's report for it, or the error it raised)."""
    folder = tmp_path_factory.mktemp("kinds")
    model = tiny_llama()
    config = json.dumps({k: getattr(model.config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")})
    jobs = {}
    for kind in sorted(documented_kinds()):
        spec = spec_of(kind)
        cache = kvcache.make_cache(model, spec)
        with torch.no_grad(), kvcache.use_kvcache_attention(model):
            model(torch.arange(12).view(1, 12) + 3, **cache_kwargs(model, cache))
        path = folder / f"{kind}.kv"
        cache.save(path)
        jobs[kind] = (spec, str(path))

    listed = json.dumps([[kind, spec, path] for kind, (spec, path) in jobs.items()])
    proc = subprocess.run([sys.executable, "-c", FRESH, listed, config], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["known"], {kind: (spec, out["reports"][kind]) for kind, (spec, _) in jobs.items()}


def test_the_documented_kinds_include_every_spec_kind_and_kvzip():
    kinds = documented_kinds()
    assert set(kvcache.layers.registry.spec_kinds()) <= kinds and "kvzip" in kinds
    assert kinds <= set(kvcache.layers.registry.spec_kinds()), f"documented but unknown: {sorted(kinds - set(kvcache.layers.registry.spec_kinds()))}"


@pytest.mark.parametrize("kind", sorted(set(kvcache.layers.registry.spec_kinds())))
def test_each_documented_kind_builds_and_loads_in_a_fresh_process(fresh_runs, kind):
    known, reports = fresh_runs
    assert kind in known, f"{kind} is not a spec kind in a process that imported only kvcache"
    spec, report = reports[kind]
    assert isinstance(report, dict), f"{spec} in a fresh process:\n{report}"
    layer = kvcache.layers.registry.spec_kind(kind).layer.kind
    assert report["loaded"] == report["built"] == [layer, layer]
    assert report["seen"] == 12 and report["after"] == 10


def test_the_cli_generates_with_kvzip_in_a_fresh_process():
    """The command the issue that found the registration bug ran, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache", "generate", "--cache", "kvzip:budget=64,queries=prompt", "--prompt", "The quick brown fox",
         "--max-new-tokens", "4"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cache kvzip:budget=64,queries=prompt" in proc.stderr
