"""Herald's on-demand synchronisation as a remote-row protocol (the planner is
trainer/schedule/herald.py; this module moves the rows it decides to move).

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
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ...comm import Collectives
from ...device import from_host
from ..slotmap import id_slot_map
from ..store import ShardStore
from ..types import LookupPlan, Pushes
from .base import RemoteRows


class LentRows:
    """Rows lent to this worker: value, optimizer state and local update count per slot."""

    def __init__(self, capacity: int, store: ShardStore, n_ids: int) -> None:
        dev, opt = store.weight.device, store.optimizer
        self.weight = torch.zeros(capacity, store.dim, dtype=store.weight.dtype, device=dev)
        self.gid = torch.full((capacity,), -1, dtype=torch.int64, device=dev)  # the row in each slot
        self.optimizer = opt.like(self.weight, lambda slots: store.sharding.to_flat(self.gid[slots]))
        self.compute_dtype = store.compute_dtype
        self.count = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.used = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.map = id_slot_map(n_ids, capacity, dev)
        self.sw = store.state_width

    def __len__(self) -> int:
        return int(self.used.sum())

    def find(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] slots of lent rows gids (all lent here: the plan says so; checked without a read of
        the device, so on CUDA a violation fails asynchronously)."""
        if gids.numel() == 0:
            return gids.clone()
        slots, missing = self.map.lookup(gids)
        torch._assert_async(~missing.any(), "herald: rows the plan lends to this worker are not lent to it")
        return slots

    def state(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, sw] optimizer state of slots (sw = 0 for SGD)."""
        s = self.optimizer.state
        if s is None:
            return torch.zeros(slots.numel(), 0, dtype=self.compute_dtype, device=self.weight.device)
        return s.index_select(0, slots).reshape(slots.numel(), self.sw)

    def install(self, gids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Lend rows gids [k] here (the planner keeps at most `capacity` lent per worker): the
        first k free slots, found in a fixed-size pass (no count read back)."""
        k = gids.numel()
        if k > self.used.numel():
            raise RuntimeError(f"herald: {k} rows lent but the worker holds only {self.used.numel()} slots")
        free = torch.nonzero_static(~self.used, size=k, fill_value=-1).squeeze(1)
        torch._assert_async((free >= 0).all(), "herald: more rows lent than slots free")
        self.weight.index_copy_(0, free, rows.to(self.weight.dtype))
        self.gid.index_copy_(0, free, gids)
        if self.optimizer.state is not None:
            st = self.optimizer.state
            st.index_copy_(0, free, state.reshape((-1,) + tuple(st.shape[1:])).to(st.dtype))
        self.count.index_fill_(0, free, 0)
        self.used.index_fill_(0, free, True)
        self.map.insert(gids, free)

    def remove(self, gids: torch.Tensor) -> None:
        slots = self.find(gids)
        self.used.index_fill_(0, slots, False)
        self.map.erase(gids)

    def update(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """One exact optimizer step per distinct slot [k] (this worker is the row's only reader)."""
        if slots.numel():
            self.optimizer.step(slots, grads, unique=True)
            self.count.index_add_(0, slots, torch.ones_like(slots))


class HeraldRemote(RemoteRows):
    """The trainer side of Herald's plan: writebacks, pulls (+ lending), local updates, pushes."""

    def __init__(self, comm: Collectives, store: ShardStore, planner: Any) -> None:
        self.comm, self.store, self.sh, self.planner = comm, store, store.sharding, planner
        self.lent = LentRows(planner.capacity, store, int(self.sh.table_offsets[-1]))
        self.dev = store.weight.device

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
    def writeback(self, wb: list[np.ndarray]) -> None:
        """Send back the rows of `wb` (per worker) and install what this rank receives as owner."""
        if sum(x.size for x in wb) == 0:
            return
        mine = self._t(wb[self.sh.rank])
        slots = self.lent.find(mine)
        wide = self.lent.compute_dtype
        payload = torch.cat([self.lent.weight.index_select(0, slots).to(wide), self.lent.state(slots).to(wide),
                             self.lent.count.index_select(0, slots).to(wide)[:, None]], 1)
        got_ids, recv = self._to_me(wb)
        cols = {"grads": self.store.dim + self.lent.sw, "versions": 1}
        got, _ = self.comm.alltoall(payload, self._splits(wb[self.sh.rank]), kind=cols, recv_splits=recv)
        d = self.store.dim
        self.store.put(self._t(got_ids), got[:, :d], got[:, d:d + self.lent.sw], got[:, -1].round().long())
        self.lent.remove(mine)

    def _pull(self, sync: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n, d], state [n_lent, sw]) of this rank's pull list, served by the owners."""
        r = self.sh.rank
        mine = sync.pull[r]
        if sum(x.size for x in sync.pull) == 0:
            return (torch.zeros(0, self.store.dim, dtype=self.store.weight.dtype, device=self.dev),
                    self.lent.state(self._t(mine[:0])))
        serve, send = self._to_me(sync.pull)
        rows, _ = self.comm.alltoall(self.store.rows(self._t(serve)), send, kind="rows",
                                     recv_splits=self._splits(mine))
        state = self.lent.state(self._t(mine[:0]))
        if self.lent.sw and sum(int(x.sum()) for x in sync.lend):
            serve_l, send_l = self._to_me(sync.pull, sync.lend)
            st = self.store.state_rows(self._t(serve_l))
            state, _ = self.comm.alltoall(st, send_l, kind="rows",
                                          recv_splits=self._splits(mine[sync.lend[r]]))
        return rows, state

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None, token: Any = None) -> Any:
        """Returns the step's SyncPlan: its write pushes and updates what the plan says."""
        if sync is None:
            raise RuntimeError("schedule=herald: a training step needs the global SyncPlan")
        r = self.sh.rank
        local = self._t(sync.local[r])
        local_rows = self.lent.weight.index_select(0, self.lent.find(local))  # before writebacks
        self.writeback(sync.writeback)
        rows, state = self._pull(sync)
        pull = self._t(sync.pull[r])
        lend = self._t(np.flatnonzero(sync.lend[r]))  # positions from the host mask: no device read
        self.lent.install(pull.index_select(0, lend), rows.index_select(0, lend), state)
        src = torch.cat([pull, local])
        at = self._positions(src, plan.remote_ids)
        if src.numel() != plan.remote_ids.numel():
            raise RuntimeError("herald: the plan and this rank's batch disagree on its remote rows")
        ws.index_copy_(0, plan.remote_pos, torch.cat([rows, local_rows]).index_select(0, at).to(ws.dtype))
        return sync

    def write_start(self, plan: LookupPlan, grad: torch.Tensor, read: Any) -> Callable[[], Pushes]:
        sync = read
        r, remote, g = self.sh.rank, plan.remote_ids, grad[plan.remote_pos]
        own = torch.cat([self._t(sync.local[r][sync.keep[r]]), self._t(sync.pull[r][sync.lend[r]])])
        self.lent.update(self.lent.find(own), g.index_select(0, self._positions(remote, own)))
        push = self._t(sync.push[r])
        got_ids, recv = self._to_me(sync.push)
        if sum(x.size for x in sync.push) == 0:
            empty = Pushes.empty(self.store.dim, self.dev)
            return lambda: empty
        handle = self.comm.alltoall_async(g.index_select(0, self._positions(remote, push)),
                                          self._splits(sync.push[r]), kind="grads", recv_splits=recv)
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
