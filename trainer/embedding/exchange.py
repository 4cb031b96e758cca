"""The per-step row exchange over alltoall: requests of ids -> replies of rows -> pushes of grads.

Why a class of its own: "which rows do I need" (LookupPlan, computed from the batch) is separated
from "fetch them" (RowExchange.pull). A cache slots in between: it filters the remote ids of a plan
down to those that must be pulled, and decides which accumulated gradients to push. This module is
the no-cache protocol: every remote row is pulled every step and every row gradient is pushed in
the same step, which is exact synchronous training (BSP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Collectives
from .sharding import RowSharding
from .store import ShardStore


@dataclass
class LookupPlan:
    """Which rows a batch needs and where each comes from.

    uniq:       [U] sorted unique global ids of the batch
    inverse:    [N] slot in uniq of every id of the batch (the gather's slot indices)
    owned_pos:  [Uo] positions in uniq of ids this rank owns
    remote_pos: [Ur] positions in uniq of remote ids, grouped by owner rank (ascending)
    splits:     [W] number of remote ids per owner (0 for this rank)
    """

    uniq: torch.Tensor
    inverse: torch.Tensor
    owned_pos: torch.Tensor
    remote_pos: torch.Tensor
    splits: list[int]

    @property
    def remote_ids(self) -> torch.Tensor:
        return self.uniq[self.remote_pos]

    @property
    def owned_ids(self) -> torch.Tensor:
        return self.uniq[self.owned_pos]


def plan_lookup(sharding: RowSharding, gids: torch.Tensor) -> LookupPlan:
    """Dedup the batch's global ids and split them into owned and remote-by-owner."""
    uniq, inverse = torch.unique(gids, sorted=True, return_inverse=True)
    owner = sharding.owner(uniq)
    mine = owner == sharding.rank
    owned_pos = torch.nonzero(mine).squeeze(1)
    remote_pos = torch.nonzero(~mine).squeeze(1)
    remote_owner = owner[remote_pos]
    order = torch.argsort(remote_owner, stable=True)
    remote_pos = remote_pos[order]
    splits = torch.bincount(remote_owner, minlength=sharding.world).tolist()
    return LookupPlan(uniq, inverse, owned_pos, remote_pos, splits)


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
