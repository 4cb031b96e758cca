"""The fixed-size lookup plans of a capturable step (train.cuda_graph=on): at W = 1 padded_plan, at
W > 1 padded_request (the ids asked of every owner in fixed blocks) and padded_combine (the owner's
sum of what it receives in fixed slots); both are described at the end of this docstring.

Why: plan_lookup (exchange.py) sizes its plan by the batch's unique ids, a count it reads back
from the device once per step; every tensor after it (the workspace, its gradient, the owner
update) then has a size that depends on the data. A CUDA graph replays fixed shapes and reads
nothing back, so this plan pads the unique ids to a capacity fixed by the config.

What: `capacity` slots, by default C = the sum over tables of min(local batch x max bag, the
table's rows): the batch never has more unique ids. A smaller capacity (train.unique_capacity)
saves memory and work; a batch that exceeds it gets a wrong plan (its extra ids clamped to the
last slot, nothing out of bounds) and a count above the capacity: the caller masks the step's
update with count <= capacity and, reading the excess with the loss, trains the step again in
exact sizes (trainer/step/pipeline.py). The first `count` slots hold the batch's unique ids in ascending order, the
same slots as plan_lookup's (so the workspace, the pooled gather and the rows' gradient are the
same numbers); the other C - count slots hold storage rows the batch does not touch, all distinct
(the smallest such rows, found by a search over the sorted ids: fixed-size). Their gradient is
zero and the owner update is masked there (ShardStore.apply_masked: row, optimizer state, version
and touched mark written back as they were), so padding changes nothing, and no two slots name
one row (a masked write-back racing a real one would). Ids at or above `sentinel` are padding
entries of the batch (ragged bags padded to a fixed length, trainer/step/whole_step.py): they join no
slot; their entries point at the last slot and carry a zero gradient (a padding slot unless the
batch holds every row of the shard; then the +0.0 they add can only turn a -0.0 sum into +0.0).

Bytes: per step, the [C] plan (PLAN_SLOT_BYTES a slot) and the caller's [C, d] workspace, its
gradient and the update's rows, where plan_lookup's were [U]: per batch, never per table row
(trainer/run/resolve/memplan.py counts them).

W > 1 (trainer/step/padded_step.py): a rank's request has W blocks of C slots, block w holding the
batch's unique ids owner w holds (ascending: the order plan_lookup sends them in) and then padding
(the storage row local_rows, which no owner has); C is the same bound per owner (per table the
fewer of local batch x max bag and the rows rank 0 holds, RowSharding's largest share). The owner
receives W x C entries and sums their gradients in K = min(W x C, its rows) slots, the pushed rows
ascending first and then distinct rows no push names (as above), from -0.0 in entry order: the
same sums as the eager owner's. Bytes: REQUEST_SLOT_BYTES and 8 x d floats per slot of the W
blocks (memplan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ....workload.data.batch import Batch
from ..exchange import run_starts, sorted_runs
from ..sharding import Sharding, rows_on_rank
from ..store.shard import ShardStore

__all__ = ["PLAN_SLOT_BYTES", "REQUEST_SLOT_BYTES", "BagPadding", "PaddedCombine", "PaddedPlan", "PaddedRequest",
           "owner_sums", "padded_combine", "padded_plan", "padded_request", "unique_capacity"]

PLAN_SLOT_BYTES = 8 + 8 + 1  # a slot's row (int64), its gap count for the search (int64), valid (bool)
# W > 1, a slot of a rank's W blocks: its request id and the id served (int64 each), the owner's
# order, sort and slot of that entry (int64 x 3), the slot's valid flag and count (1 + 7, rounded)
REQUEST_SLOT_BYTES = 8 + 8 + 3 * 8 + 8


@dataclass
class PaddedPlan:
    """rows: [C] distinct storage rows, the batch's unique ids (ascending) in the first `count`;
    inverse: [N] slot of every entry; valid: [C] slot holds one of the batch's ids; count: []
    int64 number of unique ids, on the device (never read back by the step)."""

    rows: torch.Tensor
    inverse: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor


class BagPadding:
    """A batch's ids at a fixed count: ragged bags (data.min_bag < data.max_bag) make the id count
    vary, so the ids are padded to local batch x tables x max bag, the padding entries in one extra
    bag of an extra sample (the caller drops its pooled row before the model), their ids the
    table-local id that makes the fused global id `sentinel` (past every table), which the plans
    leave out. Bags of one fixed length need no padding (sentinel None)."""

    def __init__(self, sharding: Sharding, min_bag: int, max_bag: int) -> None:
        offsets = sharding.table_offsets  # [T + 1], host
        self.max_bag, self.ragged = max_bag, min_bag != max_bag
        self.sentinel = int(offsets[-1]) if self.ragged else None
        self.pad_id = int(offsets[-1] - offsets[-2])

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dense, ids, lengths, labels): ids [B x T x max bag], lengths [B + 1, T] when ragged (the
        padding in the extra sample's last bag). Sizes from the batch's shape (host integers),
        nothing read from the device."""
        values, lengths = batch.values, batch.lengths
        if self.ragged:
            n, cap = values.numel(), batch.batch_size * batch.num_tables * self.max_bag
            padded = values.new_full((cap,), self.pad_id)
            padded[:n] = values
            extra = lengths.new_zeros(1, batch.num_tables)
            extra[0, -1].fill_(cap - n)  # a fill launched with the count (t[i] = x would copy x from the host)
            values, lengths = padded, torch.cat([lengths, extra])
        return batch.dense, values, lengths, batch.labels


def unique_capacity(local_batch: int, max_bag: int, table_rows: list[int], chosen: int = 0,
                    world: int = 1) -> int:
    """Slots of a padded plan (W = 1), or of each owner's block of a padded request (W > 1):
    `chosen` (train.unique_capacity) when > 0, at most the bound: the most unique ids one batch
    can ask one owner for, per table the fewer of its ids in a batch and the rows an owner holds
    (rank 0's: no rank holds more, RowSharding)."""
    bound = sum(min(local_batch * max_bag, rows_on_rank(rows, 0, world)) for rows in table_rows)
    return min(chosen, bound) if chosen > 0 else bound


def padded_plan(sharding: Sharding, gids: torch.Tensor, capacity: int,
                sentinel: Optional[int] = None, skip: Optional[torch.Tensor] = None) -> PaddedPlan:
    """The plan of a batch of fused global ids [N] (all owned by this rank: W = 1) in `capacity`
    slots; ids >= sentinel are padding entries; entries where `skip` [N] holds (replicated rows,
    read from the replica) join no slot either (their inverse is the caller's to set). Every size
    is N or capacity; nothing is read."""
    dev, c = gids.device, capacity
    if skip is not None:  # as padding entries: past every id (the caller gives a sentinel then)
        sentinel = sentinel if sentinel is not None else sharding.n_ids
        gids = torch.where(skip, sentinel, gids)
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
    rows = _with_padding_rows(members, valid, count, sharding.local_rows)
    if sentinel is not None:
        seg = torch.where(ids < sentinel, seg, c - 1)
    seg = seg.clamp(max=c - 1)  # only past a capacity below the bound, where the step then stops
    inverse = torch.empty_like(seg).scatter_(0, perm, seg)
    return PaddedPlan(rows, inverse, valid, count)


def _with_padding_rows(members: torch.Tensor, valid: torch.Tensor, count: torch.Tensor,
                       local_rows: int) -> torch.Tensor:
    """[C] distinct storage rows: `members` (ascending) where valid (the first `count` slots), and
    in padding slot count + k the k-th smallest row of [0, local_rows) not among them: k plus the
    number of members m_i with m_i - i <= k (m_i - i, the rows missing below m_i, does not
    decrease). Fixed-size: a search over the members."""
    c = members.numel()
    slot = torch.arange(c, dtype=torch.int64, device=members.device)
    missing_below = torch.where(valid, members - slot, local_rows + c)
    k = (slot - count).clamp_(min=0)
    return torch.where(valid, members, k + torch.searchsorted(missing_below, k, right=True))


# ---- W > 1: a request in fixed blocks per owner, and the owner's fixed-size sum ---------------------
@dataclass
class PaddedRequest:
    """A batch's rows asked of every owner in blocks of C slots (W > 1; trainer/step/padded_step.py).
    ids: [W x C] storage rows, block w for owner w: the batch's unique ids w owns, ascending (the
    order plan_lookup sends them in), in its first slots, then local_rows (no row: padding);
    inverse: [N] workspace slot (w x C + position) of every entry; valid: [W x C] slot holds one
    of the batch's ids; count: [] unique ids; excess: [] ids past a block's capacity, summed over
    the blocks (> 0: the plan dropped ids, the step is trained again in exact sizes); largest: [] the most unique
    ids asked of one owner. On the device, none read."""

    ids: torch.Tensor
    inverse: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor
    excess: torch.Tensor
    largest: torch.Tensor


def padded_request(sharding: Sharding, gids: torch.Tensor, capacity: int,
                   sentinel: Optional[int] = None, skip: Optional[torch.Tensor] = None) -> PaddedRequest:
    """The request of a batch of fused global ids [N] (ids >= sentinel: padding entries) in W
    blocks of `capacity` slots; entries where `skip` [N] is True (replicated rows, read from the
    replica) join no block, as padding entries. One sort by (owner, id); every size is N, W or
    W x capacity."""
    w, c, n_ids, dev = sharding.world, capacity, sharding.n_ids, gids.device
    past = w * n_ids  # the key of a padding entry: after every real one
    key = sharding.owner(gids) * n_ids + gids
    if sentinel is not None:
        key = torch.where(gids < sentinel, key, past)
    if skip is not None:
        key = torch.where(skip, past, key)
    skey, perm = torch.sort(key)
    first = run_starts(skey)
    real = skey < past
    first &= real
    owner = torch.div(skey, n_ids, rounding_mode="floor").clamp_(max=w - 1)
    per = torch.zeros(w, dtype=torch.int64, device=dev).index_add_(0, owner, first.long())  # [W] unique ids per owner
    start = torch.cumsum(per, 0) - per
    pos = torch.cumsum(first, 0) - 1 - start.index_select(0, owner)  # [N] position in its owner's block
    slot = owner * c + pos.clamp(min=0, max=c - 1)
    slot = torch.where(real, slot, w * c - 1)  # padding entries: the last slot, a zero gradient
    fill = torch.full((w * c + 1,), sharding.local_rows, dtype=torch.int64, device=dev)
    fill.scatter_(0, torch.where(first & (pos < c), slot, w * c), sharding.local_index(skey - owner * n_ids))
    valid = (torch.arange(c, device=dev).unsqueeze(0) < per.unsqueeze(1)).reshape(-1)
    inverse = torch.empty_like(slot).scatter_(0, perm, slot)
    return PaddedRequest(fill[:w * c], inverse, valid, per.sum(), (per - c).clamp_(min=0).sum(), per.max())


@dataclass
class PaddedCombine:
    """An owner's fixed-size sum of the gradients pushed to it: rows [K] distinct storage rows (the
    pushed rows ascending in the first `count`, then rows no push names); slot [M] the slot of every
    pushed entry (K: a padding entry, outside the slots); valid [K]; counts [K] entries per slot."""

    rows: torch.Tensor
    slot: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor

    def sums(self, grads: torch.Tensor) -> torch.Tensor:
        """[K, d] the entries' gradients [M, d] summed per slot, in entry order (index_add_ from
        -0.0, the exact identity of addition: the same sums as kernels.reference.first_and_sums,
        -0.0 included)."""
        k = self.rows.numel()
        out = torch.full((k + 1, grads.shape[1]), -0.0, dtype=grads.dtype, device=grads.device)
        return out.index_add_(0, self.slot, grads)[:k]


def padded_combine(idx: torch.Tensor, local_rows: int) -> PaddedCombine:
    """The slots of pushed storage rows idx [M] (local_rows: a padding entry) in K = min(M,
    local_rows) slots, never exceeded (the pushes name at most that many distinct rows)."""
    m, dev = idx.numel(), idx.device
    k = min(m, local_rows)
    sidx, perm = torch.sort(idx.long())
    first = run_starts(sidx)
    real = sidx < local_rows
    first &= real
    seg = torch.cumsum(first, 0) - 1
    count = seg[-1] + 1 if m else torch.zeros((), dtype=torch.int64, device=dev)
    valid = torch.arange(k, device=dev) < count
    members = torch.zeros(k + 1, dtype=torch.int64, device=dev)
    members.scatter_(0, torch.where(first, seg, k), sidx)
    rows = _with_padding_rows(members[:k], valid, count, local_rows)
    slot = torch.empty_like(seg).scatter_(0, perm, torch.where(real, seg, k))
    counts = torch.zeros(k + 1, dtype=torch.int64, device=dev).index_add_(0, slot, torch.ones_like(slot))
    return PaddedCombine(rows, slot, valid, counts[:k])


def owner_sums(store: ShardStore, idx: torch.Tensor, counts: torch.Tensor, grads: torch.Tensor) -> PaddedCombine:
    """The owner's update of the entries it received (storage rows idx [M], local_rows: none),
    summed per row in entry order (padded_combine), versions advanced by the entries' counts [M]
    (1 each for the plain step's gradients; the pushed updates for the HET cache's); returns the
    slots (the rows updated: rows where valid, for the audit)."""
    comb = padded_combine(idx, store.sharding.local_rows)
    k = comb.rows.numel()
    advance = torch.zeros(k + 1, dtype=torch.int64, device=idx.device).index_add_(0, comb.slot, counts)[:k]
    store.apply_masked(comb.rows, comb.sums(grads), comb.valid, counts=advance)
    return comb
