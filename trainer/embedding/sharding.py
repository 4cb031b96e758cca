"""Row-wise sharding: row `id` of every table is owned by worker id mod W.

Why this layout: all tables live in one fused global id space whose table offsets are padded to a
multiple of W. Then for any global id g: owner(g) = g mod W and the owner's local storage row is
g div W, with no per-table lookup on the hot path. Each rank stores ceil(n_t / W) rows per table
(at most one padding row per table that no id ever maps to); tables need not divide by W.
"""
from __future__ import annotations

import torch


class RowSharding:
    """Maps (table, id) <-> fused global id <-> (owner rank, local row)."""

    def __init__(self, table_rows: list[int], world: int, rank: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of size {world}")
        self.table_rows = list(table_rows)
        self.world, self.rank = world, rank
        per_rank = [-(-n // world) for n in self.table_rows]  # ceil(n / W) rows per rank
        self.local_table_offsets = torch.tensor([0] + per_rank, dtype=torch.int64).cumsum(0)
        self.table_offsets = self.local_table_offsets * world  # [T+1] padded global offsets
        self.local_rows = int(self.local_table_offsets[-1])  # rows stored on every rank

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def global_ids(self, values: torch.Tensor, table_index: torch.Tensor) -> torch.Tensor:
        """[N] fused global ids of per-table ids `values` in tables `table_index`."""
        return values + self.table_offsets[table_index]

    def owner(self, gids: torch.Tensor) -> torch.Tensor:
        return gids % self.world

    def local_index(self, gids: torch.Tensor) -> torch.Tensor:
        """Storage row of gids on their owner."""
        return gids // self.world

    def split(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks (owned here, remote) over gids."""
        mine = self.owner(gids) == self.rank
        return mine, ~mine

    def local_gids(self, rank: int | None = None) -> torch.Tensor:
        """[local_rows] global id of every storage row of `rank` (padding rows included)."""
        r = self.rank if rank is None else rank
        return torch.arange(self.local_rows, dtype=torch.int64) * self.world + r

    def decode(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, per-table id) of gids; padding ids give id >= table_rows[table]."""
        table = torch.searchsorted(self.table_offsets[1:], gids, right=True)
        return table, gids - self.table_offsets[table]

    def valid(self, gids: torch.Tensor) -> torch.Tensor:
        """Mask of gids that are real rows (not padding)."""
        table, ids = self.decode(gids)
        return ids < torch.tensor(self.table_rows, dtype=torch.int64)[table]
