"""Herald's on-demand synchronisation as a remote-row protocol (the planner is
trainer/sparse/schedule/herald.py; this module moves the rows it decides to move).

Why no ids on the wire: every rank computes the same SyncPlan from the global batch, so an owner
knows which rows each worker pulls, which gradients and writebacks reach it and in which order
(owner order, then ascending gid). Only values travel: rows (+ optimizer state for a lent row),
gradients, and writebacks (row, state, update count).

A worker keeps the rows lent to it in LentRows, with their optimizer state, and applies the real
sparse optimizer to them (kernels.row_update), so its copy is exactly the row the single-process
reference holds; the owner takes value and state back on writeback and advances the row's version
by the updates it carried. Half-precision rows stay in the owners' type here too, rounded by the
run's rule keyed by the row's flat id (so exactly as their owner would); writebacks travel as
float32 (row, state and update count in one message: a count in a half type would round).

Dynamic tables (embedding.kind=dynamic, docs/dynamic.md): every id read in a step reaches its
owner's admission (the owner knows them all from the plan: `_admit`), so admit_after counts and
dropped gradients are those of one process. A lent row is pinned by its owner (pool.SlotPool.pins)
until it is back: it is never evicted while lent. A lent copy carries its life (the admission
step + 1; 0 when the id had no row): a copy without a row reads zeros and drops its gradients
(counted by the owner), and is refreshed from its owner in every step it is read (owner and holder
both know which: the owner keeps the ids it lent without a row, 8 B each), so it takes its
initial row the step its owner admits it. A writeback goes back only into the life it was lent in;
one from another life is dropped and counted (pool `stale_copies`; 0 while the pin holds).
Expiry (embedding.ttl_steps) is no eviction: a lent id expires when read after more than ttl steps
unread, as in one process. The plan names such ids (SyncPlan.expired: the planner knows each lent
row's last use, which is its id's, since its holder alone read it): the owner starts the id's new
life when the step's reads reach it, a copy written back now goes back to nothing (not counted as
stale), and the holder's reads of its copy this step are refreshed from the owner as above.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ....base.comm import Collectives
from ....base.core.device import from_host
from ..store.shard import ShardStore
from ..types import LookupPlan, Pushes
from .base import RemoteRows
from .lent import LentRows


class HeraldRemote(RemoteRows):
    """The trainer side of Herald's plan: writebacks, pulls (+ lending), local updates, pushes."""

    def __init__(self, comm: Collectives, store: ShardStore, planner: Any) -> None:
        self.comm, self.store, self.sh, self.planner = comm, store, store.sharding, planner
        self.lent = LentRows(planner.capacity, store, int(self.sh.table_offsets[-1]))
        self.dev = store.device
        self.dynamic = store.dynamic
        self.absent_out = np.zeros(0, np.int64)  # dynamic: my ids lent without a row (sorted)
        if self.dynamic:
            store.pool.pins.append(self._lent_out)

    def _lent_out(self) -> torch.Tensor:
        """This owner's ids lent out now or coming back this step (pinned: never evicted)."""
        out = np.concatenate(self.planner.held + [self.planner.returning])
        return torch.from_numpy(out[self.sh.owned_by(out)])

    # ---- helpers ---------------------------------------------------------------------------
    def _t(self, x: np.ndarray) -> torch.Tensor:
        """A host array of the plan on the device (pinned, asynchronous: the host does not wait)."""
        return from_host(x, self.dev)

    def _to_me(self, per_worker: list[np.ndarray], mask: Optional[list[np.ndarray]] = None
               ) -> tuple[np.ndarray, list[int]]:
        """The gids every worker sends to this rank as owner (concatenated in rank order) + splits."""
        parts = [x[self.sh.owned_by(x) & (mask[k] if mask is not None else True)]
                 for k, x in enumerate(per_worker)]
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), [p.size for p in parts]

    def _splits(self, gids: np.ndarray) -> list[int]:
        return self.sh.per_owner(gids)

    @staticmethod
    def _index(ids: np.ndarray, want: np.ndarray) -> np.ndarray:
        """[k] positions in ids [n] (distinct) of want [k] (all present), on the host."""
        order = np.argsort(ids, kind="stable")
        return order[np.searchsorted(ids[order], want)] if want.size else want.astype(np.int64)

    @staticmethod
    def _positions(ids: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """[k] positions in ids [n] (distinct) of want [k] (all present)."""
        if want.numel() == 0:
            return want.clone()
        if ids.numel() == 0:
            raise RuntimeError("herald: the plan and this rank's batch disagree on its remote rows")
        order = torch.argsort(ids)
        pos = order[torch.searchsorted(ids[order], want).clamp(max=ids.numel() - 1)]
        torch._assert_async((ids[pos] == want).all(),
                            "herald: the plan and this rank's batch disagree on its remote rows")
        return pos

    # ---- the protocol ----------------------------------------------------------------------
    def writeback(self, wb: list[np.ndarray], ended: Optional[np.ndarray] = None) -> None:
        """Send back the rows of `wb` (per worker) and install what this rank receives as owner;
        ended: ids whose life ends by expiry this step (SyncPlan.expired), their copies dropped."""
        if sum(x.size for x in wb) == 0:
            return
        mine = self._t(wb[self.sh.rank])
        slots = self.lent.find(mine)
        wide = self.lent.compute_dtype
        payload = torch.cat([self.lent.weight.index_select(0, slots).to(wide), self.lent.state(slots).to(wide),
                             self.lent.count.index_select(0, slots).to(wide)[:, None]], 1)
        got_ids, recv = self._to_me(wb)
        cols = {"grads": self.store.dim + self.lent.sw, "versions": 1}
        splits = self._splits(wb[self.sh.rank])
        got, _ = self.comm.alltoall(payload, splits, kind=cols, recv_splits=recv)
        ids = self._t(got_ids)
        if self.dynamic:  # each copy goes back only into the life it was lent in
            life, _ = self.comm.alltoall(self.lent.life.index_select(0, slots), splits, kind="versions",
                                         recv_splits=recv)
            now = self.store.lives(ids)
            if ended is not None and ended.size:
                life = life.masked_fill(from_host(np.isin(got_ids, ended), self.dev, torch.bool), 0)
            self.store.pool.stale_copies += int(((life > 0) & (life != now)).sum())
            ok = (life > 0) & (life == now)  # (life 0: a copy of no row or of an ended life: nothing to write)
            ids, got = ids[ok], got[ok]
            self.absent_out = np.setdiff1d(self.absent_out, got_ids)
        d = self.store.dim
        self.store.put(ids, got[:, :d], got[:, d:d + self.lent.sw], got[:, -1].round().long())
        self.lent.remove(mine)

    def _pull(self, sync: Any, want: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(rows [n, d], state [n_lent, sw], lives [n] or None) of this rank's list in `want` (per
        worker, in owner order: sync.pull, plus refreshed copies with dynamic tables), served by
        the owners; lives: dynamic tables' (DynamicStore.lives)."""
        r = self.sh.rank
        mine = want[r]
        if sum(x.size for x in sync.pull + (sync.local if self.dynamic else [])) == 0:  # known to all
            return (torch.zeros(0, self.store.dim, dtype=self.store.dtype, device=self.dev),
                    self.lent.state(self._t(mine[:0])), self._t(mine[:0]) if self.dynamic else None)
        serve, send = self._to_me(want)
        rows, _ = self.comm.alltoall(self.store.rows(self._t(serve)), send, kind="rows",
                                     recv_splits=self._splits(mine))
        lives = None
        if self.dynamic:
            lives, _ = self.comm.alltoall(self.store.lives(self._t(serve)), send, kind="versions",
                                          recv_splits=self._splits(mine))
            self._note_absent(sync, want, serve)
        state = self.lent.state(self._t(mine[:0]))
        if self.lent.sw and sum(int(x.sum()) for x in sync.lend):
            serve_l, send_l = self._to_me(sync.pull, sync.lend)
            st = self.store.state_rows(self._t(serve_l))
            state, _ = self.comm.alltoall(st, send_l, kind="rows",
                                          recv_splits=self._splits(sync.pull[r][sync.lend[r]]))
        return rows, state, lives

    # ---- dynamic tables (module docstring) -------------------------------------------------
    def _refresh(self, sync: Any, local_slots: torch.Tensor) -> list[np.ndarray]:
        """Per worker, the copies lent without a row that it reads now (before any writeback):
        this rank's own from its copies' lives (local_slots: of sync.local[rank]), the others'
        among the ids this owner lent so; and the copies whose id expires now (sync.expired)."""
        r = self.sh.rank
        out = []
        for k, local in enumerate(sync.local):
            ended = np.isin(local, sync.expired)  # and copies whose id's life ends now (expiry)
            if k == r:
                out.append(local[(self.lent.life.index_select(0, local_slots).cpu().numpy() == 0) | ended])
            else:
                out.append(local[np.isin(local, self.absent_out) | ended])
        return out

    def _admit(self, sync: Any) -> None:
        """Every id of this owner that another worker reads this step reaches its admission (the
        owner's own reads were admitted by the module); the exclusive reads (lent or kept) of ids
        still without a row then lose their gradient at the holder: counted here, once."""
        mine = [x[self.sh.owned_by(x)] for x in sync.pull + sync.local]
        ids = np.unique(np.concatenate(mine))
        self.store.admit(self._t(ids))
        excl = np.concatenate([np.concatenate([p[lend], loc[keep]]) for p, lend, loc, keep in
                               zip(sync.pull, sync.lend, sync.local, sync.keep)])
        excl = self._t(excl[self.sh.owned_by(excl)])
        self.store.pool.count_dropped(excl[self.store.lives(excl) == 0])

    def _note_absent(self, sync: Any, want: list[np.ndarray], serve: np.ndarray) -> None:
        """The owner's record of the ids it lent without a row: this step's lends of such ids join
        it, refreshed copies that got a row leave it."""
        lives = self.store.lives(self._t(serve)).cpu().numpy()
        lent = np.concatenate([p[lend] for p, lend in zip(sync.pull, sync.lend)])
        absent, present = serve[lives == 0], serve[lives > 0]
        self.absent_out = np.union1d(np.setdiff1d(self.absent_out, present), absent[np.isin(absent, lent)])

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None, token: Any = None) -> Any:
        """Returns the step's SyncPlan: its write pushes and updates what the plan says."""
        src, rows = self.fetch(sync)
        if src.numel() != plan.remote_ids.numel():
            raise RuntimeError("herald: the plan and this rank's batch disagree on its remote rows")
        at = self._positions(src, plan.remote_ids)
        ws.index_copy_(0, plan.remote_pos, rows.index_select(0, at).to(ws.dtype))
        return sync

    def fetch(self, sync: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(gids [n], rows [n, d] as stored): the remote rows this rank reads in the step of
        `sync` (its SyncPlan), once every writeback, pull and lend of the step is done: the
        pulled rows, then its own copies (sync.pull[rank], then sync.local[rank]). Both modes'
        read: the exact-size one places them by its plan, the fixed-shape one (fixed/shapes.py)
        into its request's slots. Collective."""
        if sync is None:
            raise RuntimeError("schedule=herald: a training step needs the global SyncPlan")
        r = self.sh.rank
        local = self._t(sync.local[r])
        local_slots = self.lent.find(local)
        local_rows = self.lent.weight.index_select(0, local_slots)  # before writebacks
        want = sync.pull
        if self.dynamic:  # copies lent without a row are read from their owner again
            refresh = self._refresh(sync, local_slots)
            want = [self.sh.owner_order(np.concatenate([p, f])) for p, f in zip(sync.pull, refresh)]
        self.writeback(sync.writeback, sync.expired)
        if self.dynamic:
            self._admit(sync)
        rows, state, lives = self._pull(sync, want)
        pull = self._t(sync.pull[r])
        lend = self._t(np.flatnonzero(sync.lend[r]))  # positions from the host mask: no device read
        if self.dynamic:
            got, fresh = rows, refresh[r]
            at = self._t(self._index(want[r], sync.pull[r]))
            rows, pull_lives = got.index_select(0, at), lives.index_select(0, at)
            self.lent.install(pull.index_select(0, lend), rows.index_select(0, lend), state,
                              pull_lives.index_select(0, lend))
            if fresh.size:
                self._take_fresh(sync, got, lives, want[r], fresh, local_rows)
        else:
            self.lent.install(pull.index_select(0, lend), rows.index_select(0, lend), state)
        return torch.cat([pull, local]), torch.cat([rows, local_rows])

    def _take_fresh(self, sync: Any, got: torch.Tensor, lives: torch.Tensor, want: np.ndarray,
                    fresh: np.ndarray, local_rows: torch.Tensor) -> None:
        """This step's reads of this rank's refreshed copies take the owners' answers (zeros, or
        the initial row of an id admitted or expired now); kept copies take the new life with a
        fresh optimizer state."""
        r = self.sh.rank
        at = self._t(self._index(want, fresh))
        rows = got.index_select(0, at).to(local_rows.dtype)
        local_rows.index_copy_(0, self._t(self._index(sync.local[r], fresh)), rows)
        kept = np.isin(fresh, sync.local[r][sync.keep[r]])
        if kept.any():
            k = self._t(np.flatnonzero(kept))
            self.lent.set(self.lent.find(self._t(fresh[kept])), got.index_select(0, at.index_select(0, k)), None,
                          lives.index_select(0, at.index_select(0, k)))

    def write_start(self, plan: LookupPlan, grad: torch.Tensor, read: Any) -> Callable[[], Pushes]:
        remote, g = plan.remote_ids, grad[plan.remote_pos]
        return self.send(read, lambda gids: g.index_select(0, self._positions(remote, gids)))

    def send(self, sync: Any, grads_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Pushes]:
        """write_start given the step's SyncPlan and the row gradients of any of its remote gids
        (grads_of(gids [k]) -> [k, d]; both modes' write: the exact-size one finds them by its
        plan, the fixed-shape one in its request's slots): the lent rows this rank holds take
        their local update, the pushes leave; the function returned waits for what this rank
        receives as owner. Collective."""
        r = self.sh.rank
        own = torch.cat([self._t(sync.local[r][sync.keep[r]]), self._t(sync.pull[r][sync.lend[r]])])
        self.lent.update(self.lent.find(own), grads_of(own))
        push = self._t(sync.push[r])
        got_ids, recv = self._to_me(sync.push)
        if sum(x.size for x in sync.push) == 0:
            empty = Pushes.empty(self.store.dim, self.dev)
            return lambda: empty
        handle = self.comm.alltoall_async(grads_of(push), self._splits(sync.push[r]), kind="grads",
                                          recv_splits=recv)
        ids = self._t(got_ids)
        return lambda: Pushes.single(ids, handle.wait()[0])

    def discard(self, read: Any) -> None:
        """A skipped step: no local update, no push. Exact without an undo: this step's
        writebacks and pulls only moved values (and optimizer state) between owners and holders,
        where the plan expects them; a lent row keeps its value and an update count of 0."""

    def flush(self) -> Pushes:
        """Every lent row goes back to its owner (collective; the plan is the same everywhere)."""
        self.writeback(self.planner.flush())
        return Pushes.empty(self.store.dim, self.dev)
