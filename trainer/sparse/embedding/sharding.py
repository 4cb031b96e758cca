"""Where every embedding row lives: the ONE place ids are converted.

Three id spaces appear in the trainer:
- table-local ids: (table t, id i) with 0 <= i < table_rows[t], what the data yields;
- flat ids: sum(table_rows[:t]) + i, independent of the world size W (profiles, placement plans and
  the scheduler's global view are kept in it, so a plan made for one W applies to any W);
- fused global ids ("gids"): the id space of a sharding, where the trainer's lookups, caches and
  wire protocols work. A strategy decides the layout of this space and which worker owns a gid.

Every conversion between them, and every "who owns this row / where is it stored" question, is a
method of a `Sharding` object; no other module computes `gid % W` or `gid // W`. A second strategy
(table-wise, column-wise) is a new subclass here, not edits in ten places.

RowSharding (the one in use): row i of every table is owned by worker i mod W. All tables live in
one fused space whose table offsets are padded to a multiple of W, so for any gid g: owner(g) =
g mod W and the owner's storage row is g div W, with no per-table lookup on the hot path. Each rank
stores ceil(n_t / W) rows per table (at most one padding row per table that no id maps to); tables
need not divide by W.

The conversions accept torch tensors and, where the scheduler and planners need them, numpy arrays.
The layout's own tensors (table offsets) are made once on the host; a conversion of device ids uses
a copy of them on the ids' device, made at its first use there and kept (`on_device`), so a step
never copies them again nor mixes host offsets with device ids.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar, Union

import numpy as np
import torch

from ...base.core.hashing import mix64
from ...workload.data.ids import ID_BITS, ID_LIMIT  # dynamic tables: ids in [0, 2^56); gid = (table << ID_BITS) | id

Ids = TypeVar("Ids", torch.Tensor, np.ndarray)
Array = Union[torch.Tensor, np.ndarray]


def flat_starts(table_rows: list[int]) -> np.ndarray:
    """[T] first flat id of every table (the flat space has no padding)."""
    return np.concatenate([[0], np.cumsum(table_rows)[:-1]]).astype(np.int64)


def flat_ids(values: np.ndarray, lengths: np.ndarray, table_rows: list[int]) -> np.ndarray:
    """[N] flat ids of a sample-major id list (values [N], lengths [n, T]: ids per sample and table)."""
    t = np.repeat(np.tile(np.arange(lengths.shape[1]), lengths.shape[0]), lengths.reshape(-1))
    return np.asarray(values, dtype=np.int64) + flat_starts(table_rows)[t]


def rows_on_rank(rows: int, rank: int, world: int) -> int:
    """Real rows of a table of `rows` rows that rank `rank` of `world` owns: ids rank + qW."""
    return max(-(-(rows - rank) // world), 0)


class Sharding(ABC):
    """A layout of the fused global id space and the owner of every row (abstract strategy).

    table_rows: rows per table; world, rank: this worker; table_offsets [T+1] (torch int64): first
    gid of every table (the last entry is the size of the space); local_rows: storage rows each
    worker holds.
    """

    table_rows: list[int]
    world: int
    rank: int
    table_offsets: torch.Tensor
    local_rows: int

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def n_ids(self) -> int:
        """Size of the fused global id space (padding included)."""
        return int(self.table_offsets[-1])

    def on_device(self, name: str, device: torch.device) -> torch.Tensor:
        """The layout tensor attribute `name` (e.g. "table_offsets") on `device`: copied there at its
        first use and kept, so the hot path never copies host offsets again."""
        copies = self.__dict__.setdefault("_device_copies", {})
        key = (name, torch.device(device))
        t = copies.get(key)
        if t is None:
            t = copies[key] = getattr(self, name).to(device)
        return t

    # ---- table-local <-> global ----------------------------------------------------------
    def global_ids(self, values: torch.Tensor, table_index: torch.Tensor) -> torch.Tensor:
        """[N] fused global ids of per-table ids `values` in tables `table_index`."""
        return values + self.on_device("table_offsets", values.device)[table_index]

    def decode(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, per-table id) of gids; padding ids give id >= table_rows[table]."""
        offs = self.on_device("table_offsets", gids.device)
        table = torch.searchsorted(offs[1:], gids, right=True)
        return table, gids - offs[table]

    def table_of(self, gids: torch.Tensor) -> torch.Tensor:
        return self.decode(gids)[0]

    def valid(self, gids: torch.Tensor) -> torch.Tensor:
        """Mask of gids that are real rows (not padding)."""
        table, ids = self.decode(gids)
        return ids < torch.tensor(self.table_rows, dtype=torch.int64, device=gids.device)[table]

    # ---- flat <-> global -----------------------------------------------------------------
    def from_flat(self, flat: Ids) -> Ids:
        """Fused global ids of flat ids (numpy or torch)."""
        cached = self.__dict__.get("_flat_shift")
        if cached is None:  # host arrays, once (the scheduler calls this every step)
            ends = np.cumsum(self.table_rows).astype(np.int64)
            offsets = np.asarray(self.table_offsets.tolist()[:-1], np.int64)
            shift = offsets - (ends - np.asarray(self.table_rows, np.int64))
            cached = self.__dict__["_flat_shift"] = (ends, shift)
        ends, shift = cached
        if isinstance(flat, torch.Tensor):
            f = flat.cpu().numpy()
            return torch.from_numpy(f + shift[np.searchsorted(ends, f, side="right")]).to(flat.device)
        flat = np.asarray(flat, np.int64)
        return flat + shift[np.searchsorted(ends, flat, side="right")]

    def to_flat(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] flat ids of real gids (torch): the row's identity at any W (the stochastic rounding
        of half-precision rows is keyed by it, embedding/optim.py). Padding gids give ids that
        are no row's (nothing reads them)."""
        table, ids = self.decode(gids)
        if "_flat_starts" not in self.__dict__:  # host tensor, once; on_device keeps its copies
            self.__dict__["_flat_starts"] = torch.from_numpy(flat_starts(self.table_rows))
        return ids + self.on_device("_flat_starts", gids.device)[table]

    # ---- ownership and storage -----------------------------------------------------------
    @abstractmethod
    def owner(self, gids: Ids) -> Ids:
        """Worker that owns each gid."""

    @abstractmethod
    def local_index(self, gids: Ids) -> Ids:
        """Storage row of each gid on its owner."""

    @abstractmethod
    def global_of(self, local_idx: Ids, rank: int) -> Ids:
        """Gids of storage rows `local_idx` of worker `rank` (inverse of owner + local_index)."""

    def owned_by(self, gids: Ids, rank: int | None = None) -> Ids:
        """Mask of gids owned by `rank` (default: this worker)."""
        return self.owner(gids) == (self.rank if rank is None else rank)

    def split(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks (owned here, remote) over gids."""
        mine = self.owned_by(gids)
        return mine, ~mine

    def per_owner(self, gids: Ids, weights: torch.Tensor | None = None) -> list[int]:
        """Number of gids per owner [W] (the splits of an alltoall grouped by owner; with int64
        `weights`, their sum per owner). Device ids: counted into a [W] vector (fixed size, unlike
        bincount, whose length depends on the values), read back once."""
        if isinstance(gids, torch.Tensor):
            counts = torch.zeros(self.world, dtype=torch.int64, device=gids.device)
            w = torch.ones_like(gids) if weights is None else weights
            return counts.index_add_(0, self.owner(gids), w).tolist()
        return np.bincount(self.owner(np.asarray(gids, np.int64)), minlength=self.world).tolist()

    def owner_order(self, gids: np.ndarray) -> np.ndarray:
        """gids (numpy) sorted by (owner, gid): the order rows travel in, per owner."""
        gids = np.asarray(gids, dtype=np.int64)
        return gids[np.lexsort((gids, self.owner(gids)))]

    def local_gids(self, rank: int | None = None) -> torch.Tensor:
        """[local_rows] global id of every storage row of `rank` (padding rows included)."""
        r = self.rank if rank is None else rank
        return self.global_of(torch.arange(self.local_rows, dtype=torch.int64), r)

    def real_rows(self, rank: int | None = None) -> int:
        """How many real (not padding) rows `rank` stores: ids t_start + rank + qW of each table,
        counted in closed form (no per-row array)."""
        r = self.rank if rank is None else rank
        return sum(rows_on_rank(n, r, self.world) for n in self.table_rows)

    def for_rank(self, rank: int) -> "Sharding":
        """The same layout seen from worker `rank`."""
        return type(self)(self.table_rows, self.world, rank)


class RowSharding(Sharding):
    """Row i of every table on worker i mod W, in a fused space padded per table to a multiple of W."""

    def __init__(self, table_rows: list[int], world: int, rank: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of size {world}")
        self.table_rows = list(table_rows)
        self.world, self.rank = world, rank
        per_rank = [-(-n // world) for n in self.table_rows]  # ceil(n / W) rows per rank
        self.local_table_offsets = torch.tensor([0] + per_rank, dtype=torch.int64).cumsum(0)
        self.table_offsets = self.local_table_offsets * world  # [T+1] padded global offsets
        self.local_rows = int(self.local_table_offsets[-1])  # rows stored on every rank
        # W a power of two: g mod W and g div W as a mask and a shift (the same values for every
        # int64, negatives included: floor semantics), ~10x cheaper on the CPU than % and //
        self._shift = world.bit_length() - 1 if world & (world - 1) == 0 else None

    def owner(self, gids):
        return gids & (self.world - 1) if self._shift is not None else gids % self.world

    def local_index(self, gids):
        return gids >> self._shift if self._shift is not None else gids // self.world

    def global_of(self, local_idx, rank):
        return local_idx * self.world + rank

    def local_table_of(self, local_idx: torch.Tensor) -> torch.Tensor:
        """Table of storage rows `local_idx` (on any worker)."""
        return torch.searchsorted(self.on_device("local_table_offsets", local_idx.device)[1:], local_idx,
                                  right=True)


_ID_MASK = ID_LIMIT - 1


class HashSharding(Sharding):
    """Dynamic tables (embedding.kind=dynamic): any id in [0, 2^56) of any table; the owner of
    (table t, id i) is hash(t, i) mod W, with hash = splitmix64 of the gid (t << 56) | i.

    There is no storage row per gid: each owner keeps its rows in a pool of `capacity` rows per
    table and maps gids to pool slots (embedding/dynamic.py), so local_index / global_of do not
    exist here. The gid space is T x 2^56 (int64 on the wire); "flat ids" (a W-independent
    identity, the rounding key of half rows) are the gids themselves."""

    def __init__(self, num_tables: int, capacity: int, world: int, rank: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of size {world}")
        if num_tables >= 1 << (63 - ID_BITS):
            raise ValueError(f"dynamic tables: at most {(1 << (63 - ID_BITS)) - 1} tables, not {num_tables}")
        self.num_tables_, self.capacity = num_tables, capacity
        self.table_rows = [ID_LIMIT] * num_tables  # the id space of every table
        self.world, self.rank = world, rank
        self.table_offsets = torch.arange(num_tables + 1, dtype=torch.int64) << ID_BITS
        self.local_table_offsets = torch.arange(num_tables + 1, dtype=torch.int64) * capacity
        self.local_rows = num_tables * capacity  # the pool's slots

    def decode(self, gids):
        return gids >> ID_BITS, gids & _ID_MASK

    def valid(self, gids):
        return torch.ones_like(gids, dtype=torch.bool)

    def to_flat(self, gids):
        return gids

    def from_flat(self, flat):
        return flat

    def owner(self, gids):
        if isinstance(gids, np.ndarray):
            return self.owner(torch.from_numpy(np.asarray(gids, np.int64))).numpy()
        if self.world == 1:  # x mod 1: no hash to compute
            return torch.zeros_like(gids, dtype=torch.int64)
        h = mix64(gids) & 0x7FFFFFFFFFFFFFFF
        if self.world & (self.world - 1) == 0:  # x mod 2^k = x & (2^k - 1) for x >= 0, 30x cheaper than int64 %
            return h & (self.world - 1)
        return h % self.world

    def local_index(self, gids):
        raise TypeError("dynamic tables have no fixed storage row per id: ask the owner's pool (DynamicStore.slots)")

    def global_of(self, local_idx, rank):
        raise TypeError("dynamic tables have no fixed id per storage row: ask the owner's pool (DynamicStore)")

    def real_rows(self, rank: int | None = None) -> int:
        return self.local_rows

    def local_table_of(self, local_idx: torch.Tensor) -> torch.Tensor:
        """Table of pool slots `local_idx`."""
        return local_idx // self.capacity

    def for_rank(self, rank: int) -> "HashSharding":
        return HashSharding(self.num_tables_, self.capacity, self.world, rank)
