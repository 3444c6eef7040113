"""Cache specs: ``"growable"``, ``"static:capacity=8192"``, ``"window:window=1024,sinks=4"``,
``"quantized:bits=4"``, ``"h2o:budget=1024"`` (or ``tova``, ``lastrec``; a budget below 1 is a fraction of the tokens
seen), ``"snapkv:budget=0.25,window=32,pool=7"`` (a policy's own options after the layer's), ``"concat"``.

A spec is a kind, then optionally ``:`` and comma-separated ``name=value`` options. The same parser
serves ``make_cache(model, spec, **options)`` and the CLI's ``--cache``; keyword options override
those in the string. The kinds are the registry's table (``registry.py``); their options (types,
bounds, which are required) are what the layer classes declare (``options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from ..layers.registry import SpecKind, spec_kind, spec_kinds


@dataclass(frozen=True)
class CacheSpec:
    kind: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        declared = spec_kind(self.kind).options
        text = [f"{k}={v}" for k, v in self.options.items() if not declared[k].python_only]
        return self.kind + (":" + ",".join(text) if text else "")


def _spec_error(message: str) -> SpecError:
    return SpecError(f"{message}\nValid cache specs:\n{valid_specs()}")


def valid_specs() -> str:
    """One line per kind with its options, for error messages and ``--help``."""
    lines = []
    for name, kind in spec_kinds().items():
        names = ", ".join(f"{n}=<{o.type_name}>" for n, o in kind.options.items() if not o.python_only)
        lines.append(f"  {name}" + (f" (options: {names})" if names else " (no options)"))
    return "\n".join(lines)


def parse_spec(spec: str | CacheSpec = "growable", **overrides: Any) -> CacheSpec:
    """Parse ``spec`` and merge keyword ``overrides``; raise ``SpecError`` listing valid choices."""
    if isinstance(spec, CacheSpec):
        name, options = spec.kind, dict(spec.options)
    elif isinstance(spec, str):
        name, _, rest = spec.strip().partition(":")
        name = name.strip()
        options = _parse_options(rest, spec) if rest.strip() else {}
    else:
        raise _spec_error(f"a cache spec must be a string like 'growable', got {type(spec).__name__}")
    kind = spec_kind(name)
    if kind is None:
        raise _spec_error(f"unknown cache kind {name!r} in spec {spec!r}")
    options.update(overrides)
    for option, value in list(options.items()):
        options[option] = _coerce(kind, option, value)
    for need in kind.required:
        if not any(n in options for n in need.split("|")):
            raise _spec_error(
                f"cache kind {name!r} needs option {need.replace('|', ' or ')}, "
                f"e.g. '{name}:{need.split('|')[0]}=4096'"
            )
    return CacheSpec(name, options)


def _parse_options(text: str, spec: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise _spec_error(f"spec option {item.strip()!r} in {spec!r} is not of the form name=value")
        options[name] = value
    return options


def _coerce(kind: SpecKind, name: str, value: Any) -> Any:
    declared = kind.options.get(name)
    if declared is None:
        raise _spec_error(f"unknown option {name!r} for cache kind {kind.name!r}")
    try:
        return declared.coerce(value)
    except ValueError as e:
        raise _spec_error(f"option {name!r} of cache kind {kind.name!r} {e}") from None
