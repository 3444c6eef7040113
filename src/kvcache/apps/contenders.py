"""The one table of contender names: what the demo, the benchmark suites and the quality harness
call a cache, and the cache spec each name stands for.

``{slots}`` is the budget (for ``window``, the window itself, its sinks kept apart; a fraction of
the context is accepted where the spec accepts one; for ``auto``, a share of the fp32 cache's bytes) and ``{capacity}`` the fixed capacity.
``dynamic`` and ``hf_static`` are Hugging Face's ``DynamicCache`` and ``StaticCache``, the
references, and ``hf_<backend>-int<bits>`` its ``QuantizedCache`` (needs the backend's package:
``optimum-quanto`` for ``quanto``, ``hqq``); every other name is a kvcache spec.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache, QuantizedCache, StaticCache

from .. import make_cache

#: Sinks a window keeps inside its budget.
SINKS = 4

#: Contender name -> cache spec template.
SPECS: dict[str, str] = {
    "growable": "growable",
    "concat": "concat",
    "static": "static:capacity={capacity}",
    "window": "window:window={slots},sinks=" + str(SINKS),
    "lastrec": "lastrec:budget={slots}",
    "h2o": "h2o:budget={slots}",
    "tova": "tova:budget={slots}",
    "snapkv": "snapkv:budget={slots}",
    "adakv": "adakv:budget={slots}",
    "auto": "auto:bytes={slots}",
    "h2o-int8": "h2o:budget={slots},storage=int8",
    "quantized-int8": "quantized:bits=8",
    "quantized-int4": "quantized:bits=4",
    "quantized-int2": "quantized:bits=2",
    "quantized-fp8": "quantized:codes=fp8",
}

#: Hugging Face's quantized caches: contender name -> (backend, bits).
HF_QUANTIZED: dict[str, tuple[str, int]] = {"hf_quanto-int4": ("quanto", 4), "hf_hqq-int8": ("hqq", 8), "hf_hqq-int4": ("hqq", 4)}

#: Hugging Face's own caches, the references.
HF_REFERENCES = ("dynamic", "hf_static", *HF_QUANTIZED)


def spec_for(name: str, slots: int | float | None = None, capacity: int | None = None) -> str:
    """The cache spec of contender ``name`` with ``slots`` (bounded kinds) or ``capacity`` (static)."""
    if name not in SPECS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(SPECS)}")
    template = SPECS[name]
    needs = "slots" if "{slots}" in template else "capacity" if "{capacity}" in template else None
    if needs is not None and {"slots": slots, "capacity": capacity}[needs] is None:
        raise ValueError(f"contender {name!r} needs {needs}=..., got none")
    return template.format(slots=slots, capacity=capacity)


def make_contender(
    name: str, model_or_config: Any, slots: int | float | None = None, capacity: int | None = None, compile: bool = False
):
    """A fresh cache for contender ``name``: Hugging Face's for the references, else ``make_cache``
    (with ``compile=True``: its fixed-shape twin, for ``torch.compile``)."""
    if name in HF_REFERENCES:
        config = getattr(model_or_config, "config", model_or_config)
        if name == "dynamic":
            return DynamicCache(config=config)
        if name in HF_QUANTIZED:
            backend, bits = HF_QUANTIZED[name]
            return QuantizedCache(backend, config, nbits=bits)
        return StaticCache(config=config, max_cache_len=capacity)
    return make_cache(model_or_config, spec_for(name, slots, capacity), compile=compile)
