"""Storage formats: how keys and values are kept, shared by the library's layers and the engine's pool.

A format is a stateless description (``base.Format``): the tensors a run of tokens becomes
(``key_layout``/``value_layout``), how keys and values are coded into them and read back
(``encode_*``/``decode_*``), and what a token costs (``bytes_per_token``); a format of codes that
attention reads straight also answers ``base.CodedFormat`` (its bits and groups, and ``rotate``/``unrotate``
for the query and output). Three formats exist:

- ``FullPrecision``: the keys and values as computed, in their dtype;
- ``Codes``: int8/int4/int2 codes with a scale and minimum per group, or fp8 (e4m3) codes with a
  scale and midpoint per group (``fp8.py``). Values are coded per token
  in groups of channels; keys either per token the same way (a slot can then be overwritten alone:
  what evicting layers need) or per channel over a block of ``key_block`` tokens (KIVI: keys have
  outlier channels; a block is written whole: the quantized layer and the engine's coded pool);
- ``Rotated``: per-token ``Codes`` of keys and values turned by a Hadamard rotation first, which
  spreads the outlier channels (``rotated.py``; the ``int8h``/``int4h``/``int2h`` slot storages).

Whoever holds tensors of a format allocates them from its layouts: a layer's slot store
(``layers/store.py``, ``[B, Hkv, C, ...]``) or the pool's block storage (``blocks.BlockStorage``,
``[layers, blocks, Hkv, ...]``). ``format_named`` maps a ``storage=`` option to its format.
"""

from .base import CodedFormat, Format, Layout
from .blocks import BlockStorage
from .codes import Codes
from .full import FullPrecision
from .rotated import Rotated

#: The ``storage=`` names a layer takes, finest first: plain codes ...
STORAGES = ("full", "int8", "int4", "int2")
#: ... and codes of rotated keys and values.
ROTATED = ("full", "int8h", "int4h", "int2h")
#: Every slot storage name (fp8: e4m3 codes, beside the integer ones).
SLOT_STORAGES = (*STORAGES, *ROTATED[1:], "fp8")


def format_named(name: str, group: int = 64) -> Format:
    """The slot format a ``storage=`` option names: ``full``; ``int8``/``int4``/``int2`` coded per
    token (keys too) in groups of ``group`` channels; ``int8h``/``int4h``/``int2h`` the same over
    rotated keys and values; ``fp8`` e4m3 codes per token in groups of ``group`` channels."""
    if name == "full":
        return FullPrecision()
    if name == "fp8":
        return Codes(8, group, fp8=True)
    if name in STORAGES[1:]:
        return Codes(int(name[3:]), group)
    if name in ROTATED[1:]:
        return Rotated(int(name[3:-1]), group)
    raise ValueError(f"unknown slot storage {name!r}; choose one of {SLOT_STORAGES}")


__all__ = ["ROTATED", "SLOT_STORAGES", "STORAGES", "BlockStorage", "CodedFormat", "Codes", "Format", "FullPrecision", "Layout", "Rotated", "format_named"]
