"""The no-cache wire and the lookup plan.

Why separate: "which rows do I need" (plan_lookup, from the batch and the sharding) is separated
from "fetch them" (a remote-row protocol, remote/). RowExchange is the no-cache wire over alltoall:
requests of ids -> replies of rows -> pushes of gradients in the same step (exact, BSP). It also
serves evaluation, which always reads fresh rows from the owners. The HET cache's own wire (version
checks, counted pushes) is remote/het.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import Collectives
from .sharding import Sharding
from .store import ShardStore
from .types import LookupPlan


def plan_lookup(sharding: Sharding, gids: torch.Tensor,
                hot_slot_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LookupPlan:
    """Dedup the batch's global ids and split them into replicated, owned and remote-by-owner.
    hot_slot_of(uniq) -> [U] replica slot or -1 (None: nothing is replicated)."""
    uniq, inverse = torch.unique(gids, sorted=True, return_inverse=True)
    slot = hot_slot_of(uniq) if hot_slot_of is not None else torch.full_like(uniq, -1)
    hot = slot >= 0
    owner = sharding.owner(uniq)
    mine = sharding.owned_by(uniq) & ~hot
    owned_pos = torch.nonzero(mine).squeeze(1)
    remote_pos = torch.nonzero(~mine & ~hot).squeeze(1)
    remote_owner = owner[remote_pos]
    order = torch.argsort(remote_owner, stable=True)
    remote_pos = remote_pos[order]
    splits = sharding.per_owner(uniq[remote_pos])
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


def wire_dtype(local_rows: int) -> torch.dtype:
    """Integer type of ids / versions / counts on the wire: int32 while an owner's rows fit."""
    return torch.int32 if local_rows < 2 ** 31 - 1 else torch.int64


def no_cache_wire_bytes(remote, dim: int, row_elem: int, id_bytes: int = 8) -> dict:
    """Bytes of the no-cache protocol (RowExchange.pull + push) for `remote` unique remote ids:
    an int64 id request, the row reply, the row gradient push."""
    return {"ids": remote * id_bytes, "rows": remote * dim * row_elem, "grads": remote * dim * row_elem}


def segment_counts(mask: torch.Tensor, splits: list[int]) -> list[int]:
    """Number of True in each consecutive segment of `mask` of lengths `splits`."""
    seg = torch.repeat_interleave(torch.arange(len(splits), device=mask.device),
                                  torch.tensor(splits, dtype=torch.int64, device=mask.device))
    return torch.bincount(seg[mask], minlength=len(splits)).tolist()
