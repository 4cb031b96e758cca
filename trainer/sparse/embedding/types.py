"""The small value types the sparse side passes between its parts.

- LookupPlan: which rows a batch needs and where each comes from (made by plan_lookup);
- Pushes: row updates leaving a worker (the wire type of every remote-row protocol and the cache);
- GlobalStep: what every rank knows about the current step's global batch (made by the scheduler's
  feed, read by HybridEmbedding and the remote-row protocols);
- InFlightStep: one training step of this rank while it is in flight, from its prepared input side
  to its update: the one object that holds a step's state between calls.

They live here, not next to one producer, so that the no-cache path does not import the cache and
the scheduler does not import the embedding module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .cache.consistency import CURRENT_LIFE


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
    """Row updates leaving a worker: global ids [n], summed gradients [n, d], update counts [n],
    and (dynamic tables) the life each row's updates were made in, [n] or None
    (consistency.life_of; CURRENT_LIFE where they were made on the owner's current row, None when
    every one was): the owner drops updates of an id's earlier life."""

    gids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor
    lives: Optional[torch.Tensor] = None

    @classmethod
    def empty(cls, dim: int, device: torch.device) -> "Pushes":
        return cls(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dim, device=device),
                   torch.empty(0, dtype=torch.int64, device=device))

    @classmethod
    def single(cls, gids: torch.Tensor, grads: torch.Tensor, lives: Optional[torch.Tensor] = None) -> "Pushes":
        """One update per row."""
        return cls(gids, grads, torch.ones_like(gids), lives)

    @classmethod
    def cat(cls, parts: list["Pushes"]) -> "Pushes":
        lives = None
        if any(p.lives is not None for p in parts):
            lives = torch.cat([p.lives if p.lives is not None else torch.full_like(p.gids, CURRENT_LIFE)
                               for p in parts])
        return cls(torch.cat([p.gids for p in parts]), torch.cat([p.grads for p in parts]),
                   torch.cat([p.counts for p in parts]), lives)

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


@dataclass
class InFlightStep:
    """One training step of this rank from its input side to its update (or its discard).

    Why one object: a step is begun in one call and finished in others, with train.pipeline even
    across two steps (step i+1's batch, plan and id requests are made during step i). Everything a
    later call needs travels in this object, handed from call to call (trainer/step/pipeline.py holds the
    current one and the one prepared ahead); neither the embedding module nor a remote-row protocol
    keeps a hidden copy of a step.

    step:   the training step index
    batch:  this rank's batch, on the device
    info:   the step's GlobalStep (None given: an ordinary step, GlobalStep())
    plan:   its lookup plan (HybridEmbedding.prepare; None: not prepared yet, lookup prepares it)
    token:  the remote protocol's begun read (RemoteRows.begin; None: a hot step, or nothing begun)
    read:   what the protocol's read left for its write or discard (RemoteRows.read), once looked up
    ws:     the workspace leaf [U, d] of the training lookup; its .grad holds the row gradients
    alltoalls_ahead: alltoall calls made for this step while the step before it ran (the trainer
            counts every step's own calls, trainer/step/pipeline.py)
    """

    step: int
    batch: Any
    info: Optional[GlobalStep] = None
    plan: Optional[LookupPlan] = None
    token: Any = None
    read: Any = None
    ws: Optional[torch.Tensor] = None
    alltoalls_ahead: int = 0

    def __post_init__(self) -> None:
        if self.info is None:
            self.info = GlobalStep()
