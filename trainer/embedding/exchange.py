"""The per-step row exchange over alltoall: requests of ids -> replies of rows -> pushes of grads.

Why a class of its own: "which rows do I need" (LookupPlan, computed from the batch) is separated
from "fetch them" (RowExchange.pull). A cache slots in between: it filters the remote ids of a plan
down to those that must be pulled, and decides which accumulated gradients to push. This module is
the no-cache protocol: every remote row is pulled every step and every row gradient is pushed in
the same step, which is exact synchronous training (BSP).

With a cache (cache.py) the protocol is HET's: `check` sends (id, cached version) pairs, the owner
answers every id with its version when it sends the row (no copy, or the copy is more than the
pull bound behind) or -1 ("still fresh"), then only those rows travel; `push_updates` sends
(id, update count, summed gradient) for whichever rows the cache decided to push. On the wire an id
is its owner's storage row (gid div W), as int32 whenever the shard allows, like the versions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import Collectives
from .cache import Pushes
from .consistency import HIST_BINS, needs_row, staleness_histogram
from .sharding import RowSharding
from .store import ShardStore


@dataclass
class LookupPlan:
    """Which rows a batch needs and where each comes from.

    uniq:       [U] sorted unique global ids of the batch
    inverse:    [N] slot in uniq of every id of the batch (the gather's slot indices)
    owned_pos:  [Uo] positions in uniq of ids this rank owns (replicated ones excluded)
    remote_pos: [Ur] positions in uniq of remote ids, grouped by owner rank (ascending)
    splits:     [W] number of remote ids per owner (0 for this rank)
    hot_pos:    [Uh] positions in uniq of replicated (hot) ids
    hot_slots:  [Uh] their replica slots
    """

    uniq: torch.Tensor
    inverse: torch.Tensor
    owned_pos: torch.Tensor
    remote_pos: torch.Tensor
    splits: list[int]
    hot_pos: torch.Tensor
    hot_slots: torch.Tensor

    @property
    def remote_ids(self) -> torch.Tensor:
        return self.uniq[self.remote_pos]

    @property
    def owned_ids(self) -> torch.Tensor:
        return self.uniq[self.owned_pos]


def plan_lookup(sharding: RowSharding, gids: torch.Tensor,
                hot_slot_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LookupPlan:
    """Dedup the batch's global ids and split them into replicated, owned and remote-by-owner.
    hot_slot_of(uniq) -> [U] replica slot or -1 (None: nothing is replicated)."""
    uniq, inverse = torch.unique(gids, sorted=True, return_inverse=True)
    slot = hot_slot_of(uniq) if hot_slot_of is not None else torch.full_like(uniq, -1)
    hot = slot >= 0
    owner = sharding.owner(uniq)
    mine = (owner == sharding.rank) & ~hot
    owned_pos = torch.nonzero(mine).squeeze(1)
    remote_pos = torch.nonzero(~mine & ~hot).squeeze(1)
    remote_owner = owner[remote_pos]
    order = torch.argsort(remote_owner, stable=True)
    remote_pos = remote_pos[order]
    splits = torch.bincount(remote_owner, minlength=sharding.world).tolist()
    hot_pos = torch.nonzero(hot).squeeze(1)
    return LookupPlan(uniq, inverse, owned_pos, remote_pos, splits, hot_pos, slot[hot_pos])


class RowExchange:
    """Pull remote rows from their owners and push row gradients back, over alltoall.

    Every rank is both a requester and an owner in each call: the owner side serves the rows asked
    for and, on push, returns the gradients it received together with their ids.
    """

    def __init__(self, comm: Collectives, store: ShardStore) -> None:
        self.comm, self.store = comm, store
        self._served: torch.Tensor | None = None  # ids peers pulled from us this step
        self._served_splits: list[int] = []
        self._pulled_splits: list[int] = []
        self.staleness = torch.zeros(store.sharding.num_tables, HIST_BINS, dtype=torch.int64,
                                     device=store.weight.device)
        self.max_staleness = torch.zeros(store.sharding.num_tables, dtype=torch.int64,
                                         device=store.weight.device)  # [T] largest read staleness

    def pull(self, remote_ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """[Ur, d] rows of remote_ids (grouped by owner as `splits` says)."""
        served, served_splits = self.comm.alltoall(remote_ids, splits, kind="ids")
        rows = self.store.rows(served)
        got, _ = self.comm.alltoall(rows, served_splits, kind="rows", recv_splits=splits)
        self._served, self._served_splits, self._pulled_splits = served, served_splits, list(splits)
        return got

    def push(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send grads [Ur, d] of the last pull's ids to their owners.

        Returns (ids, grads) received as owner: the rows peers pulled from us and their gradients,
        in the order they were served, so no ids need to travel again.
        """
        if self._served is None:
            raise RuntimeError("push() without a preceding pull() in this step")
        recv, _ = self.comm.alltoall(grads, self._pulled_splits, kind="grads",
                                     recv_splits=self._served_splits)
        served, self._served = self._served, None
        return served, recv

    def forget(self) -> None:
        """Drop the last pull's bookkeeping: its gradients will not be pushed (a skipped step)."""
        self._served = None

    # ---- HET protocol (with a cache) -----------------------------------------------------
    @property
    def wire_dtype(self) -> torch.dtype:
        """Integer type of ids (owner storage rows), versions and counts on the wire."""
        return wire_dtype(self.store.sharding.local_rows)

    def check(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
              pull_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Version check + pull of the rows that must be re-read.

        remote_ids [Ur] grouped by owner as `splits`; cached_versions [Ur] (-1 = no copy);
        pull_bound [T] per table. Returns (need [Ur] bool, versions [Ur] owner version of each
        row sent, -1 elsewhere; rows [need.sum(), d] in the order of `need`). The owner side
        records the staleness of the reads it let through in `self.staleness` [T, bins].
        """
        sh, wire = self.store.sharding, self.wire_dtype
        req = torch.stack([sh.local_index(remote_ids), cached_versions], 1).to(wire)
        served, served_splits = self.comm.alltoall(req, splits, kind={"ids": 1, "versions": 1})
        idx, ver = served[:, 0].long(), served[:, 1].long()
        now = self.store.versions(idx)
        table = torch.searchsorted(sh.local_table_offsets[1:], idx, right=True)
        send = needs_row(ver, now, pull_bound[table])
        gap = torch.where(send, torch.zeros_like(now), now - ver)
        self.staleness += staleness_histogram(gap, table, sh.num_tables)
        self.max_staleness.scatter_reduce_(0, table, gap, reduce="amax")
        reply = torch.where(send, now, torch.full_like(now, -1)).to(wire)
        got, _ = self.comm.alltoall(reply, served_splits, kind="versions", recv_splits=splits)
        versions = got.long()
        need = versions >= 0
        send_splits = _segment_counts(send, served_splits)
        rows, _ = self.comm.alltoall(self.store.weight.index_select(0, idx[send]), send_splits,
                                     kind="rows", recv_splits=_segment_counts(need, splits))
        return need, versions, rows

    def push_updates(self, pushes: Pushes) -> Pushes:
        """Send (id, count, gradient) of pushed rows to their owners; return what this rank
        received as owner (global ids, gradients, counts), not yet applied."""
        sh = self.store.sharding
        order = torch.argsort(sh.owner(pushes.gids), stable=True)
        gids, grads, counts = pushes.gids[order], pushes.grads[order], pushes.counts[order]
        splits = torch.bincount(sh.owner(gids), minlength=sh.world).tolist()
        head = torch.stack([sh.local_index(gids), counts], 1).to(self.wire_dtype)
        got, recv_splits = self.comm.alltoall(head, splits, kind={"ids": 1, "versions": 1})
        recv, _ = self.comm.alltoall(grads, splits, kind="grads", recv_splits=recv_splits)
        return Pushes(got[:, 0].long() * sh.world + sh.rank, recv, got[:, 1].long())


def wire_dtype(local_rows: int) -> torch.dtype:
    """Integer type of ids / versions / counts on the wire: int32 while an owner's rows fit."""
    return torch.int32 if local_rows < 2 ** 31 - 1 else torch.int64


def het_wire_bytes(requested, pulled, pushed_rows, dim: int, row_elem: int, wire: int) -> dict:
    """Bytes on the wire of the HET protocol from its counts (numbers or arrays, per table or total).

    requested: remote ids looked up (each sends (id, version) and gets a version-or-(-1) back);
    pulled: rows sent by owners; pushed_rows: rows pushed (id, count, gradient each).
    dim, row_elem: row width and element size; wire: size of an id/version/count on the wire.
    The trainer's summary and scripts/simulate_cache.py both count bytes with this function.
    """
    row = dim * row_elem
    return {"version_check": requested * 3 * wire, "rows": pulled * row,
            "pushes": pushed_rows * (2 * wire + row)}


def no_cache_wire_bytes(remote, dim: int, row_elem: int, id_bytes: int = 8) -> dict:
    """Bytes of the no-cache protocol (RowExchange.pull + push) for `remote` unique remote ids:
    an int64 id request, the row reply, the row gradient push."""
    return {"ids": remote * id_bytes, "rows": remote * dim * row_elem, "grads": remote * dim * row_elem}


def _segment_counts(mask: torch.Tensor, splits: list[int]) -> list[int]:
    """Number of True in each consecutive segment of `mask` of lengths `splits`."""
    seg = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits, dtype=torch.int64))
    return torch.bincount(seg[mask], minlength=len(splits)).tolist()
