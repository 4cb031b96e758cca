"""The id -> slot map of a worker's cached or lent rows (RowCache in rows.py, LentRows in
remote/lent.py): one choice between a direct array and a hash map, made here.

Why two kinds: on the CPU, an int32 array over the whole id space is the cheapest map there is
(one index per lookup, no probing), but it costs 4 bytes per id of the model, cached or not. So it
is used only while it stays sized by the cache, not by the model: at most DIRECT_IDS_PER_SLOT ids
per slot (64 B per slot, less than a slot's row; the default 10% cache qualifies), and at most
DIRECT_MAP_MAX_IDS ids (512 MiB). Otherwise, and on any device, the hash map of kernels/id_slot_map_triton.py
(kernels.make_id_slot_map: the Triton table on a GPU), whose size follows the slots (16 B cells,
2.7-5.3 per slot: kernels.id_slot_map_reference.cells_bound).
"""
from __future__ import annotations

import torch

import kernels
from kernels import IdSlotMap, cells_bound

DIRECT_MAP_MAX_IDS = 1 << 27  # CPU: a direct id -> slot array up to this many ids (512 MiB int32)
DIRECT_IDS_PER_SLOT = 16  # ... and up to this many ids per slot (4 B each: 64 B per slot)


def uses_direct_map(n_ids: int, slots: int, device: torch.device | str) -> bool:
    """Whether id_slot_map(n_ids, slots, device) is a DirectSlotMap (the memory plan asks too)."""
    return (torch.device(device).type == "cpu" and n_ids <= DIRECT_MAP_MAX_IDS
            and n_ids <= DIRECT_IDS_PER_SLOT * max(slots, 1))


class DirectSlotMap(IdSlotMap):
    """id -> slot as a dense int32 array over the whole id space [0, n_ids) (CPU fast path). -1
    marks an absent id; any other value is held, negative ones too (tiered.py keeps codes of its
    log's records there)."""

    def __init__(self, n_ids: int, device: torch.device | str = "cpu") -> None:
        # one entry more, past the ids: the masked calls write their masked-off entries there
        self._full = torch.full((n_ids + 1,), -1, dtype=torch.int32, device=device)
        self._slot = self._full[:n_ids]
        self._dump = n_ids
        self._live = torch.zeros((), dtype=torch.int64, device=device)  # ids held (read by len())

    @property
    def device(self) -> torch.device:
        return self._slot.device

    def __len__(self) -> int:
        return int(self._live)

    def lookup(self, ids):
        slots = self._slot.index_select(0, ids).long()
        return slots, slots == -1

    def insert(self, ids, slots):
        new = self._slot.index_select(0, ids) == -1
        self._slot.index_copy_(0, ids, slots.to(torch.int32))
        self._live += new.sum()
        return new

    def insert_where(self, ids, slots, mask):
        """insert() of the entries where mask holds, at fixed size (no read)."""
        at = torch.where(mask, ids, self._dump)
        self._live += (mask & (self._full.index_select(0, at) == -1)).sum()
        self._full.index_copy_(0, at, slots.to(torch.int32))  # the dump entry: never looked up

    def erase_where(self, ids, mask):
        """erase() of the entries where mask holds, at fixed size (no read)."""
        at = torch.where(mask, ids, self._dump)
        self._live -= (mask & (self._full.index_select(0, at) != -1)).sum()
        self._full.index_fill_(0, at, -1)

    def items(self):
        ids = torch.nonzero(self._slot != -1).squeeze(1)
        return ids, self._slot.index_select(0, ids).long()

    def erase(self, ids):
        found = self._slot.index_select(0, ids) != -1
        self._slot.index_fill_(0, ids, -1)
        self._live -= found.sum()
        return found


def map_bytes(n_ids: int, slots: int, device: torch.device | str) -> int:
    """Bytes id_slot_map(n_ids, slots, device) holds at most: 4 per id when direct, else the
    hash map's 16 B cells (kernels.id_slot_map_reference.cells_bound)."""
    if uses_direct_map(n_ids, slots, device):
        return 4 * n_ids
    return 16 * cells_bound(max(slots, 1))


def id_slot_map(n_ids: int, slots: int, device: torch.device | str) -> IdSlotMap:
    """The map of `slots` slots over ids [0, n_ids) on `device`: a DirectSlotMap where
    uses_direct_map says so, else the kernels' hash map sized for the slots (at least one)."""
    dev = torch.device(device)
    if uses_direct_map(n_ids, slots, dev):
        return DirectSlotMap(n_ids, dev)
    return kernels.make_id_slot_map(max(slots, 1), dev)
