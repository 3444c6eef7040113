"""How a layer class declares its kind: the options a cache spec may give it, their types and bounds.

A layer class names its ``kind`` and, beside it, declares what a cache spec may say about it:

- ``spec_options``: option name -> ``Option`` (its type and lower bound; ``object`` for options
  that only Python code can pass, such as caller-owned buffers);
- ``required_options``: the options a spec must give (``"a|b"``: either of them);
- ``spec_kinds()``: the spec kinds the class serves and the constructor arguments each one fixes
  (by default its own kind alone; ``EvictingLayer`` serves one kind per eviction policy; a layer
  that only ``make_cache`` places, never a spec, serves none);
- ``kind_options()``: the options of one of those kinds (by default ``spec_options``; an
  eviction kind adds its policy's own, SnapKV's ``window``);
- ``from_options()``: how a layer is built from a spec's checked options (by default the class
  called with them);
- ``at_depth()``: told its index among the cache's layers and their count (PyramidKV's budget
  shrinks with depth); a layer that does not care ignores it;
- ``unbounded`` (kinds whose memory grows with the sequence) and ``spec_order`` (its place in
  listings).

Declaring is not registering: which kinds exist is the table in ``registry.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


def number(value: Any) -> int | float:
    """A token count (int) or, below 1, a fraction (float): ``"1024"`` -> 1024, ``"0.25"`` -> 0.25."""
    out = float(value)
    return int(out) if out.is_integer() else out


@dataclass(frozen=True)
class Option:
    """One option of a cache kind: how to read it (``type``) and its smallest allowed value."""

    type: Callable[[Any], Any]
    least: float | None = None
    #: Whether ``least`` itself is allowed (``>=``) or not (``>``).
    inclusive: bool = True

    @property
    def python_only(self) -> bool:
        """Options typed ``object`` (tensors, lists of them) cannot come from a spec string."""
        return self.type is object

    @property
    def type_name(self) -> str:
        return self.type.__name__

    def coerce(self, value: Any) -> Any:
        """``value`` read as this option's type and checked against its bound.

        Raises ``ValueError`` saying what was expected (the caller names the option and kind).
        """
        if self.python_only:
            if isinstance(value, str):
                raise ValueError("cannot be given in a spec string; pass it as a keyword")
            return value
        try:
            if self.type is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            coerced = self.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be {self.type_name}, got {value!r}") from None
        if isinstance(coerced, float) and not math.isfinite(coerced):
            raise ValueError(f"must be a finite number, got {value!r}")
        if self.least is not None and (coerced < self.least or (coerced == self.least and not self.inclusive)):
            raise ValueError(f"must be {'>=' if self.inclusive else '>'} {self.least}, got {value!r}")
        return coerced


class DeclaredKind:
    """The declarations a layer class makes about its kind, with their defaults."""

    kind: ClassVar[str]
    #: What a cache spec may say about this kind: option name -> type and bound.
    spec_options: ClassVar[dict[str, Option]] = {}
    #: Options a spec must give; ``"a|b"`` means either of them.
    required_options: ClassVar[tuple[str, ...]] = ()
    #: True for kinds that promise nothing about memory (they grow with the sequence), so layers
    #: of a model that grow their own way fit beside them (``foreign.check_spec``).
    unbounded: ClassVar[bool] = False
    #: Where the kind comes in listings (``--help``, error messages): lowest first.
    spec_order: ClassVar[int] = 100
    #: Bounds of constructor arguments a spec cannot set (a window's ``initial_capacity``).
    keyword_options: ClassVar[dict[str, Option]] = {}

    @classmethod
    def check_options(cls, **options: Any) -> dict[str, Any]:
        """The given constructor arguments read by their declarations (type and bound), so a
        bound lives in one place; ``ValueError`` naming the first option that fails."""
        declared = {**cls.spec_options, **cls.keyword_options}
        checked = {}
        for name, value in options.items():
            try:
                checked[name] = declared[name].coerce(value)
            except ValueError as e:
                raise ValueError(f"{name} {e}") from None
        return checked

    @classmethod
    def spec_kinds(cls) -> dict[str, dict[str, Any]]:
        """The spec kinds this class serves, each with the constructor arguments it fixes."""
        return {cls.kind: {}}

    @classmethod
    def kind_options(cls, fixed: Mapping[str, Any]) -> dict[str, Option]:
        """The options a spec may give the kind that fixes ``fixed`` (one of ``spec_kinds()``'s)."""
        return cls.spec_options

    @staticmethod
    def spec_options_of(options: Any) -> Any:
        """What of a layer's ``options()`` (or a saved file's record of them) its spec fixes: all of
        them, unless the layer chooses some itself as it runs (``auto``'s storage)."""
        return options

    def at_depth(self, index: int, count: int) -> None:
        """Told by ``make_cache`` that this is layer ``index`` of the ``count`` it builds from the
        spec, before any update; only a layer whose behaviour depends on depth records it."""

    @classmethod
    def from_options(cls, options: dict[str, Any], buffers: Any = None) -> Any:
        """An empty layer from a spec's checked options (``buffers``: for kinds that take them)."""
        if buffers is not None:
            raise ValueError(f"a {cls.kind} layer takes no caller-owned buffers")
        return cls(**options)
