"""What a point of the quality-per-byte frontier is (``eval_frontier.py`` runs and reports them):
the byte budgets, the fixed mixes (an eviction kind x a slot storage), the kinds that choose their
own mix (``auto``), and the spec each point gets at a budget for a prompt of a given length."""

from __future__ import annotations

import math
from typing import Any

from .eval_real_plan import ANSWER_TOKENS, SINKS

BYTE_BUDGETS = (0.5, 0.25, 0.125, 0.0625)
EVICTION = ("snapkv", "pyramidkv", "adakv", "h2o")
STORAGES = ("full", "int8", "int4", "int2")
#: The kinds that choose their own mix from a byte budget: per layer, and across a layer's KV heads.
AUTO = ("auto", "auto-heads")
#: The kinds a task-family frontier compares by default: SnapKV and Ada-KV, as kvpress users run them.
FAMILY_KINDS = ("snapkv", "adakv")
#: Tokens decoded per answer on the task families (a word pair or a mixed code is longer than five digits).
FAMILY_ANSWER_TOKENS = 12
UNBOUNDED = {"full": None, "quantized-int8": "quantized:bits=8", "quantized-int4": "quantized:bits=4", "quantized-int2": "quantized:bits=2"}


def storage_options(storage: str) -> tuple[dict[str, Any], float]:
    """A fixed mix's storage as spec options and the share of its slots in the fine storage:
    ``"int4"`` one storage (share 0); ``"int8@0.25+int4"`` mixed precision inside a layer
    (``layers/tiers.py``): a quarter of the kept slots, the highest ranked, in int8 and the rest in
    int4. ``ValueError`` names a bad name."""
    from ..layers import mixed_parts

    parts = mixed_parts(storage)
    if parts is None:
        return {"storage": storage}, 0.0
    fine, share, coarse = parts
    return {"storage": coarse, "fine": fine, "fine_share": share}, share


def mean_slot_bytes(storage: str, geometry: Any) -> float:
    """Bytes of one kept slot of a fixed mix's storage, on average over a mixed layer's two runs."""
    from ..layers import mean_slot_bytes as mean
    from ..layers import slot_bytes

    return mean(storage, lambda name: slot_bytes(name, geometry))


def mixes(kinds: tuple[str, ...] = EVICTION, storages: tuple[str, ...] = STORAGES) -> list[str]:
    """Every fixed mix's name, ``kind/storage``."""
    return [f"{k}/{s}" for k in kinds for s in storages]


def geometry_of(model: Any):
    """The geometry of one row of the model's attention layers (for slot sizes)."""
    import torch

    from ..layers import Geometry

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return Geometry(1, heads, head_dim, head_dim, torch.float32, torch.device("cpu"))


def spec_for(name: str, share: float | None, tokens: int, geometry: Any, room: int = ANSWER_TOKENS) -> str:
    """The spec of point ``name`` at byte budget ``share`` for a prompt of ``tokens``: ``auto`` at that
    share; a fixed mix keeping the most tokens whose slots (and one spare) fit ``share`` of the fp32
    bytes of ``tokens`` (all of them if they fit); the unbounded kinds as they are (the full cache
    a static one of ``tokens + room``, the tokens to be decoded after the prompt)."""
    from ..layers import fp32_bytes

    kind, *extra = name.split(",")
    if kind in AUTO:  # "auto-heads,rule=output": an auto kind with options of its own
        return f"{kind}:bytes={share}" + "".join("," + o for o in extra)
    if name in UNBOUNDED:
        return UNBOUNDED[name] or f"static:capacity={tokens + room}"
    kind, storage = name.split("/")
    slots = math.floor(share * tokens * fp32_bytes(geometry) / mean_slot_bytes(storage, geometry)) - 1
    options = storage_options(storage)[0]
    return f"{kind}:budget={min(tokens, max(SINKS + 1, slots))}" + "".join(f",{k}={v}" for k, v in options.items())


def check_autos(points: tuple[str, ...]) -> tuple[str, ...]:
    """``points`` (``"auto"``, ``"auto-heads,tolerance=0.3"``: an auto kind with options of its own),
    each checked as a layer of its kind would be made; ``ValueError`` (a ``SpecError``) names a bad one."""
    from .. import parse_spec
    from ..layers import AutoHeadsLayer, AutoLayer

    layers = {cls.kind: cls for cls in (AutoLayer, AutoHeadsLayer)}
    if not points:
        raise ValueError(f"no auto points given; each is one of {AUTO} with options after a comma")
    for point in points:
        kind = point.split(",")[0]
        if kind not in AUTO:
            raise ValueError(f"auto point {point!r}: the kind must be one of {AUTO}, got {kind!r}")
        try:
            layers[kind](**parse_spec(spec_for(point, 0.125, 1, None)).options)
        except ValueError as e:
            raise ValueError(f"auto point {point!r}: {e}") from None
    return tuple(points)


def fp32_per_token(model: Any, g: Any) -> int:
    """Bytes per token of an fp32 cache of every attention layer of ``model``."""
    from .. import make_cache
    from ..layers import fp32_bytes

    layers = sum(1 for layer in make_cache(model, "growable").kv_layers if layer is not None)
    return layers * g.heads * fp32_bytes(g)


def context_seeds(config: dict[str, Any]) -> dict[int, list[int]]:
    """Per length, the seeds of the contexts a result holds (older results say only how many)."""
    c = config["contexts"]
    if isinstance(c, int):
        return {int(L): list(range(c)) for L in config["lengths"]}
    return {int(L): list(seeds) for L, seeds in c.items()}
