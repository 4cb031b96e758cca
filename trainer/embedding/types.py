"""The small value types the sparse side passes between its parts.

- LookupPlan: which rows a batch needs and where each comes from (made by plan_lookup);
- Pushes: row updates leaving a worker (the wire type of every remote-row protocol and the cache);
- GlobalStep: what every rank knows about the current step's global batch (made by the scheduler's
  feed, read by HybridEmbedding and the remote-row protocols).

They live here, not next to one producer, so that the no-cache path does not import the cache and
the scheduler does not import the embedding module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


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


@dataclass
class Pushes:
    """Row updates leaving a worker: global ids [n], summed gradients [n, d], update counts [n]."""

    gids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def empty(cls, dim: int, device: torch.device) -> "Pushes":
        return cls(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dim, device=device),
                   torch.empty(0, dtype=torch.int64, device=device))

    @classmethod
    def single(cls, gids: torch.Tensor, grads: torch.Tensor) -> "Pushes":
        """One update per row."""
        return cls(gids, grads, torch.ones_like(gids))

    @classmethod
    def cat(cls, parts: list["Pushes"]) -> "Pushes":
        return cls(torch.cat([p.gids for p in parts]), torch.cat([p.grads for p in parts]),
                   torch.cat([p.counts for p in parts]))

    def __len__(self) -> int:
        return int(self.gids.numel())


@dataclass
class GlobalStep:
    """What every rank knows about the current step's global batch (from the scheduler's feed).

    hot:       every id of the global batch is replicated: the step runs no alltoall at all
    hot_slots: [u] sorted replica slots the global batch touches (the rows the allreduce sums)
    sync:      the remote protocol's plan for this step (Herald), identical on every rank
    """

    hot: bool = False
    hot_slots: Optional[torch.Tensor] = None
    sync: Any = None
