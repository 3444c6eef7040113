"""Mixed precision inside a layer: the kept slots a layer's rule ranks highest in a finer storage,
the rest in a coarser one (``fine=int8,fine_share=0.25`` on a selecting kind over ``storage=int4``).

A selecting layer (``evicting.py``, ``adaptive.py``) given ``fine`` holds its slots in a
``TieredStore``: two ``SlotStore`` runs, ``fine`` then ``coarse``, one layout each, the same tags
(positions, scores, and an Ada-KV layer's heads) in both. Which tokens are kept is the kind's own
choice, exactly as with one storage; the store only splits the kept set: after every settle the
``fine_share`` of the kept slots that rank highest (``rank``: the kind's eviction key, so sinks and
recent tokens, which are never evicted, rank first) go to the fine run, the others to the coarse
run. A token in the coarse run that ranks high again is moved back to the fine run from its codes
(its coarse error stays: nothing lost is recovered).

Every update of such a layer goes through the kind's candidate set (the overflow path of
``selecting.py``): its attention reads the kept slots decoded into full precision and the new
tokens, in one pass, then the kind keeps the best and the store splits and codes them. A slot that
stays in its run keeps its codes as they are (it is copied, not coded again), so decode steps add
no error to what they keep. The temporary is of the budget's size: a decode step dequantizes the
kept slots, which a single coded storage reads in place (``slots.SlotCodesReader``), so a mixed
layer's decode step is slower than one coded storage's.

Bytes: ``fine_share`` of the kept slots at the fine storage's size, the rest at the coarse one's,
each run allocated to exactly what it holds (plus the tags of every slot).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import DTypeError, ShapeError
from .checks import Geometry
from .slots import Slots
from .store import Layout, SlotStore

#: The tag a candidate slot carries between reading the store and writing it back: its place in
#: the store (fine run ``i``: ``i``; coarse run ``j``: ``FINE_LIMIT + j``), or -1 for a new token.
SOURCE = "source"
_RUNS = ("fine", "coarse")


def mixed_parts(name: str) -> tuple[str, float, str] | None:
    """``"int8@0.25+int4"`` -> ``("int8", 0.25, "int4")``: the name of a mixed storage (the fine
    storage, its share of the kept slots, the coarse storage), checked; None for one storage's name
    (checked too: ``ValueError`` names an unknown one)."""
    from .slots import SLOT_STORAGES, get_storage

    if "+" not in name:
        if name not in SLOT_STORAGES:
            get_storage(name)  # raises, naming the storages there are
        return None
    fine_part, _, coarse = name.partition("+")
    fine, _, share = fine_part.partition("@")
    try:
        value = float(share)
    except ValueError:
        raise ValueError(f"mixed storage {name!r}: write it fine@share+coarse, e.g. int8@0.25+int4") from None
    if not 0 < value < 1:
        raise ValueError(f"mixed storage {name!r}: the fine share must be in (0, 1), got {share}")
    if precision(get_storage(fine)) <= precision(get_storage(coarse)):
        raise ValueError(f"mixed storage {name!r}: {fine} must be finer than {coarse}")
    return fine, value, coarse


def mixed_name(fine: str, share: float, coarse: str) -> str:
    return f"{fine}@{share:g}+{coarse}"


def mean_slot_bytes(name: str, per_slot: Callable[[str], float]) -> float:
    """Bytes of one kept slot of storage ``name`` (one storage's, or a mixed one's mean over its
    two runs), ``per_slot(storage)`` giving one storage's."""
    parts = mixed_parts(name)
    if parts is None:
        return per_slot(name)
    fine, share, coarse = parts
    return share * per_slot(fine) + (1 - share) * per_slot(coarse)


def ranked(rank: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The order ``[B, H, N]`` in which slots go to the fine run: by ``rank``, highest first, and of
    equal ranks (the protected recent tokens, all ranked infinite) the newest first."""
    newest = positions.argsort(dim=-1, descending=True, stable=True)
    return newest.gather(2, rank.gather(2, newest).argsort(dim=-1, descending=True, stable=True))


def precision(storage: Slots) -> float:
    """Bits a storage keeps of a channel (inf for full precision): finer is more."""
    return math.inf if storage.format.exact else float(getattr(storage.format, "bits", 8))


class TieredStore:
    """A selecting layer's slots in two runs (see the module docstring).

    Reads give every kept slot decoded: ``keys`` ``[B, H, L, D]``, ``values``, the tags and
    ``source``, fine run first; ``write`` takes the kept candidates in that form and splits them.
    ``H`` is the store's heads (a KV head per row, or 1 for Ada-KV's flat store)."""

    def __init__(
        self, fine: Slots, coarse: Slots, share: float, tags: Callable[[Geometry], Layout],
        rank: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    ) -> None:  # fmt: skip
        self.storages = {"fine": fine, "coarse": coarse}
        self.share = share
        self.rank = rank
        self.runs = {run: SlotStore(layout=lambda g, s=self.storages[run]: {**s.layout(g), **tags(g)}) for run in _RUNS}
        self.tag_names = lambda g: tuple(tags(g))
        self.geometry: Geometry | None = None
        self.capacity = 0
        self.reallocations = 0

    @property
    def fine(self) -> Slots:
        return self.storages["fine"]

    @property
    def coarse(self) -> Slots:
        return self.storages["coarse"]

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return self.geometry is not None

    @property
    def batch(self) -> int:
        assert self.geometry is not None
        return self.geometry.batch

    @property
    def length(self) -> int:
        return sum(store.length for store in self.runs.values())

    @length.setter
    def length(self, value: int) -> None:
        if value != self.length:  # the selecting layers set what ``write`` already holds
            raise ValueError(f"a tiered store holds {self.length} slots; it is written whole, not resized to {value}")

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self.runs.values())

    def fine_count(self, kept: int) -> int:
        """Slots of ``kept`` (per row of the store) in the fine run."""
        return min(kept, round(self.share * kept))

    def allocate(self, capacity: int, geometry: Geometry, *, keep: bool = True, zeroed: bool = False) -> None:
        """Record the geometry and the slots the layer may hold; each run is sized when written.
        The runs stay until then, whatever ``keep`` says (``write`` copies the codes of the slots
        that stay), unless the batch changes."""
        if self.geometry is not None and self.geometry.batch != geometry.batch:
            self.drop()
        self.geometry, self.capacity = geometry, capacity
        self.reallocations += 1

    def drop(self) -> None:
        for store in self.runs.values():
            store.drop()
        self.geometry, self.capacity = None, 0

    # ---- reading --------------------------------------------------------------------------

    def in_use(self) -> dict[str, torch.Tensor]:
        """Every kept slot, decoded: keys, values, tags and ``source``, fine run first (copies)."""
        g = self.geometry
        assert g is not None
        parts: dict[str, list[torch.Tensor]] = {}
        offset = 0
        for run in _RUNS:
            store, storage, n = self.runs[run], self.storages[run], self.runs[run].length
            if not store.allocated:
                continue
            slots = store.tensors
            decoded = {"keys": storage.decode_run(slots, "k", 0, n, g), "values": storage.decode_run(slots, "v", 0, n, g)}
            for name in self.tag_names(g):
                decoded[name] = store.run(name, 0, n)
            like = decoded[self.tag_names(g)[0]]
            decoded[SOURCE] = (torch.arange(n, device=like.device) + offset).expand(like.shape).contiguous()
            offset = self._fine_limit()
            for name, t in decoded.items():
                parts.setdefault(name, []).append(t)
        if not parts:
            return {}
        return {name: torch.cat(ts, dim=2) if len(ts) > 1 else ts[0].clone() for name, ts in parts.items()}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.in_use()

    def run(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Slots ``start:stop`` of tag ``name`` (or of the decoded ``keys``/``values``), a copy."""
        if name in ("keys", "values", SOURCE):
            return self.in_use()[name].narrow(2, start, stop - start)
        parts = [store.run(name, 0, store.length) for store in self.runs.values() if store.allocated]
        return torch.cat(parts, dim=2).narrow(2, start, stop - start)

    def _fine_limit(self) -> int:
        return self.runs["fine"].capacity

    # ---- writing --------------------------------------------------------------------------

    def write(self, start: int, slots: dict[str, torch.Tensor]) -> None:
        """Hold exactly ``slots`` (the kept candidates ``[B, H, N(, D)]``, decoded, with their tags
        and ``source``): the ``fine_count(N)`` that ``rank`` puts first in the fine run, the rest in
        the coarse run, each in slot order. A slot staying in its run keeps its codes."""
        if start != 0:
            raise ValueError("a tiered store is written whole, from slot 0")
        g = self.geometry
        assert g is not None
        n = slots["positions"].shape[2]
        f = self.fine_count(n)
        order = ranked(self.rank(slots), slots["positions"])  # [B, H, N]
        chosen = {"fine": order[..., :f].sort(dim=-1).values, "coarse": order[..., f:].sort(dim=-1).values}
        source = slots.get(SOURCE)
        limit = self._fine_limit()
        written = {}
        for run in _RUNS:
            index = chosen[run]
            tags = {name: _gather(slots[name], index) for name in self.tag_names(g)}
            written[run] = {**self._coded(run, slots, index, None if source is None else _gather(source, index), limit), **tags}
        for run in _RUNS:
            store, t = self.runs[run], written[run]
            k = t["positions"].shape[2]
            store.allocate(k, g, keep=False)
            store.write(0, t)
            store.length = k

    def _coded(self, run: str, slots: dict[str, torch.Tensor], index: torch.Tensor, source: torch.Tensor | None,
               limit: int) -> dict[str, torch.Tensor]:  # fmt: skip
        """The codes of the candidates ``slots`` (decoded, ``[B, H, N, D]``) at ``index`` ``[B, H, k]``
        for run ``run``: a slot whose ``source`` is in that run already is copied from it; only the
        columns where some row or head has a slot from elsewhere are coded (a decode step moves a few)."""
        storage, old = self.storages[run], self.runs[run]
        if source is None or not old.allocated or not old.length:
            return storage.encode(_gather(slots["keys"], index), _gather(slots["values"], index))
        lo = 0 if run == "fine" else limit
        stays = (source >= lo) & (source < lo + old.length)  # [B, H, k]
        at = (source - lo).clamp(0, old.length - 1)
        coded = {name: _gather(old.tensors[name][:, :, : old.length], at) for name in storage.names}
        movers = (~stays).any(dim=1).any(dim=0).nonzero().flatten()  # the columns with a slot from elsewhere
        if movers.numel():
            where = index.index_select(2, movers)
            fresh = storage.encode(_gather(slots["keys"], where), _gather(slots["values"], where))
            moved = (~stays).index_select(2, movers)
            for name, t in fresh.items():
                column = coded[name].index_select(2, movers)
                coded[name].index_copy_(2, movers, torch.where(_widen(moved, t), t, column))
        return coded

    def rebatch(self, fn, capacity: int | None = None, *, count: bool = True) -> int:
        """Replace each run's slots in use by ``fn(slots)`` (another batch: ``[B, ...]`` -> ``[B', ...]``)."""
        assert self.geometry is not None
        batch = self.geometry.batch
        for store in self.runs.values():
            if store.allocated:
                batch = store.rebatch(fn, count=count)
        self.geometry = Geometry(batch, *self._rest(self.geometry))
        return batch

    @staticmethod
    def _rest(g: Geometry):
        return g.heads, g.key_dim, g.value_dim, g.dtype, g.device

    # ---- state ----------------------------------------------------------------------------

    def saved(self) -> dict[str, torch.Tensor]:
        """Both runs' tensors in use (views), named ``fine.<name>`` and ``coarse.<name>``."""
        return {f"{run}.{name}": t for run in _RUNS if self.runs[run].allocated for name, t in self.runs[run].in_use().items()}

    def split_saved(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """A saved state's tensors per run; raises naming what is missing or extra."""
        runs: dict[str, dict[str, torch.Tensor]] = {run: {} for run in _RUNS}
        for name, t in tensors.items():
            run, _, inner = name.partition(".")
            if run not in runs or not inner:
                raise ValueError(f"a mixed-precision layer state holds fine.<name> and coarse.<name> tensors, got {name!r}")
            runs[run][inner] = t
        for run in _RUNS:
            if not runs[run]:
                raise ValueError(f"a mixed-precision layer state lacks its {run} run ({self.storages[run].name})")
        return runs

    def geometry_of(self, runs: dict[str, dict[str, torch.Tensor]]) -> Geometry:
        """The store geometry of saved runs (checked alike)."""
        gs = [self.storages[run].geometry(runs[run]) for run in _RUNS]
        batch = runs["fine"]["positions"].shape[0]
        g = Geometry(batch, *self._rest(gs[0]))
        if self._rest(gs[1]) != self._rest(gs[0]) or runs["coarse"]["positions"].shape[0] != batch:
            raise ShapeError(f"a mixed-precision layer state's runs disagree: fine {gs[0]}, coarse {gs[1]}")
        if not g.dtype.is_floating_point:
            raise DTypeError(f"a mixed-precision layer state: keys or scales must be floating-point, got {g.dtype}")
        return g

    def check_saved(self, what: str, runs: dict[str, dict[str, torch.Tensor]], g: Geometry) -> None:
        for run in _RUNS:
            t = runs[run]
            if "positions" not in t or t["positions"].dim() != 3:
                raise ShapeError(f"{what} state: the {run} run needs positions [B, H, slots]")
            self.runs[run].check(f"{what} ({run} run)", t, g, t["positions"].shape[2])
        f, c = (runs[run]["positions"].shape[2] for run in _RUNS)
        if f != self.fine_count(f + c):
            raise ValueError(f"{what} state: {f} fine slots of {f + c}, not the {self.fine_count(f + c)} fine_share={self.share} keeps")

    def load_saved(self, runs: dict[str, dict[str, torch.Tensor]], g: Geometry, capacity: int) -> None:
        """Hold copies of checked saved runs."""
        self.drop()
        self.geometry, self.capacity = g, capacity
        for run in _RUNS:
            t = runs[run]
            self.runs[run].load(t, g, t["positions"].shape[2])

    def joined(self, runs: dict[str, dict[str, torch.Tensor]], name: str) -> torch.Tensor:
        """Tag ``name`` of saved runs, fine then coarse ``[B, H, slots]``."""
        return torch.cat([runs[run][name] for run in _RUNS], dim=2)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B, H, N(, X)]`` at slots ``index`` ``[B, H, k]``."""
    if t.dim() == 3:
        return t.gather(2, index)
    return t.gather(2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))


def _widen(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask if like.dim() == 3 else mask.unsqueeze(-1)
