"""Cache specs: ``"growable"``, ``"static:capacity=8192"``, ``"window:window=1024,sinks=4"``,
``"quantized:bits=4"``, ``"h2o:budget=1024"`` (or ``tova``, ``lastrec``; a budget below 1 is a fraction of the tokens
seen), ``"concat"``.

A spec is a kind, then optionally ``:`` and comma-separated ``name=value`` options. The same parser
serves ``make_cache(model, spec, **options)`` and the CLI's ``--cache``; keyword options override
those in the string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError

def number(value: Any) -> int | float:
    """A token count (int) or, below 1, a fraction (float): ``"1024"`` -> 1024, ``"0.25"`` -> 0.25."""
    out = float(value)
    return int(out) if out.is_integer() else out


#: The eviction policies, each a spec kind of its own (``policies.py``).
EVICTION_KINDS = ("h2o", "tova", "lastrec")
_EVICTION_OPTIONS: dict[str, type] = {"budget": number, "recent": int, "sinks": int, "storage": str}

#: Option name -> type, per kind. Options typed ``object`` are Python-only (not from a string).
SPEC_OPTIONS: dict[str, dict[str, type]] = {
    "growable": {"initial_capacity": int, "growth": float},
    "static": {"capacity": int, "buffers": object},
    "window": {"window": int, "sinks": int},
    "quantized": {"bits": int, "group_size": int, "residual": int},
    **{kind: dict(_EVICTION_OPTIONS) for kind in EVICTION_KINDS},
    "concat": {},
}

_REQUIRED: dict[str, tuple[str, ...]] = {
    "static": ("capacity|buffers",),
    "window": ("window",),
    **{kind: ("budget",) for kind in EVICTION_KINDS},
}

#: Lower bounds per option: (smallest allowed, whether the bound itself is allowed).
_BOUNDS: dict[str, tuple[float, bool]] = {
    "capacity": (1, True),
    "initial_capacity": (1, True),
    "growth": (1.0, False),
    "window": (1, True),
    "sinks": (0, True),
    "recent": (0, True),
    "budget": (0, False),
    "group_size": (1, True),
    "residual": (0, True),
}


@dataclass(frozen=True)
class CacheSpec:
    kind: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        text = [f"{k}={v}" for k, v in self.options.items() if SPEC_OPTIONS[self.kind][k] is not object]
        return self.kind + (":" + ",".join(text) if text else "")


def _spec_error(message: str) -> SpecError:
    return SpecError(f"{message}\nValid cache specs:\n{valid_specs()}")


def valid_specs() -> str:
    """One line per kind with its options, for error messages and ``--help``."""
    lines = []
    for kind, opts in SPEC_OPTIONS.items():
        names = ", ".join(f"{n}=<{t.__name__}>" for n, t in opts.items() if t is not object)
        lines.append(f"  {kind}" + (f" (options: {names})" if names else " (no options)"))
    return "\n".join(lines)


def parse_spec(spec: str | CacheSpec = "growable", **overrides: Any) -> CacheSpec:
    """Parse ``spec`` and merge keyword ``overrides``; raise ``SpecError`` listing valid choices."""
    if isinstance(spec, CacheSpec):
        kind, options = spec.kind, dict(spec.options)
    elif isinstance(spec, str):
        kind, _, rest = spec.strip().partition(":")
        kind = kind.strip()
        options = _parse_options(rest, spec) if rest.strip() else {}
    else:
        raise _spec_error(f"a cache spec must be a string like 'growable', got {type(spec).__name__}")
    if kind not in SPEC_OPTIONS:
        raise _spec_error(f"unknown cache kind {kind!r} in spec {spec!r}")
    options.update(overrides)
    allowed = SPEC_OPTIONS[kind]
    for name, value in list(options.items()):
        if name not in allowed:
            raise _spec_error(f"unknown option {name!r} for cache kind {kind!r}")
        options[name] = _coerce(kind, name, value, allowed[name])
    for need in _REQUIRED.get(kind, ()):
        if not any(n in options for n in need.split("|")):
            raise _spec_error(
                f"cache kind {kind!r} needs option {need.replace('|', ' or ')}, "
                f"e.g. '{kind}:{need.split('|')[0]}=4096'"
            )
    return CacheSpec(kind, options)


def _parse_options(text: str, spec: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise _spec_error(f"spec option {item.strip()!r} in {spec!r} is not of the form name=value")
        options[name] = value
    return options


def _coerce(kind: str, name: str, value: Any, typ: type) -> Any:
    if typ is object:
        if isinstance(value, str):
            raise _spec_error(f"option {name!r} of {kind!r} cannot be given in a spec string; pass it as a keyword")
        return value
    try:
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        coerced = typ(value)
    except (TypeError, ValueError):
        raise _spec_error(f"option {name!r} of cache kind {kind!r} must be {typ.__name__}, got {value!r}") from None
    if isinstance(coerced, float) and not math.isfinite(coerced):
        raise _spec_error(f"option {name!r} of cache kind {kind!r} must be a finite number, got {value!r}")
    if name in _BOUNDS:
        least, inclusive = _BOUNDS[name]
        if coerced < least or (coerced == least and not inclusive):
            relation = ">=" if inclusive else ">"
            raise _spec_error(f"option {name!r} of cache kind {kind!r} must be {relation} {least}, got {value!r}")
    return coerced
