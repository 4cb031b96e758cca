"""Id-to-slot hash map for the embedding cache: the interface (IdSlotMap) and its Triton table
(TritonIdSlotMap); the reference backend, also the CPU path, is kernels/id_slot_map_reference.py.

Why a GPU hash map: every step maps the batch's remote ids to cache slots (lookup), installs fetched
rows (insert) and evicts (erase). Doing that on the host means a device->host copy of the ids every
step; an open-addressing table on the device keeps the ids where they are.

Triton table: linear probing over a power-of-two array of int64 keys (EMPTY=-1, TOMBSTONE=-2, so ids
must be >= 0) and int64 values. Insert claims EMPTY cells with atomic CAS (never tombstones, so a
key can never appear twice); erase writes TOMBSTONE. The table is rebuilt (tombstones dropped, size
doubled when needed) when live + tombstones could pass ``max_load``: the host tracks an upper bound
so this costs a device sync only when a rebuild may be due.

Batch semantics (both backends): ``lookup(ids)`` -> (slots [n] int64, -1 on miss; miss [n] bool);
``insert(ids, slots)`` upserts and returns new [n] bool (id was absent; with a duplicate id in one
batch exactly one of its occurrences is reported new and which value is kept is unspecified for the
Triton table, the last one for the reference); ``erase(ids)`` -> found [n] bool (present before the
call).
"""

from __future__ import annotations

import abc
from typing import Any, Tuple

import torch
from torch import Tensor

from kernels._triton import cdiv, jit, next_pow2

tl: Any = None  # bound to triton.language by kernels._triton.jit at first launch


EMPTY = -1
TOMBSTONE = -2
_BLOCK = 128


class IdSlotMap(abc.ABC):
    """Batched int64 id -> int64 slot map. All tensors live on ``device``."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where keys, values and results live."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of live ids (may sync the device)."""

    @abc.abstractmethod
    def lookup(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
        """ids [n] -> (slots [n] int64 with -1 on miss, miss [n] bool)."""

    @abc.abstractmethod
    def insert(self, ids: Tensor, slots: Tensor) -> Tensor:
        """Upsert ids [n] -> slots [n]; returns new [n] bool (id was absent before)."""

    def insert_absent(self, ids: Tensor, slots: Tensor) -> None:
        """insert() of ids [n] the caller knows are distinct and absent (e.g. the misses of a
        lookup it just made): a backend may skip looking for them (the reference map does)."""
        self.insert(ids, slots)

    @abc.abstractmethod
    def erase(self, ids: Tensor) -> Tensor:
        """Remove ids [n]; returns found [n] bool (id was present before)."""

    def insert_where(self, ids: Tensor, slots: Tensor, mask: Tensor) -> None:
        """insert() of the entries where mask [n] holds (distinct, absent ids: a fixed-shape
        step's installs). This default selects them, which reads their count back."""
        keep = torch.nonzero(mask).squeeze(1)
        if keep.numel():
            self.insert(ids.index_select(0, keep), slots.index_select(0, keep))

    def erase_where(self, ids: Tensor, mask: Tensor) -> None:
        """erase() of the entries where mask [n] holds. This default selects them (a read)."""
        keep = torch.nonzero(mask).squeeze(1)
        if keep.numel():
            self.erase(ids.index_select(0, keep))

    @abc.abstractmethod
    def items(self) -> Tuple[Tensor, Tensor]:
        """All live (ids [m], slots [m]), in no particular order."""

    def _prepare(self, t: Tensor) -> Tensor:
        """Flatten, cast to int64, move to this map's device and make dense: the kernels address
        element i at base + i, so a strided view (ids[::2]) would otherwise be read wrongly."""
        return t.reshape(-1).to(device=self.device, dtype=torch.int64).contiguous()


class TritonIdSlotMap(IdSlotMap):
    """Open-addressing (linear probing) table in two int64 device arrays, driven by Triton."""

    def __init__(
        self, capacity: int = 1024, device: torch.device | str = "cuda", max_load: float = 0.5
    ) -> None:
        if not 0.0 < max_load < 1.0:
            raise ValueError("max_load must be in (0, 1)")
        self._device = torch.device(device)
        self._max_load = max_load
        self._reset(next_pow2(max(16, int(capacity / max_load) + 1)))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity(self) -> int:
        """Number of cells (a power of two)."""
        return self._keys.numel()

    def _reset(self, cells: int) -> None:
        self._keys = torch.full((cells,), EMPTY, dtype=torch.int64, device=self._device)
        self._vals = torch.full((cells,), -1, dtype=torch.int64, device=self._device)
        self._used_bound = 0  # upper bound on non-EMPTY cells (live + tombstones)

    def __len__(self) -> int:
        return int((self._keys >= 0).sum())

    def items(self) -> Tuple[Tensor, Tensor]:
        live = self._keys >= 0
        return self._keys[live], self._vals[live]

    def lookup(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
        ids = self._prepare(ids)
        slots = torch.full_like(ids, -1)
        if ids.numel():
            grid = (cdiv(ids.numel(), _BLOCK),)
            _lookup_kernel[grid](self._keys, self._vals, ids, slots, ids.numel(),
                                 self.capacity - 1, EMPTY=EMPTY, BLOCK=_BLOCK)
        return slots, slots < 0

    def insert(self, ids: Tensor, slots: Tensor) -> Tensor:
        ids, slots = self._prepare(ids), self._prepare(slots)
        if ids.shape != slots.shape:
            raise ValueError("ids and slots must have the same length")
        new = torch.zeros_like(ids, dtype=torch.int8)
        if not ids.numel():
            return new.bool()
        self._reserve(ids.numel())
        _insert_kernel[(cdiv(ids.numel(), _BLOCK),)](
            self._keys, self._vals, ids, slots, new, new, ids.numel(), self.capacity - 1,
            EMPTY=EMPTY, NEVER=-3, HAS_MASK=False, BLOCK=_BLOCK)
        self._used_bound += ids.numel()
        return new.bool()

    def erase(self, ids: Tensor) -> Tensor:
        ids = self._prepare(ids)
        _, miss = self.lookup(ids)
        if ids.numel():
            _erase_kernel[(cdiv(ids.numel(), _BLOCK),)](
                self._keys, self._vals, ids, ids, ids.numel(), self.capacity - 1,
                EMPTY=EMPTY, TOMBSTONE=TOMBSTONE, HAS_MASK=False, BLOCK=_BLOCK)
        return ~miss

    def insert_where(self, ids: Tensor, slots: Tensor, mask: Tensor) -> None:
        """insert() of the lanes where mask holds, the others skipped inside the kernel: nothing
        is read back (the load bound counts every lane; a rebuild, when it comes, reads)."""
        ids, slots = self._prepare(ids), self._prepare(slots)
        mask = mask.reshape(-1).to(device=self.device, dtype=torch.int8).contiguous()
        if not ids.numel():
            return
        self._reserve(ids.numel())
        new = torch.zeros_like(ids, dtype=torch.int8)
        _insert_kernel[(cdiv(ids.numel(), _BLOCK),)](
            self._keys, self._vals, ids, slots, new, mask, ids.numel(), self.capacity - 1,
            EMPTY=EMPTY, NEVER=-3, HAS_MASK=True, BLOCK=_BLOCK)
        self._used_bound += ids.numel()

    def erase_where(self, ids: Tensor, mask: Tensor) -> None:
        """erase() of the lanes where mask holds, the others skipped inside the kernel (no read)."""
        ids = self._prepare(ids)
        mask = mask.reshape(-1).to(device=self.device, dtype=torch.int8).contiguous()
        if ids.numel():
            _erase_kernel[(cdiv(ids.numel(), _BLOCK),)](
                self._keys, self._vals, ids, mask, ids.numel(), self.capacity - 1,
                EMPTY=EMPTY, TOMBSTONE=TOMBSTONE, HAS_MASK=True, BLOCK=_BLOCK)

    def _reserve(self, incoming: int) -> None:
        """Rebuild before an insert of ``incoming`` ids could push the load past max_load."""
        if self._used_bound + incoming <= self._max_load * self.capacity:
            return
        self._used_bound = int((self._keys != EMPTY).sum())
        if self._used_bound + incoming <= self._max_load * self.capacity:
            return
        ids, vals = self.items()
        cells = self.capacity
        while ids.numel() + incoming > self._max_load * cells:
            cells *= 2
        self._reset(cells)
        if ids.numel():
            self.insert(ids, vals)


@jit
def _lookup_kernel(keys_ptr, vals_ptr, ids_ptr, out_ptr, n, cell_mask,
                   EMPTY: tl.constexpr, BLOCK: tl.constexpr):
    """Probe until the id or an EMPTY cell; write the value or leave -1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    ids = tl.load(ids_ptr + offs, mask=active, other=0)
    h = (ids ^ (ids >> 31)) * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    pos = (h ^ (h >> 29)) & cell_mask
    probes = 0
    while tl.sum(active.to(tl.int32)) > 0:
        key = tl.load(keys_ptr + pos, mask=active, other=EMPTY)
        hit = active & (key == ids)
        tl.store(out_ptr + offs, tl.load(vals_ptr + pos, mask=hit, other=-1), mask=hit)
        probes += 1
        active = active & ~hit & (key != EMPTY) & (probes <= cell_mask)
        pos = (pos + 1) & cell_mask


@jit
def _insert_kernel(keys_ptr, vals_ptr, ids_ptr, new_vals_ptr, new_ptr, mask_ptr, n, cell_mask,
                   EMPTY: tl.constexpr, NEVER: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Update the id's cell if present, else CAS-claim the first EMPTY cell of its probe chain
    (HAS_MASK: only the lanes whose mask_ptr byte is nonzero)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    if HAS_MASK:
        active = active & (tl.load(mask_ptr + offs, mask=active, other=0) != 0)
    ids = tl.load(ids_ptr + offs, mask=active, other=0)
    vals = tl.load(new_vals_ptr + offs, mask=active, other=-1)
    h = (ids ^ (ids >> 31)) * -7046029254386353131
    pos = (h ^ (h >> 29)) & cell_mask
    while tl.sum(active.to(tl.int32)) > 0:
        key = tl.load(keys_ptr + pos, mask=active, other=NEVER)
        claim = active & (key == EMPTY)
        # lanes that must not write compare against NEVER, a value no cell ever holds
        old = tl.atomic_cas(keys_ptr + pos, tl.where(claim, EMPTY, NEVER).to(tl.int64), ids)
        won = claim & (old == EMPTY)
        done = won | (active & (key == ids)) | (claim & (old == ids))
        tl.store(vals_ptr + pos, vals, mask=done)
        tl.store(new_ptr + offs, won.to(tl.int8), mask=won)
        active = active & ~done
        pos = (pos + 1) & cell_mask


@jit
def _erase_kernel(keys_ptr, vals_ptr, ids_ptr, mask_ptr, n, cell_mask,
                  EMPTY: tl.constexpr, TOMBSTONE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Probe until the id (turn its cell into a TOMBSTONE) or an EMPTY cell (HAS_MASK: only the
    lanes whose mask_ptr byte is nonzero)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    if HAS_MASK:
        active = active & (tl.load(mask_ptr + offs, mask=active, other=0) != 0)
    ids = tl.load(ids_ptr + offs, mask=active, other=0)
    h = (ids ^ (ids >> 31)) * -7046029254386353131
    pos = (h ^ (h >> 29)) & cell_mask
    probes = 0
    while tl.sum(active.to(tl.int32)) > 0:
        key = tl.load(keys_ptr + pos, mask=active, other=EMPTY)
        hit = active & (key == ids)
        tl.store(keys_ptr + pos, tl.full([BLOCK], TOMBSTONE, tl.int64), mask=hit)
        tl.store(vals_ptr + pos, tl.full([BLOCK], -1, tl.int64), mask=hit)
        probes += 1
        active = active & ~hit & (key != EMPTY) & (probes <= cell_mask)
        pos = (pos + 1) & cell_mask
