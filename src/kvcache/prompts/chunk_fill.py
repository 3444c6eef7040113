"""Chunk entries written straight into a cache's buffers: one copy, the digest checked as it goes.

``ChunkFiller`` fills the first ``columns`` slots of a new cache. The first entry it is given fixes
each layer's geometry (its header already agreed with the model, ``chunk_entry``): every layer
hands out its next ``columns`` slots (``KVLayer.next_slots``, views of the layer's own store), the
columns of each row's left padding are zeroed, and each entry's keys and values then go from the
entry's bytes to their slots in the pass that computes the entry's digest
(``stream.copy_and_digest``; CPU caches: one run of bytes per row, layer, side and head). An entry
whose digest disagrees raises ``StoreEntryError``: what it wrote lies in slots not counted yet.
``commit`` counts the slots in once every entry has passed, so a cache is never left half filled.
On another device the digest is checked first, then the keys and values copied tensor by tensor.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..errors import StoreEntryError
from ..hf.cache import KVCache
from ..layers.checks import Geometry
from .chunk_entry import ChunkLayout, OpenedChunk
from .chunks import Place
from .entry import check_digest
from .stream import Runs, copy_and_digest


class ChunkFiller:
    """Fills slots ``[0, columns)`` of the empty ``cache`` (``pads[r]``: row r's left padding) from
    chunk entries of ``layout`` (``fill``), then counts them in (``commit``)."""

    def __init__(self, cache: KVCache, layout: ChunkLayout, columns: int, pads: list[int], device: torch.device, secret: bytes | None):
        self.cache, self.layout, self.columns, self.pads = cache, layout, columns, pads
        self.device, self.secret = torch.device(device), secret
        self.shapes: tuple[tuple[int, ...], ...] | None = None
        self.slots: list[torch.Tensor] = []  # per name of layout.names: [B, Hkv, columns, D]
        self._template: dict[str, np.ndarray] | None = None  # CPU slots: see _run_template

    def fill(self, entry: OpenedChunk, places: list[Place]) -> None:
        """Copy ``entry``'s keys and values to ``places``; raises ``StoreEntryError`` (nothing
        counted) if its digest or its shapes disagree."""
        if self.shapes is None:
            self._reserve(entry.shapes)
        elif entry.shapes != self.shapes:
            raise StoreEntryError(f"entry {entry.key[:16]}: its tensors' shapes {entry.shapes} differ from the other chunks' {self.shapes}")
        runs = Runs.none() if self._template is None else self._runs_of(entry, places)
        check_digest(entry.key, entry.stated, copy_and_digest(entry.payload, runs, entry.key, self.secret), self.secret)
        if self._template is None:  # buffers no CPU address reaches: copied by torch once the digest passed
            self._copy_tensors(entry, places)

    def commit(self) -> None:
        """Count the filled slots in: every layer now holds ``columns`` tokens."""
        for layer in self.cache.kv_layers:
            if layer is not None:
                layer.commit_slots(self.columns)

    # ---- the slots ------------------------------------------------------------------------

    def _reserve(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Each layer's next ``columns`` slots for the geometry ``shapes`` gives, padding zeroed."""
        batch, live = len(self.pads), [layer for layer in self.cache.kv_layers if layer is not None]
        for layer, keys, values in zip(live, shapes[0::2], shapes[1::2]):
            geometry = Geometry(batch, keys[1], keys[3], values[3], self.layout.dtype, self.device)
            self.slots += layer.next_slots(self.columns, geometry)
        for row, pad in enumerate(self.pads):
            for slots in self.slots if pad else ():
                slots[row, :, : min(pad, self.columns)].zero_()
        self.shapes = shapes
        self._template = self._run_template() if all(_plain_cpu(t) for t in self.slots) else None

    def _run_template(self) -> dict[str, np.ndarray]:
        """Per (tensor, head) of an entry: its head's offset in the tensor, bytes per token, and the
        address of its row 0, slot 0 in the cache, and how far a row and a slot move it."""
        size = torch.empty((), dtype=self.layout.dtype).element_size()
        heads = np.array([s[1] for s in self.shapes], dtype=np.int64)
        owner = np.repeat(np.arange(len(self.shapes)), heads)
        head = np.concatenate([np.arange(h) for h in heads])
        token_bytes = np.array([s[3] * size for s in self.shapes], dtype=np.int64)[owner]
        strides = np.array([t.stride()[:3] for t in self.slots], dtype=np.int64)[owner] * size
        bases = np.array([t.data_ptr() for t in self.slots], dtype=np.int64)[owner]
        return {
            "owner": owner,
            "head_offset": head * self.layout.chunk * token_bytes,
            "token_bytes": token_bytes,
            "target": bases + head * strides[:, 1],
            "row_stride": strides[:, 0],
            "slot_stride": strides[:, 2],
        }

    def _runs_of(self, entry: OpenedChunk, places: list[Place]) -> Runs:
        t = self._template
        source = entry.offsets[t["owner"]] + t["head_offset"]
        return Runs(
            np.concatenate([source for _ in places]),
            np.concatenate([place.take * t["token_bytes"] for place in places]),
            np.concatenate([t["target"] + place.row * t["row_stride"] + place.at * t["slot_stride"] for place in places]),
        ).sorted()

    def _copy_tensors(self, entry: OpenedChunk, places: list[Place]) -> None:
        """The general path: each tensor of the entry viewed in place, copied to its slots by torch."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
            for offset, shape, slots in zip(entry.offsets.tolist(), self.shapes, self.slots):
                count = shape[1] * shape[2] * shape[3]
                source = torch.frombuffer(entry.payload, dtype=self.layout.dtype, count=count, offset=offset).view(shape[1:])
                for place in places:
                    slots[place.row, :, place.at : place.at + place.take].copy_(source[:, : place.take])


def _plain_cpu(t: torch.Tensor) -> bool:
    """A CPU tensor ``[B, Hkv, n, D]`` whose slots of a (row, head) are one run of bytes."""
    return t.device.type == "cpu" and t.stride(3) == 1 and t.stride(2) == t.shape[3]
