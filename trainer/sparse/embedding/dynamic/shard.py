"""The owner's shard of dynamic tables (embedding.kind=dynamic): rows in a pool, found by id.

A fixed table's row lives at storage row gid div W (store.ShardStore); a dynamic table's row lives
in whichever pool slot its owner gave the id when it admitted it (pool.SlotPool). DynamicStore is
the ShardStore whose every "storage row of a gid" goes through that map:

- rows(gids): the row of each admitted id, zeros (the documented default) for the others;
- admit(gids): a training step's reads reach the owner (its own rows before the step's remote
  reads are served, then every peer's request): ids are counted and admitted, new rows start from
  their initial value, a pure function of (seed, table, id) (dynamic_init_rows), with a fresh
  optimizer state and a version that carries the admission step (the id's "life", see below);
- apply(gids, grads): one update per admitted row; gradients of ids without a row are dropped and
  counted (pool counter `dropped_grads`).

Undo (train.nonfinite=skip, fp16's skipped steps): between begin() and commit() the pool journals
its bookkeeping (pool_journal.py) and the store, before admit() writes a new row, keeps the slot's
row, optimizer state, version and touched flag, so rollback() returns the shard to its state before
the step (what it keeps is bounded by the step's admissions: row + state + 9 B per admitted slot).

Versions: a row admitted at step s starts at version (s + 1) << 32 and counts its updates from
there, so any version of an id's later life is larger than every version of an earlier one (an id
evicted at step s' > s can only come back at a step after s'): a copy held anywhere under an older
version is always "behind", never "fresh".
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ....workload.data import rng
from .admission import Counting
from ..cache.consistency import LIFE_SHIFT, life_of
from ..optim import Rounding
from .pool import SlotPool
from ..sharding import HashSharding
from ..store.shard import ShardStore

_S_INIT_DYN = 78


def dynamic_init_rows(seed: int, dim: int, gids: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, dim] float32 initial rows of gids (table << 56 | id): U(-scale, scale), row (table, id)
    a pure function of (seed, table, id) (rng.uniform_rows: made every step for the new rows)."""
    u = rng.uniform_rows(seed, _S_INIT_DYN, gids.cpu().numpy(), dim)
    u *= np.float32(2.0)
    u -= np.float32(1.0)
    u *= np.float32(scale)
    return torch.from_numpy(np.ascontiguousarray(u))


class DynamicStore(ShardStore):
    """A ShardStore over a slot pool: `capacity` rows per table, any id (see the module docstring).
    admit_after, eviction, counting: the pool's (embedding.admit_after, embedding.eviction, the
    admission counter: admission.Counting); init_scale 0 or None: sqrt(1 / capacity)."""

    dynamic = True

    def __init__(self, sharding: HashSharding, dim: int, seed: int, init_scale: float | None,
                 optimizer: str, lr: float, eps: float, device: torch.device,
                 accumulator_init: float = 0.0, weight_decay: float = 0.0,
                 dtype: torch.dtype = torch.float32, rounding: Rounding | None = None,
                 admit_after: int = 1, eviction: str = "lru", lfu_half_life: int = 0, ttl_steps: int = 0,
                 counting: Counting = Counting()) -> None:
        self.pool = SlotPool(sharding.num_tables, sharding.capacity, admit_after, eviction, device, lfu_half_life,
                             ttl_steps, counting)
        super().__init__(sharding, dim, seed, init_scale, optimizer, lr, eps, device, accumulator_init,
                         weight_decay, dtype, rounding, initialise=False)  # free slots: zeros
        self.scale = init_scale if init_scale else float(np.sqrt(1.0 / sharding.capacity))
        self.clock = 0  # the training step whose reads admit() counts (set by HybridEmbedding)
        self._undo: list[tuple[torch.Tensor, ...]] | None = None  # rows admit() replaced, while undoable
        self._undo_clock = 0

    def initial_rows(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n, d] initial values of the ids now holding slots local_idx (zeros for free slots)."""
        gids = self.pool.slot_gid.index_select(0, local_idx.to(self.pool.slot_gid.device))
        out = torch.zeros(local_idx.numel(), self.dim)
        held = torch.nonzero(gids >= 0).squeeze(1).cpu()
        if held.numel():
            out[held] = dynamic_init_rows(self.seed, self.dim, gids.cpu()[held], self.scale)
        return out.to(self.weight.device, self.weight.dtype)

    def initial_values(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, d] the initial rows of gids (a new life), in the rows' type and device."""
        return dynamic_init_rows(self.seed, self.dim, gids, self.scale).to(self.weight.device, self.weight.dtype)

    def row_keys(self, local_idx: torch.Tensor) -> torch.Tensor:
        """The rounding key of a slot's row: its id's gid (the same at any W)."""
        return self.pool.slot_gid.index_select(0, local_idx)

    def bytes_per_row(self) -> dict[str, int]:
        """ShardStore's parts plus the pool's per-slot bookkeeping (map, slot id, scores)."""
        out = super().bytes_per_row()
        pool = self.pool.bytes_per_slot()
        out.update({"map": pool["map"], "slot_id": pool["slot_id"], "scores": pool["scores"]})
        out["total"] += pool["total"]
        return out

    # ---- the three calls that differ from a fixed shard ----------------------------------
    def admit(self, gids: torch.Tensor) -> None:
        """Count a training step's reads of owned gids (step `clock`) and give rows to the ids due
        (pool.SlotPool.admit); new rows start from their initial value, fresh optimizer state and
        the version of a new life."""
        got = self.pool.admit(gids, self.clock)
        if got is None:
            return
        ids, slots = got
        if self._undo is not None:
            st = self.optimizer.state
            self._undo.append((slots, self.weight.index_select(0, slots), self.version.index_select(0, slots),
                               self.touched.index_select(0, slots),
                               st.index_select(0, slots) if st is not None else None))
        self.weight.index_copy_(0, slots, self.initial_values(ids))
        st = self.optimizer.state
        if st is not None:
            st.index_fill_(0, slots, self.optimizer.init)
        self.version.index_fill_(0, slots, (self.clock + 1) << LIFE_SHIFT)
        self.touched.index_fill_(0, slots, True)

    def begin(self) -> None:
        """Make the coming admissions undoable (a training step whose skip is possible: lookup)."""
        self.pool.journal.begin()
        self._undo, self._undo_clock = [], self.clock

    def commit(self) -> None:
        """Keep the admissions made since begin() (the step's update is applied)."""
        self.pool.journal.commit()
        self._undo = None

    def rollback(self) -> None:
        """The step is skipped: every admission, eviction and count since begin() undone, the rows
        replaced by new lives back (newest first), and the clock as it was."""
        if self._undo is None:
            raise RuntimeError("DynamicStore.rollback() without begin()")
        st = self.optimizer.state
        for slots, weight, version, touched, state in reversed(self._undo):
            self.weight.index_copy_(0, slots, weight)
            self.version.index_copy_(0, slots, version)
            self.touched.index_copy_(0, slots, touched)
            if st is not None:
                st.index_copy_(0, slots, state)
        self.pool.journal.rollback()
        self._undo, self.clock = None, self._undo_clock

    def rows(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, d] rows of owned gids as stored; zeros for ids without a row (not admitted yet)."""
        slots, miss = self.pool.lookup(gids)
        if not bool(miss.any()):
            return self.weight.index_select(0, slots)
        out = self.weight.index_select(0, slots.clamp(min=0))
        return out.masked_fill_(miss.unsqueeze(1), 0)

    def apply(self, gids: torch.Tensor, grads: torch.Tensor, unique: bool = False,
              counts: torch.Tensor | None = None, lives: torch.Tensor | None = None) -> None:
        """ShardStore.apply on the admitted ids' slots; the others' gradients are dropped and
        counted once per id and step, and so are updates made in an earlier life of the id
        (lives [n]: Pushes.lives, a HET push held back past an eviction; CURRENT_LIFE: this one)."""
        if gids.numel() == 0:
            return
        slots, miss = self.pool.lookup(gids)
        if lives is not None:
            now = life_of(self.version.index_select(0, slots.clamp(min=0)))
            miss = miss | ((lives >= 0) & (lives != now))
        if bool(miss.any()):
            self.pool.count_dropped(torch.unique(gids[miss]))
            keep = ~miss
            slots, grads = slots[keep], grads[keep]
            counts = counts[keep] if counts is not None else None
        if slots.numel() == 0:
            return
        self.optimizer.step(slots, grads, unique=unique)
        self.version.index_add_(0, slots, torch.ones_like(slots) if counts is None else counts)
        self.touched.index_fill_(0, slots, True)

    def slots(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] pool slots of owned gids that hold a row (put: a copy goes back only to a row)."""
        slots, miss = self.pool.lookup(gids)
        if bool(miss.any()):
            raise RuntimeError(f"dynamic tables: {int(miss.sum())} ids written back hold no row on their owner")
        return slots

    def state_rows(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, state_width] optimizer state of owned gids; a fresh state for ids without a row."""
        slots, miss = self.pool.lookup(gids)
        s = self.optimizer.state
        if s is None:
            return torch.zeros(gids.numel(), 0, dtype=self.compute_dtype, device=self.weight.device)
        out = s.index_select(0, slots.clamp(min=0)).reshape(gids.numel(), self.state_width)
        return out.masked_fill(miss.unsqueeze(1), self.optimizer.init)

    def lives(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] the life of owned gids: the step that admitted the row + 1 (its version >> 32), 0
        for ids without a row. A copy made of a row carries its life; it may go back (put) only to
        the same life."""
        slots, miss = self.pool.lookup(gids)
        return life_of(self.version.index_select(0, slots.clamp(min=0))).masked_fill_(miss, 0)

    def last_reads(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] the last training step that read each owned gid's row (-1 for ids without a row):
        what expiry (embedding.ttl_steps) is decided by; a copy held elsewhere carries it."""
        slots, miss = self.pool.lookup(gids)
        return self.pool.last_use.index_select(0, slots.clamp(min=0)).masked_fill_(miss, -1)

    def check_versions(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The HET cache's version check of a training read reaching the owner (remote/het.py):
        admit gids first, then (versions [n], tables [n]). An id without a row answers
        ((clock + 1) << 32) - 1: above every version of its earlier lives and of its reads at
        earlier steps, below its next life's, so a copy of it is never "fresh": the requester
        always reads the default row (zeros) again, never a copy it updated locally."""
        self.admit(gids)
        slots, miss = self.pool.lookup(gids)
        now = self.version.index_select(0, slots.clamp(min=0))
        absent = torch.full_like(now, ((self.clock + 1) << LIFE_SHIFT) - 1)
        return torch.where(miss, absent, now), self.sharding.decode(gids)[0]

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gids [m], slots [m]) of every admitted id, sorted by gid."""
        slots = torch.nonzero(self.pool.slot_gid >= 0).squeeze(1)
        gids = self.pool.slot_gid[slots]
        order = torch.argsort(gids)
        return gids[order], slots[order]


def gather_tables(comm: Any, store: DynamicStore) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every admitted row of every dynamic table, from all owners: (ids [n_t] sorted, rows [n_t, d]
    as stored) per table. Collective (two allgathers)."""
    gids, slots = store.held()
    gids_all = comm.allgather(gids.cpu(), kind="meta")
    rows_all = comm.allgather(store.weight.detach().index_select(0, slots).cpu(), kind="meta")
    order = torch.argsort(gids_all)
    gids_all, rows_all = gids_all[order], rows_all[order]
    table, ids = store.sharding.decode(gids_all)
    out_ids, out_rows = [], []
    for t in range(store.sharding.num_tables):
        at = table == t
        out_ids.append(ids[at])
        out_rows.append(rows_all[at])
    return out_ids, out_rows
