"""Hot rows replicated on every worker (FAE, and the cost-model planner's replicate tier).

Why a replica instead of the owner: a hot row is read by every worker in almost every step, so
pulling it and pushing its gradient costs (W - 1) row transfers each way per step. A replicated row
is read locally; its gradient is summed over workers by one allreduce and every worker applies the
same sparse optimizer step to its own copy, so all copies (values and optimizer state) stay
identical and equal to the single-process reference: exact, like the dense parameters.

Only the hot rows touched by the step's global batch are reduced: every rank knows the global batch
(the scheduler's global view, trainer/sparse/schedule/feed.py), so the union of touched hot rows is the
same list on every rank and no mask has to travel.

The owners keep their (stale) copies of hot rows; `write_to_owner` copies the replica's values and
optimizer state back into the owner's shard before a checkpoint or a full-table gather, and
`load_from_owners` builds the replica from the owners (start and resume), so checkpoints never see
the replica at all and resume on another W or another placement just works.

Dynamic tables (embedding.kind=dynamic, docs/dynamic.md): a hot id is admitted as any id is,
by its owner, the step its admit_after-th read comes; only the reads reach it differently: every
rank knows the hot ids the global batch reads (`admit`), so each owner counts and stamps its own
and, in the steps that read hot ids not admitted yet, tells every rank which of them got a row (one
allreduce of a flag each). Until then a hot id reads zeros and its gradient is dropped (counted by
its owner), as without a replica. Its owner pins it (pool.SlotPool.pins): a replicated row is never
evicted, so the replica never holds a life its owner has ended; each replicated row keeps its life
(the admission step + 1, 8 B) and goes back to its owner only into the same life (else an error).
A skipped step (train.nonfinite=skip, fp16's overflows) undoes the lives it gave: between begin()
and commit() `admit` keeps each newly admitted row's life, value and optimizer state first, and
rollback() puts them back (with the owner's own rollback: dynamic.DynamicStore.rollback).

With embedding.ttl_steps a replicated row expires as its owner's does: every rank sees every read
of a hot id, so each keeps the step each hot row was last read (8 B) and, when a hot row read now
was unread for more than ttl steps, starts its new life (initial row, fresh optimizer state) on
every replica alike, by the owner's rule (pool.expired) and with no message; the owner, which
stamps the same reads, has just done the same.

Half-precision rows (embedding.dtype): the replica holds them in the owners' type and its optimizer
rounds them with the run's rule, keyed by the row's flat id like the owner's, so a replicated row
takes the very values the owner would have given it (and the reference's).
"""
from __future__ import annotations

import torch

from ...base.comm import Collectives
from .dynamic.pool import expired
from .store.shard import ShardStore


class Replica:
    """Rows `gids` [H] (fused global ids, sorted) on every rank: weight [H, d] + optimizer state."""

    def __init__(self, gids: torch.Tensor, store: ShardStore) -> None:
        opt = store.optimizer
        self.gids = torch.as_tensor(gids, dtype=torch.int64).to(store.device)
        if self.gids.numel() > 1 and not bool((self.gids[1:] > self.gids[:-1]).all()):
            raise ValueError("replicated ids must be sorted and distinct")
        self.sharding, self.dim = store.sharding, store.dim
        self.weight = torch.zeros(self.gids.numel(), store.dim, dtype=store.dtype,
                                  device=store.device)
        self.optimizer = opt.like(self.weight, lambda slots: self.sharding.to_flat(self.gids[slots]))
        self.dynamic = store.dynamic
        # dynamic tables: the life of each replicated row (0: not admitted yet; fixed tables: 1)
        self.life = torch.full_like(self.gids, 0 if self.dynamic else 1)
        # embedding.ttl_steps: each row's last training read, as its owner's pool stamps it
        self.ttl = store.pool.ttl if self.dynamic else 0
        self.last = torch.full_like(self.gids, -1)
        if self.dynamic:
            mine = self._owned()[1]
            store.pool.pins.append(lambda: mine)
        self._undo: list[tuple] | None = None  # rows admit() gave a life, kept as they were, while undoable
        self._undo_last: list[tuple] = []  # (slots, last reads) _expire stamped, while undoable

    def __len__(self) -> int:
        return int(self.gids.numel())

    @property
    def row_bytes(self) -> int:
        """Bytes one replicated row costs a worker: the row plus its optimizer state."""
        state = self.optimizer.state
        per_state = 0 if state is None else state[0].numel() * state.element_size()
        return self.dim * self.weight.element_size() + per_state

    def find(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] replica slot of each gid, -1 where the row is not replicated."""
        if len(self) == 0 or gids.numel() == 0:
            return torch.full_like(gids, -1)
        pos = torch.searchsorted(self.gids, gids).clamp(max=len(self) - 1)
        return torch.where(self.gids[pos] == gids, pos, torch.full_like(pos, -1))

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, slots)

    def admit(self, comm: Collectives, store: ShardStore, union: torch.Tensor) -> None:
        """Dynamic tables, at a training lookup (store.clock set), on every rank alike: the hot rows
        the global batch reads (union [u], replica slots, ascending) reach their owners' admission;
        those not admitted yet learn whether they are now (collective only in such steps) and start
        from their initial row and a fresh optimizer state, as on the owner."""
        gids = self.gids.index_select(0, union)
        store.admit(gids[self.sharding.owned_by(gids)])
        if self.ttl:
            self._expire(union, store)
        new = union[self.life.index_select(0, union) == 0]
        if not new.numel():
            return
        g = self.gids.index_select(0, new)
        mine = self.sharding.owned_by(g)
        life = torch.zeros_like(g).masked_scatter_(mine, store.lives(g[mine]))
        life = comm.allreduce(life.cpu(), op="sum", kind="meta").to(g.device)
        got = new[life > 0]
        self._save(got)
        self.life.index_copy_(0, got, life[life > 0])
        self._start_life(got, store)

    def _expire(self, union: torch.Tensor, store: ShardStore) -> None:
        """embedding.ttl_steps: the admitted rows among union [u] (read now) that were unread for
        more than ttl steps start a new life, as on their owner (module docstring)."""
        held = union[self.life.index_select(0, union) > 0]
        old = held[expired(self.last.index_select(0, held), store.clock, self.ttl)]
        if self._undo is not None:  # a skipped step leaves the last reads as they were
            self._undo_last.append((union, self.last.index_select(0, union)))
        self.last.index_fill_(0, union, store.clock)
        if old.numel():
            self._save(old)
            self.life.index_fill_(0, old, store.clock + 1)
            self._start_life(old, store)

    def _start_life(self, slots: torch.Tensor, store: ShardStore) -> None:
        """Replica slots [k] start a life of their id: its initial row, a fresh optimizer state."""
        self.weight.index_copy_(0, slots, store.initial_values(self.gids.index_select(0, slots)))
        if self.optimizer.state is not None:
            self.optimizer.state.index_fill_(0, slots, self.optimizer.init)

    def _save(self, slots: torch.Tensor) -> None:
        """Between begin() and commit(): keep the life, value and state of replica slots [k]
        before a new life of theirs starts (admission or expiry)."""
        if self._undo is not None and slots.numel():
            st = self.optimizer.state
            self._undo.append((slots, self.life.index_select(0, slots), self.weight.index_select(0, slots),
                               st.index_select(0, slots) if st is not None else None))

    def begin(self) -> None:
        """Make the coming admissions and expiries undoable (a training step whose skip is possible)."""
        self._undo, self._undo_last = [], []

    def commit(self) -> None:
        self._undo, self._undo_last = None, []

    def rollback(self) -> None:
        """The step is skipped: the rows it admitted get their life (0), value and state back."""
        if self._undo is None:
            raise RuntimeError("Replica.rollback() without begin()")
        st = self.optimizer.state
        for got, life, weight, state in reversed(self._undo):
            self.life.index_copy_(0, got, life)
            self.weight.index_copy_(0, got, weight)
            if st is not None:
                st.index_copy_(0, got, state)
        for union, last in reversed(self._undo_last):
            self.last.index_copy_(0, union, last)
        self._undo, self._undo_last = None, []

    def apply(self, slots: torch.Tensor, grads: torch.Tensor, store: ShardStore,
              mask: torch.Tensor | None = None) -> None:
        """One optimizer step on distinct slots [u] with the gradient summed over workers [u, d];
        dynamic tables: the rows not admitted drop theirs, counted by their owner (store).
        mask: a device bool, [u] or [] (the fixed-shape mode's; fixed tables): where False the row
        and its state stay exactly as they are (no size depends on it)."""
        if mask is not None:
            if slots.numel():
                self.optimizer.step(slots, grads, unique=True, mask=mask.expand(slots.numel()))
            return
        if self.dynamic and slots.numel():
            keep = self.life.index_select(0, slots) > 0
            lost = self.gids.index_select(0, slots[~keep])
            store.pool.count_dropped(lost[self.sharding.owned_by(lost)])
            slots, grads = slots[keep], grads[keep]
        if slots.numel():
            self.optimizer.step(slots, grads, unique=True)

    # ---- owners <-> replica ----------------------------------------------------------------
    def _owned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replica slots, gids) of the replicated rows this rank owns."""
        slots = torch.nonzero(self.sharding.owned_by(self.gids)).squeeze(1)
        return slots, self.gids[slots]

    def load_from_owners(self, comm: Collectives, store: ShardStore) -> None:
        """Every rank receives every replicated row (and its optimizer state) from its owner.
        Collective (one allgather of slots, one of values)."""
        slots, gids = self._owned()
        wide = store.compute_dtype  # rows (exact when half) and state in one message
        parts = torch.cat([store.rows(gids).to(wide), store.state_rows(gids).to(wide)], 1)
        state = store.optimizer.state
        got_slots = comm.allgather(slots.cpu(), kind="meta").to(self.weight.device)
        got = comm.allgather(parts.cpu(), kind="meta").to(self.weight.device)
        if got_slots.numel() != len(self):
            raise RuntimeError(f"replica: owners sent {got_slots.numel()} rows for {len(self)} replicated ids")
        if self.dynamic:  # admitted or not, in which life, and last read when (embedding.ttl_steps)
            lives = torch.stack([store.lives(gids), store.last_reads(gids)], 1)
            lives = comm.allgather(lives.cpu(), kind="meta").to(self.life.device)
            self.life.index_copy_(0, got_slots, lives[:, 0])
            self.last.index_copy_(0, got_slots, lives[:, 1])
        self.weight.index_copy_(0, got_slots, got[:, :self.dim].to(self.weight.dtype))
        if state is not None:
            mine = self.optimizer.state
            mine.index_copy_(0, got_slots, got[:, self.dim:].reshape((-1,) + tuple(mine.shape[1:])).to(mine.dtype))

    def write_to_owner(self, store: ShardStore) -> None:
        """Copy the replica's values and optimizer state of the rows this rank owns into its shard
        (no communication: every rank holds the same replica); dynamic tables: those admitted,
        each into the life it was admitted in (an error otherwise: the pin failed)."""
        slots, gids = self._owned()
        if self.dynamic:
            held = self.life.index_select(0, slots) > 0
            slots, gids = slots[held], gids[held]
            if not torch.equal(store.lives(gids), self.life.index_select(0, slots)):
                raise RuntimeError("replica: a replicated row outlived its id's life on its owner")
        state = self.optimizer.state.index_select(0, slots) if self.optimizer.state is not None else None
        store.put(gids, self.weight.index_select(0, slots), state)
