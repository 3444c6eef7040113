"""Storage formats: how keys and values are kept, shared by the library's layers and the engine's pool.

A format is a stateless description (``base.Format``): the tensors a run of tokens becomes
(``key_layout``/``value_layout``), how keys and values are coded into them and read back
(``encode_*``/``decode_*``), and what a token costs (``bytes_per_token``). Two formats exist:

- ``FullPrecision``: the keys and values as computed, in their dtype;
- ``Codes``: int8/int4/int2 codes with a scale and minimum per group. Values are coded per token
  in groups of channels; keys either per token the same way (a slot can then be overwritten alone:
  what evicting layers need) or per channel over a block of ``key_block`` tokens (KIVI: keys have
  outlier channels; a block is written whole: the quantized layer and the engine's coded pool).

Whoever holds tensors of a format allocates them from its layouts: a layer's slot store
(``layers/store.py``, ``[B, Hkv, C, ...]``) or the pool's block storage (``blocks.BlockStorage``,
``[layers, blocks, Hkv, ...]``). ``format_named`` maps a ``storage=`` option to its format.
"""

from .base import Format, Layout
from .blocks import BlockStorage
from .codes import Codes
from .full import FullPrecision

#: The ``storage=`` names a layer takes.
STORAGES = ("full", "int8", "int4", "int2")


def format_named(name: str, group: int = 64) -> Format:
    """The slot format a ``storage=`` option names: ``full``, or ``int8``/``int4``/``int2`` coded
    per token (keys too) in groups of ``group`` channels."""
    if name == "full":
        return FullPrecision()
    if name in STORAGES[1:]:
        return Codes(int(name[3:]), group)
    raise ValueError(f"unknown slot storage {name!r}; choose one of {STORAGES}")


__all__ = ["STORAGES", "BlockStorage", "Codes", "Format", "FullPrecision", "Layout", "format_named"]
