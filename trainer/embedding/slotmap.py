"""The id -> slot map of a worker's cached or lent rows (RowCache in cache.py, LentRows in
remote/herald.py): one choice between a direct array and a hash map, made here.

Why two kinds: on the CPU, an int32 array over the whole id space is the cheapest map there is
(one index per lookup, no probing), but it costs 4 bytes per id of the model, cached or not; past
DIRECT_MAP_MAX_IDS ids (512 MiB), and on any device, the hash map of kernels/hashmap.py
(kernels.make_id_slot_map: the Triton table on a GPU), whose size follows the slots instead.
"""
from __future__ import annotations

import torch

import kernels
from kernels.hashmap import IdSlotMap

DIRECT_MAP_MAX_IDS = 1 << 27  # CPU: a direct id -> slot array up to this many ids (512 MiB int32)


class DirectSlotMap(IdSlotMap):
    """id -> slot as a dense int32 array over the whole id space [0, n_ids) (CPU fast path)."""

    def __init__(self, n_ids: int, device: torch.device | str = "cpu") -> None:
        self._slot = torch.full((n_ids,), -1, dtype=torch.int32, device=device)
        self._live = 0

    @property
    def device(self) -> torch.device:
        return self._slot.device

    def __len__(self) -> int:
        return self._live

    def lookup(self, ids):
        slots = self._slot.index_select(0, ids).long()
        return slots, slots < 0

    def insert(self, ids, slots):
        new = self._slot.index_select(0, ids) < 0
        self._slot.index_copy_(0, ids, slots.to(torch.int32))
        self._live += int(new.sum())
        return new

    def items(self):
        ids = torch.nonzero(self._slot >= 0).squeeze(1)
        return ids, self._slot.index_select(0, ids).long()

    def erase(self, ids):
        found = self._slot.index_select(0, ids) >= 0
        self._slot.index_fill_(0, ids, -1)
        self._live -= int(found.sum())
        return found


def id_slot_map(n_ids: int, slots: int, device: torch.device | str) -> IdSlotMap:
    """The map of `slots` slots over ids [0, n_ids) on `device`: a DirectSlotMap on the CPU up to
    DIRECT_MAP_MAX_IDS ids, else the kernels' hash map sized for the slots (at least one)."""
    dev = torch.device(device)
    if dev.type == "cpu" and n_ids <= DIRECT_MAP_MAX_IDS:
        return DirectSlotMap(n_ids, dev)
    return kernels.make_id_slot_map(max(slots, 1), dev)
