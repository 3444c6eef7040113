"""Suite ``gpu``: kvcache's decode paths on a CUDA device, against the device's copy bandwidth and
against Hugging Face's caches and continuous batching.

Models are random-init in a real model's shape (``SHAPES``: weights do not change speed, and a
lent GPU machine has no network for a checkpoint): Llama-3.1-8B in bfloat16 for the kernels and
the decode step, SmolLM2-135M's shape for the engine. Three parts, each a list of rows:

- ``kernel``: one decode call of the 8B shape's attention (one layer) at batch x tokens: over views
  (``views``), over paged blocks of 16 tokens (``paged``) and coded int8 / int4 / fp8 (``paged-int8``,
  ``paged-int4``, ``paged-fp8``: e4m3; an open block per sequence), and torch's SDPA over the same views (``sdpa``,
  HF's path). Each row: the bytes the call must read, its median time (``clock``), and that as a
  share of the copy bandwidth measured in the same run (``copy_bandwidth``).
- ``step``: a whole decode step of the 8B shape (batch x context): ``kvcache`` (``make_cache``
  growable with the ``kvcache`` attention), HF ``DynamicCache`` (sdpa), HF ``StaticCache`` eager and
  compiled (``torch.compile(mode="reduce-overhead")``, CUDA graphs); tokens per second and whether
  the greedy tokens equal DynamicCache's.
- ``engine``: 64 sessions sharing a 1,024-token prefix (each with its own 64 tokens, 64 new) on the
  SmolLM2 shape: ``kvcache.Engine`` against ``transformers``' continuous batching
  (``generate_batch``'s manager), tokens per second and whether their tokens agree.

``--tiny`` runs every part at toy sizes on the CPU (the C++ kernels stand in), so CI runs the code;
its numbers mean nothing. A contender that cannot run is a row with its reason.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...attention import device_kernels
from ...errors import KVCacheError
from ..run_options import RunOptions
from .common import clock, markdown_table, median
from .harness import report

#: Llama-3.1-8B's attention and model shape.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK = 16  # tokens a block (vLLM's default)
#: The models (``LlamaConfig`` fields): Llama-3.1-8B's shape, SmolLM2-135M's, and a toy one for ``tiny``.
SHAPES = {
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    ),
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}  # fmt: skip
#: Every contender of the three parts (a run reports each, with its numbers or why it could not run).
CONTENDERS = (
    "sdpa", "views", "paged", "paged-int8", "paged-int4", "paged-fp8",
    "dynamic", "kvcache", "static", "static-compiled",
    "kvcache-engine", "transformers-generate_batch",
)  # fmt: skip


def run(options: RunOptions = RunOptions()) -> dict[str, Any]:
    """Run the suite on ``options.device`` (a CUDA device; the CPU only with ``tiny``)."""
    device = torch.device("cuda" if options.device == "cpu" and not options.tiny else options.device)
    if not options.tiny and (device.type != "cuda" or not torch.cuda.is_available()):
        raise KVCacheError("suite gpu measures a CUDA device and there is none here (--tiny runs its code on the CPU, numbers meaning nothing)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device, mib=options.pick(16, 1024, 1024))
    repeats = options.pick(2, 10, 20)
    batches = options.pick([1, 2], [1, 16, 64], [1, 4, 16, 64])
    lengths = options.pick([256], [1024, 4096, 32768], [1024, 4096, 8192, 32768])
    rows = kernel_rows(device, dtype, batches, lengths, bandwidth, repeats)
    rows += step_rows(device, dtype, options)
    rows += engine_rows(device, dtype, options)
    config = {
        "kernel": {"shape": f"{Q_HEADS}/{KV_HEADS}x{HEAD_DIM}", "batches": batches, "lengths": lengths, "block": BLOCK, "dtype": str(dtype)},
        "repeats": repeats, "tiny": options.tiny, "quick": options.quick,
    }  # fmt: skip
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device} (--tiny)"
    return report("gpu", options, config, rows, table, plot, gpu=gpu, copy_bandwidth_bytes_per_s=bandwidth)


def copy_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes read plus written per second by a device copy of ``mib`` MiB (median of ``repeats``)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median([clock(lambda: dst.copy_(src), device) for _ in range(repeats)])
    return 2 * src.nbytes / seconds


def kernel_rows(device, dtype, batches, lengths, bandwidth, repeats) -> list[dict[str, Any]]:
    """The ``kernel`` part: one decode call of each contender at each batch x tokens."""
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**31
    for batch in batches:
        for tokens in lengths:
            kv_bytes = 2 * batch * KV_HEADS * tokens * HEAD_DIM * dtype.itemsize
            if 3 * kv_bytes > free:  # views, the pool and the coded pools side by side
                rows.append({"part": "kernel", "batch": batch, "tokens": tokens, "contender": "all", "reason": "does not fit"})
                continue
            calls = _kernel_calls(device, dtype, batch, tokens, gen)
            for name, (call, nbytes) in calls.items():
                row = {"part": "kernel", "batch": batch, "tokens": tokens, "contender": name}
                try:
                    seconds = median([clock(call, device) for _ in range(repeats + 1)][1:])
                except Exception as e:  # noqa: BLE001 (a row says why a contender could not run)
                    rows.append(row | {"reason": repr(e)[:200]})
                    _free(device)
                    continue
                rows.append(row | {"ms": seconds * 1e3, "bytes_read": nbytes,
                                   "bandwidth_fraction": nbytes / seconds / bandwidth})
            del calls
            _free(device)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _kernel_calls(device, dtype, batch, tokens, gen) -> dict[str, tuple[Any, int]]:
    """Each contender's call over the same keys and values, and the bytes it must read. A kvcache
    call given a ``triton_decode.Launch`` calls the Triton kernel with it instead of going through
    ``device_kernels`` (``tools/gpu_sweep.py``)."""
    group = Q_HEADS // KV_HEADS
    scale = 1 / math.sqrt(HEAD_DIM)
    k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen).to(device, dtype)
    v = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen).to(device, dtype)
    q = torch.randn(batch, KV_HEADS, group, HEAD_DIM, generator=gen).to(device, dtype)
    q4 = q.reshape(batch, Q_HEADS, 1, HEAD_DIM)
    kv_bytes = k.nbytes + v.nbytes
    calls: dict[str, tuple[Any, int]] = {
        "sdpa": (lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True), kv_bytes),
        "views": (lambda launch=None: _kernel("decode_views", launch, q, k, v, None, None, scale), kv_bytes),
    }
    per_seq = -(-tokens // BLOCK)
    order = torch.randperm(batch * per_seq, generator=gen)
    table = order.view(batch, per_seq).to(device, torch.int32)
    kb = _as_blocks(k, batch, per_seq)[order.argsort()].contiguous()
    vb = _as_blocks(v, batch, per_seq)[order.argsort()].contiguous()
    lengths = torch.full((batch,), tokens, dtype=torch.int64, device=device)
    calls["paged"] = (lambda launch=None: _kernel("paged_decode", launch, q, kb, vb, table, lengths, scale), kv_bytes)
    for bits in (8, 4):
        calls[f"paged-int{bits}"] = _coded_call(q, kb, vb, table, tokens, bits, scale)
    calls["paged-fp8"] = _coded_call(q, kb, vb, table, tokens, 8, scale, fp8=True)
    return calls


def _kernel(name: str, launch, *args, **keywords) -> torch.Tensor:
    """The decode call measured: ``device_kernels.<name>(*args, **keywords)`` (the library's
    choice), or with a ``launch`` Triton's kernel with it; a kernel that declines the call raises."""
    if launch is None:
        out = getattr(device_kernels, name)(*args, **keywords)
    else:
        from ...attention import triton_decode

        out = getattr(triton_decode, name)(*args, launch=launch, **keywords)
    if out is None:
        raise KVCacheError("the device's kernel declined the call (see attention.device_kernels)")
    return out


def _as_blocks(x: torch.Tensor, batch: int, per_seq: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` as blocks ``[B * per_seq, Hkv, BLOCK, D]`` (the last padded with zeros)."""
    pad = per_seq * BLOCK - x.shape[2]
    x = F.pad(x, (0, 0, 0, pad))
    return x.view(batch, KV_HEADS, per_seq, BLOCK, HEAD_DIM).permute(0, 2, 1, 3, 4).reshape(batch * per_seq, KV_HEADS, BLOCK, HEAD_DIM)


def _coded_call(q, kb, vb, table, tokens, bits, scale, fp8=False) -> tuple[Any, int]:
    """An int ``bits`` (``fp8``: e4m3) pool of the same blocks (full blocks coded, each sequence's
    last partial one in its open block) and the bytes a step reads: codes, scales and minimums, and
    the open tokens."""
    from ...formats import BlockStorage, Codes

    device, batch = q.device, q.shape[0]
    fmt = Codes(bits, 64, key_block=BLOCK, fp8=fp8)
    storage = BlockStorage(fmt, 1, kb.shape[0], KV_HEADS, BLOCK, HEAD_DIM, HEAD_DIM, torch.float32, device)
    for start in range(0, kb.shape[0], 4096):  # a float32 copy of 4,096 blocks at a time, not of all
        index = torch.arange(start, min(start + 4096, kb.shape[0]), device=device)
        storage.write_blocks(0, index, kb[index], vb[index])
    c = storage.layer(0)
    full, rest = divmod(tokens, BLOCK)
    tails_k = torch.zeros(batch, KV_HEADS, BLOCK, HEAD_DIM, device=device)
    tails_v = torch.zeros_like(tails_k)
    if rest:
        last = table[:, full].long()
        tails_k.copy_(kb[last].float())
        tails_v.copy_(vb[last].float())
    coded = torch.full((batch,), full * BLOCK, dtype=torch.int64, device=device)
    open_ = torch.full((batch,), rest, dtype=torch.int64, device=device)
    tails = torch.arange(batch, dtype=torch.int32, device=device)
    nbytes = int(batch * full * storage.block_nbytes + batch * rest * KV_HEADS * HEAD_DIM * 8)

    def call(launch=None):
        return _kernel(
            "paged_coded_decode", launch, q, (c["kcodes"], c["kscale"], c["kmin"]),
            (c["vcodes"], c["vscale"], c["vmin"]), bits, 64, table, coded, tails_k, tails_v, tails, open_, scale, fp8=fp8,
        )  # fmt: skip

    return call, nbytes


def step_rows(device, dtype, options: RunOptions) -> list[dict[str, Any]]:
    """The ``step`` part: a whole decode step of the 8B shape with each contender's cache."""
    import kvcache

    model = _model(device, dtype, options.pick("tiny", "8b", "8b"))
    batches = options.pick([1], [1, 16], [1, 4, 16])
    contexts = options.pick([64], [1024, 8192], [1024, 4096, 8192])
    steps = options.pick(4, 32, 64)
    #: Compiling with CUDA graphs takes about a minute a shape: the quick run compiles at the first context only.
    compiled = options.pick(contexts, contexts[:1], contexts)
    rows = []
    for batch in batches:
        for context in contexts:
            ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
            reference = None
            for name in ("dynamic", "kvcache", "static", "static-compiled"):
                row = {"part": "step", "batch": batch, "context": context, "contender": name}
                if name == "static-compiled" and (device.type != "cuda" or context not in compiled):
                    why = "CUDA graphs need a CUDA device" if device.type != "cuda" else "compiled at the first context only (--quick)"
                    rows.append(row | {"reason": why})
                    continue
                try:
                    seconds, tokens = _decode(model, name, ids, steps, kvcache)
                except Exception as e:  # noqa: BLE001 (a row says why a contender could not run)
                    rows.append(row | {"reason": repr(e)[:200]})
                    continue
                finally:
                    _free(device)
                reference = tokens if name == "dynamic" else reference
                rows.append(row | {
                    "tokens_per_s": batch * steps / seconds, "ms_per_step": seconds / steps * 1e3,
                    "same_tokens_as_dynamic": reference is not None and tokens == reference,
                })  # fmt: skip
    del model
    return rows


def _model(device, dtype, shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(dtype)
    return model.eval()


def _decode(model, name: str, ids: torch.Tensor, steps: int, kvcache) -> tuple[float, list[list[int]]]:
    """Seconds of ``steps`` greedy decode steps after a prefill of ``ids`` with contender ``name``'s
    cache, and the tokens chosen."""
    from transformers import DynamicCache, StaticCache

    device = ids.device
    batch, context = ids.shape
    forward = model
    if name == "kvcache":
        cache = kvcache.make_cache(model, "growable")
        kvcache.use_kvcache_attention(model)
    else:
        model.set_attn_implementation("sdpa")
        if name == "dynamic":
            cache = DynamicCache(config=model.config)
        else:
            cache = StaticCache(config=model.config, max_cache_len=context + steps + 1)
            if name == "static-compiled":
                forward = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    kwargs = kvcache.cache_kwargs(model, cache)
    static = name.startswith("static")

    def at(start: int, n: int) -> dict[str, torch.Tensor]:  # static caches are told where they write
        return {"cache_position": torch.arange(start, start + n, device=device)} if static else {}

    def prefill() -> torch.Tensor:  # the next token
        return model(ids, **kwargs, use_cache=True, logits_to_keep=1, **at(0, context)).logits[:, -1:].argmax(-1)

    chosen = []
    with torch.inference_mode():
        token = prefill()
        if name == "static-compiled":
            for warm in range(2):  # compile and record the graphs first
                forward(token, **kwargs, use_cache=True, **at(context + warm, 1))
            cache.reset()  # the warm-up wrote two tokens: start again from the prefill
            token = prefill()

        def run():
            nonlocal token
            for i in range(steps):
                chosen.append(token[:, 0].tolist())
                logits = forward(token, **kwargs, use_cache=True, **at(context + i, 1)).logits
                token = logits[:, -1:].argmax(-1)

        seconds = clock(run, device)
    if name == "kvcache":
        model.set_attn_implementation("sdpa")
    return seconds, chosen


def engine_rows(device, dtype, options: RunOptions) -> list[dict[str, Any]]:
    """The ``engine`` part: the engine against transformers' continuous batching."""
    from .engine_workload import Workload, engine_settings, hf_settings, make_engine, serve_engine, serve_hf

    model = _model(device, dtype, options.pick("tiny", "smollm2", "smollm2"))
    sessions, shared, user, new = options.pick((4, 32, 8, 4), (64, 1024, 64, 64), (64, 1024, 64, 64))
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    system = torch.randint(3, vocab, (shared,), generator=gen).tolist()
    prompts = tuple(tuple(system + torch.randint(3, vocab, (user,), generator=gen).tolist()) for _ in range(sessions))
    w = Workload(prompts, shared, new, vocab, 0)  # eos outside the vocabulary: every request runs to its length
    arrivals = [0.0] * sessions
    runs = {
        "kvcache-engine": lambda: serve_engine(  # compiled where the engine compiles (the CPU), eager on a GPU;
            model, make_engine(model, "growable", True, engine_settings(w, BLOCK, 2048), compile=not options.tiny), w, arrivals
        ),  # a tiny run (the tests', on the CPU) stays eager: compiling costs minutes
        "transformers-generate_batch": lambda: serve_hf(model, w, arrivals, hf_settings(w, BLOCK, 2048)),
    }
    rows, tokens = [], {}
    for name, serve in runs.items():
        try:
            result = serve()
            reason = result.reason
        except Exception as e:  # noqa: BLE001 (a row says why a contender could not run)
            reason = repr(e)[:200]
        if reason:
            rows.append({"part": "engine", "contender": name, "sessions": sessions, "reason": reason})
            continue
        finish = max(r.finish for r in result.requests)
        tokens[name] = [r.tokens for r in result.requests]
        rows.append({
            "part": "engine", "contender": name, "sessions": sessions, "shared": shared, "user": user, "new_tokens": new,
            "tokens_per_s": sum(len(r.tokens) for r in result.requests) / finish, "seconds": finish,
        })  # fmt: skip
    if len(tokens) == 2:
        same = sum(a == b for a, b in zip(*tokens.values()))
        for row in rows:
            if row["part"] == "engine" and "reason" not in row:
                row["same_tokens_requests"] = f"{same}/{sessions}"
    return rows


def table(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        f"GPU suite on {result.get('gpu', machine['device'])} ({machine['date']}); copy bandwidth "
        f"{result['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (read + written)",
    ]
    rows = result["rows"]
    lines.append(markdown_table(
        ["batch", "tokens", "contender", "ms", "MB read", "share of copy bandwidth"],
        [[r["batch"], r["tokens"], r["contender"], f"{r['ms']:.3f}" if "ms" in r else r["reason"],
          f"{r['bytes_read'] / 1e6:.1f}" if "bytes_read" in r else "", f"{r['bandwidth_fraction']:.0%}" if "ms" in r else ""]
         for r in rows if r["part"] == "kernel"],
    ))  # fmt: skip
    lines.append(markdown_table(
        ["batch", "context", "contender", "tokens/s", "ms/step", "tokens = DynamicCache's"],
        [[r["batch"], r["context"], r["contender"], f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else r["reason"],
          f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else "", r.get("same_tokens_as_dynamic", "")]
         for r in rows if r["part"] == "step"],
    ))  # fmt: skip
    lines.append(markdown_table(
        ["contender", "sessions", "tokens/s", "seconds", "same tokens"],
        [[r["contender"], r["sessions"], f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else r["reason"],
          f"{r['seconds']:.2f}" if "seconds" in r else "", r.get("same_tokens_requests", "")]
         for r in rows if r["part"] == "engine"],
    ))  # fmt: skip
    return "\n\n".join(lines) + "\n"


def plot(result: dict[str, Any], path) -> None:
    """Left: each kernel's share of the copy bandwidth against tokens, at the largest batch measured;
    right: decode-step tokens/s against context, per contender, at the largest batch."""
    from .common import figure, finish_axes

    rows = [r for r in result["rows"] if "reason" not in r]
    panels = (  # part, its contenders, x, y of a row, the axes' labels and title
        ("kernel", CONTENDERS[:5], "tokens", lambda r: 100 * r["bandwidth_fraction"],
         ("tokens", "% of copy bandwidth", f"decode attention, {Q_HEADS}/{KV_HEADS}x{HEAD_DIM}")),
        ("step", CONTENDERS[5:9], "context", lambda r: r["tokens_per_s"],
         ("context", "tokens/s", "a whole decode step")),
    )  # fmt: skip
    with figure(path, panels=2) as axes:
        for ax, (part, names, x, y, labels) in zip(axes, panels):
            mine = [r for r in rows if r["part"] == part]
            batch = max((r["batch"] for r in mine), default=None)
            for name in names:
                points = sorted((r[x], y(r)) for r in mine if r["contender"] == name and r["batch"] == batch)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            finish_axes(ax, *labels)
