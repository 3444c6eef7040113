"""The contenders of suite ``real`` and one timed greedy decode of each.

A contender (:class:`Contender`) is a cache from the one contender table (``apps.contenders``),
the attention the model runs with it, and whether the model's forward is compiled
(``torch.compile(model.forward, fullgraph=True, dynamic=False)``). Every contender decodes with the
same plain loop (:func:`greedy_steps`); only the steps are timed, never the filling of the cache.
A fixed-capacity cache is sized to the request, as a competent user sizes it (``capacity_for``:
it never attends more slots than the request needs). The first decode of a compiled contender at
each (batch, context) compiles, untimed, and reports how long it took.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from kvcache import cache_name

from ... import KVCache, use_kvcache_attention
from ...hf import ATTENTION_NAME
from ..contenders import HF_QUANTIZED, make_contender
from .common import clock
from .workload import Past

#: Steps a compiled contender decodes, untimed, to compile (and warm up) before it is timed.
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Contender:
    """``cache``: a name of ``apps.contenders``; ``attention``: ``"sdpa"`` or ``"kvcache"``;
    ``compiled``: decode through the compiled forward; ``quantized``: its floor counts the bytes it
    stores (codes and scales), not fp32 keys and values."""

    cache: str
    attention: str = "sdpa"
    compiled: bool = False
    quantized: bool = False

    @property
    def fixed(self) -> bool:
        """Whether the cache has a fixed capacity (sized to the request: ``capacity_for``)."""
        return self.cache in ("hf_static", "static")

    @property
    def shared(self) -> bool:
        """Whether one cache object per (batch, context) is kept and reused: compiled fixed-capacity
        kinds, whose graph is specialised on the cache's buffers. Eager contenders get a fresh cache
        per decode, so no two contenders' caches are alive at once (at 16 x 8K each holds 6 GB)."""
        return self.fixed and self.compiled


CONTENDERS: dict[str, Contender] = {
    "dynamic": Contender("dynamic"),
    "hf_static": Contender("hf_static"),
    "hf_static+compile": Contender("hf_static", compiled=True),
    **{name: Contender(name, quantized=True) for name in HF_QUANTIZED},
    "growable": Contender("growable", ATTENTION_NAME),
    "static": Contender("static", ATTENTION_NAME),
    "static+compile": Contender("static", ATTENTION_NAME, compiled=True),
    "quantized-int8": Contender("quantized-int8", ATTENTION_NAME, quantized=True),
    "quantized-int4": Contender("quantized-int4", ATTENTION_NAME, quantized=True),
    "quantized-fp8": Contender("quantized-fp8", ATTENTION_NAME, quantized=True),
}

#: How each contender is configured, as the table says (``{capacity}``: ``capacity_for``).
CONFIGURED: dict[str, str] = {
    "dynamic": "Hugging Face DynamicCache(config=model.config), model on SDPA",
    "hf_static": "Hugging Face StaticCache(config=model.config, max_cache_len={capacity}), model on SDPA",
    "hf_static+compile": "the same StaticCache, model.forward compiled (fullgraph, static shapes)",
    **{name: f"Hugging Face QuantizedCache(backend={b!r}, nbits={n}), model on SDPA" for name, (b, n) in HF_QUANTIZED.items()},
    "growable": "make_cache(model) (growable), model on the kvcache attention",
    "static": "make_cache(model, 'static:capacity={capacity}'), model on the kvcache attention",
    "static+compile": "make_cache(model, 'static:capacity={capacity}', compile=True), model.forward compiled",
    "quantized-int8": "make_cache(model, 'quantized:bits=8') (group 64, residual 32), model on the kvcache attention",
    "quantized-int4": "make_cache(model, 'quantized:bits=4') (group 64, residual 32), model on the kvcache attention",
    "quantized-fp8": "make_cache(model, 'quantized:codes=fp8') (e4m3, group 64, residual 32), model on the kvcache attention",
}

#: What every row is compared with.
REFERENCE = "dynamic"

#: The package each Hugging Face quantized backend needs.
BACKEND_PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}


def capacity_for(context: int, steps: int) -> int:
    """A fixed cache's capacity: exactly what the request holds at its end (the prompt and the tokens fed back)."""
    return context + steps


def unavailable(name: str) -> str | None:
    """Why contender ``name`` cannot run here (its backend is not installed), or None."""
    if name not in HF_QUANTIZED:
        return None
    backend = HF_QUANTIZED[name][0]
    package = BACKEND_PACKAGES[backend]
    try:
        found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"backend {backend!r} needs the package {package!r}, not installed"


def held_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj``: a tensor (a quantized tensor subclass by its inner
    tensors), or tuples, lists and dicts of them (Hugging Face's quantized layers keep those)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(held_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(held_bytes(x) for x in obj) if isinstance(obj, (tuple, list)) else 0


def cache_bytes(cache: Any) -> int:
    """Bytes the cache holds: ours say (``nbytes``); Hugging Face's layers are summed over their
    full-precision and quantized tensors."""
    if isinstance(cache, KVCache):
        return int(cache.nbytes)
    names = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(held_bytes(getattr(layer, n, None)) for layer in cache.layers for n in names)


def fill(cache: Any, past: Past, batch: int, context: int) -> None:
    """Give ``cache`` the first ``batch`` rows and ``context`` positions of ``past`` through its
    public path: ``extend`` for ours, ``update`` layer by layer for Hugging Face's."""
    pairs = [(k[:batch, :, :context].contiguous(), v[:batch, :, :context].contiguous()) for k, v in past]
    if isinstance(cache, KVCache):
        cache.extend(pairs)
        return
    for i, (keys, values) in enumerate(pairs):
        cache.update(keys, values, i)


def greedy_steps(forward: Any, cache: Any, token: torch.Tensor, position: int, steps: int, name: str) -> torch.Tensor:
    """``steps`` greedy tokens ``[B, steps]`` after ``token`` ``[B, 1]`` at ``position``; ``forward`` takes
    the cache under ``name`` (``kvcache.cache_name``)."""
    out = []
    with torch.inference_mode():
        token = token.clone()  # an inference tensor like every later token: one compiled graph for all steps
        for i in range(steps):
            where = torch.tensor([position + i], device=token.device)
            logits = forward(input_ids=token, **{name: cache}, cache_position=where, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
    return torch.cat(out, dim=1)


class Runner:
    """Runs one decode of a contender at a (batch, context); holds the shared caches and the
    compiled forwards between calls. ``close()`` frees them."""

    def __init__(self, model: Any, past: Past, prompts: torch.Tensor, steps: int, backend: str = "inductor") -> None:
        self.model, self.past, self.prompts, self.steps = model, past, prompts, steps
        self.backend = backend  # "eager" traces (graph breaks, recompiles) without generating code: for tests
        self.caches: dict[tuple[str, bool, int, int], Any] = {}
        self.forwards: dict[str, Any] = {}
        self.compile_s: dict[tuple[str, int, int], float] = {}
        self.failed: dict[tuple[str, int, int], str] = {}

    def filled(self, contender: Contender, batch: int, context: int) -> Any:
        """The contender's cache holding the first ``batch`` rows and ``context`` positions of the
        prefill: a fresh one, or a shared contender's kept one, reset."""
        fixed = contender.compiled and contender.attention == ATTENTION_NAME  # ours compiled: make_cache(compile=True)
        capacity = capacity_for(context, self.steps)
        if contender.shared:
            key = (contender.cache, fixed, batch, context)
            if key not in self.caches:
                self.caches[key] = make_contender(contender.cache, self.model, capacity=capacity, compile=fixed)
            cache = self.caches[key]
            cache.reset()
        else:
            cache = make_contender(contender.cache, self.model, capacity=capacity, compile=fixed)
        fill(cache, self.past, batch, context)
        return cache

    def decode(self, name: str, batch: int, context: int) -> dict[str, Any]:
        """One timed decode: ``seconds``, ``tokens`` ``[batch, steps]``, ``cache_bytes`` and
        ``kv_bytes_at_context`` (what the cache held for the context, before the steps); or
        ``reason`` when the contender cannot run (a missing backend, a failed compile)."""
        contender = CONTENDERS[name]
        reason = unavailable(name) or self.failed.get((name, batch, context))
        if reason is not None:
            return {"reason": reason}
        token = self.prompts[:batch, context : context + 1]
        if contender.compiled and name not in self.forwards:
            self.forwards[name] = torch.compile(self.model.forward, fullgraph=True, dynamic=False, backend=self.backend)
        forward = self.forwards[name] if contender.compiled else self.model.forward
        self.model.set_attn_implementation("sdpa")
        switch = use_kvcache_attention(self.model) if contender.attention == ATTENTION_NAME else nullcontext()
        with switch, torch._dynamo.config.patch(recompile_limit=64):
            if contender.compiled and (name, batch, context) not in self.compile_s:
                try:
                    cache = self.filled(contender, batch, context)
                    self.compile_s[name, batch, context] = clock(lambda: greedy_steps(forward, cache, token, context, WARMUP_STEPS, cache_name(self.model)))
                except Exception as e:  # a graph break, an unsupported op: the row reports it
                    return self._fail(name, batch, context, "compile failed", e)
            cache = self.filled(contender, batch, context)
            at_context = cache_bytes(cache)
            result: dict[str, torch.Tensor] = {}
            # After warm-up a compiled decode must not compile again (fixed shapes); if it would, say so.
            stance = torch.compiler.set_stance("fail_on_recompile") if contender.compiled else nullcontext()
            try:
                with stance:
                    seconds = clock(lambda: result.setdefault("tokens", greedy_steps(forward, cache, token, context, self.steps, cache_name(self.model))))
            except Exception as e:
                if not contender.compiled:
                    raise
                return self._fail(name, batch, context, "recompiled after warm-up", e)
        return {
            "seconds": seconds,
            "tokens": result["tokens"],
            "cache_bytes": cache_bytes(cache),
            "kv_bytes_at_context": at_context,
            "compile_s": self.compile_s.get((name, batch, context)),
            "capacity": capacity_for(context, self.steps) if contender.fixed else None,
        }

    def _fail(self, name: str, batch: int, context: int, what: str, error: Exception) -> dict[str, str]:
        text = (str(error).strip().splitlines() or ["(no message)"])[0]
        text = text if len(text) <= 240 else text[:237] + "..."
        self.failed[name, batch, context] = f"{what}: {type(error).__name__}: {text}"
        contender = CONTENDERS[name]
        self.caches.pop((contender.cache, contender.compiled and contender.attention == ATTENTION_NAME, batch, context), None)
        return {"reason": self.failed[name, batch, context]}

    def close(self) -> None:
        self.caches.clear()
        self.forwards.clear()
