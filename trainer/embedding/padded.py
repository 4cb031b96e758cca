"""The fixed-size lookup plan of a capturable step (train.cuda_graph=on at W = 1).

Why: plan_lookup (exchange.py) sizes its plan by the batch's unique ids, a count it reads back
from the device once per step; every tensor after it (the workspace, its gradient, the owner
update) then has a size that depends on the data. A CUDA graph replays fixed shapes and reads
nothing back, so this plan pads the unique ids to a capacity fixed by the config.

What: `capacity` slots, by default C = the sum over tables of min(local batch x max bag, the
table's rows): the batch never has more unique ids. A smaller capacity (train.unique_capacity)
saves memory and work; a batch that exceeds it gets a wrong plan (its extra ids clamped to the
last slot, nothing out of bounds) and a count above the capacity, which the caller reads with
the loss and stops the run on (trainer/train/whole_step.py). The first `count` slots hold the batch's unique ids in ascending order, the
same slots as plan_lookup's (so the workspace, the pooled gather and the rows' gradient are the
same numbers); the other C - count slots hold storage rows the batch does not touch, all distinct
(the smallest such rows, found by a search over the sorted ids: fixed-size). Their gradient is
zero and the owner update is masked there (ShardStore.apply_masked: row, optimizer state, version
and touched mark written back as they were), so padding changes nothing, and no two slots name
one row (a masked write-back racing a real one would). Ids at or above `sentinel` are padding
entries of the batch (ragged bags padded to a fixed length, trainer/train/whole_step.py): they join no
slot; their entries point at the last slot and carry a zero gradient (a padding slot unless the
batch holds every row of the shard; then the +0.0 they add can only turn a -0.0 sum into +0.0).

Bytes: per step, the [C] plan (PLAN_SLOT_BYTES a slot) and the caller's [C, d] workspace, its
gradient and the update's rows, where plan_lookup's were [U]: per batch, never per table row
(trainer/plan/memplan.py counts them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .exchange import sorted_runs
from .sharding import Sharding

__all__ = ["PLAN_SLOT_BYTES", "PaddedPlan", "padded_plan", "unique_capacity"]

PLAN_SLOT_BYTES = 8 + 8 + 1  # a slot's row (int64), its gap count for the search (int64), valid (bool)


@dataclass
class PaddedPlan:
    """rows: [C] distinct storage rows, the batch's unique ids (ascending) in the first `count`;
    inverse: [N] slot of every entry; valid: [C] slot holds one of the batch's ids; count: []
    int64 number of unique ids, on the device (never read back by the step)."""

    rows: torch.Tensor
    inverse: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor


def unique_capacity(local_batch: int, max_bag: int, table_rows: list[int], chosen: int = 0) -> int:
    """Slots of a padded plan: `chosen` (train.unique_capacity) when > 0, at most the bound: the
    most unique ids one batch can hold on this (W = 1) shard, per table the fewer of its ids in a
    batch and its rows."""
    bound = sum(min(local_batch * max_bag, rows) for rows in table_rows)
    return min(chosen, bound) if chosen > 0 else bound


def padded_plan(sharding: Sharding, gids: torch.Tensor, capacity: int,
                sentinel: Optional[int] = None) -> PaddedPlan:
    """The plan of a batch of fused global ids [N] (all owned by this rank: W = 1) in `capacity`
    slots; ids >= sentinel are padding entries. Every size is N or capacity; nothing is read."""
    dev, c = gids.device, capacity
    ids, perm, first = sorted_runs(sharding, gids)
    if sentinel is not None:  # padding entries sort last and start no slot
        first &= ids < sentinel
    seg = torch.cumsum(first, 0) - 1  # [N] slot of each sorted id (of padding ones: the last real)
    count = seg[-1] + 1 if seg.numel() else torch.zeros((), dtype=torch.int64, device=dev)
    slot = torch.arange(c, dtype=torch.int64, device=dev)
    valid = slot < count
    # the unique ids' storage rows into their slots (every other entry, and ids past a capacity
    # below the bound, into a dump slot c: the caller checks count <= capacity)
    members = torch.zeros(c + 1, dtype=torch.int64, device=dev)
    members.scatter_(0, torch.where(first, seg, c).clamp_(max=c), sharding.local_index(ids))
    members = members[:c]
    # padding slot count + k takes the k-th smallest row not in the batch: k plus the number of
    # members m_i with m_i - i <= k (m_i - i, the rows missing below m_i, does not decrease)
    missing_below = torch.where(valid, members - slot, sharding.local_rows + c)
    k = (slot - count).clamp_(min=0)
    rows = torch.where(valid, members, k + torch.searchsorted(missing_below, k, right=True))
    if sentinel is not None:
        seg = torch.where(ids < sentinel, seg, c - 1)
    seg = seg.clamp(max=c - 1)  # only past a capacity below the bound, where the step then stops
    inverse = torch.empty_like(seg).scatter_(0, perm, seg)
    return PaddedPlan(rows, inverse, valid, count)
