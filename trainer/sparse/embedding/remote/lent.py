"""The rows Herald lent to this worker (remote/on_demand.py moves them; this holds them).

A lent row is the one copy that is updated while lent: value, optimizer state, the updates applied
here (its owner advances the row's version by them on writeback) and, for dynamic tables, the life
it was lent in (the admission step + 1, DynamicStore.lives; 0: the id had no row at its owner, so
the copy reads zeros and drops its gradients until its owner admits the id, embedding/dynamic.py).
Per slot: the row and its state, gid 8 B, update count 8 B, life 8 B, used 1 B, plus the id map.
"""
from __future__ import annotations

import torch

from ..cache.slotmap import id_slot_map
from ..store.shard import ShardStore


class LentRows:
    """Rows lent to this worker: value, optimizer state, local update count and life per slot."""

    def __init__(self, capacity: int, store: ShardStore, n_ids: int) -> None:
        dev, opt = store.device, store.optimizer
        self.weight = torch.zeros(capacity, store.dim, dtype=store.dtype, device=dev)
        self.gid = torch.full((capacity,), -1, dtype=torch.int64, device=dev)  # the row in each slot
        self.optimizer = opt.like(self.weight, lambda slots: store.sharding.to_flat(self.gid[slots]))
        self.compute_dtype = store.compute_dtype
        self.count = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.life = torch.ones(capacity, dtype=torch.int64, device=dev)  # fixed tables: always 1
        self.used = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.map = id_slot_map(n_ids, capacity, dev)
        self.sw = store.state_width
        self.dynamic = store.dynamic

    def __len__(self) -> int:
        return int(torch.count_nonzero(self.used))

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

    def install(self, gids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                life: torch.Tensor | None = None) -> None:
        """Lend rows gids [k] here (the planner keeps at most `capacity` lent per worker): the
        first k free slots, found in a fixed-size pass (no count read back). life [k]: dynamic
        tables' lives (None: 1, a fixed table's row has one life)."""
        k = gids.numel()
        if k > self.used.numel():
            raise RuntimeError(f"herald: {k} rows lent but the worker holds only {self.used.numel()} slots")
        free = torch.nonzero_static(~self.used, size=k, fill_value=-1).squeeze(1)
        torch._assert_async((free >= 0).all(), "herald: more rows lent than slots free")
        self.gid.index_copy_(0, free, gids)
        self.set(free, rows, state, life)
        self.used.index_fill_(0, free, True)
        self.map.insert(gids, free)

    def set(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None,
            life: torch.Tensor | None = None) -> None:
        """Slots take rows [k, d], optimizer state [k, sw] (None: a fresh state), life [k] (None: 1)
        and no local update yet."""
        self.weight.index_copy_(0, slots, rows.to(self.weight.dtype))
        st = self.optimizer.state
        if st is not None:
            if state is None:
                st.index_fill_(0, slots, self.optimizer.init)
            else:
                st.index_copy_(0, slots, state.reshape((-1,) + tuple(st.shape[1:])).to(st.dtype))
        self.count.index_fill_(0, slots, 0)
        if life is None:
            self.life.index_fill_(0, slots, 1)
        else:
            self.life.index_copy_(0, slots, life)

    def remove(self, gids: torch.Tensor) -> None:
        slots = self.find(gids)
        self.used.index_fill_(0, slots, False)
        self.map.erase(gids)

    def update(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """One exact optimizer step per distinct slot [k] (this worker is the row's only reader);
        a copy of an id without a row (life 0) drops its gradient (its owner counts it)."""
        if self.dynamic:
            keep = self.life.index_select(0, slots) > 0
            slots, grads = slots[keep], grads[keep]
        if slots.numel():
            self.optimizer.step(slots, grads, unique=True)
            self.count.index_add_(0, slots, torch.ones_like(slots))
