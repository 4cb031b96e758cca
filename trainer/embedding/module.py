"""HybridEmbedding: the autograd-facing side of the model-parallel tables.

Why not an nn.Module with parameters: embedding rows are updated owner-side by sparse optimizers
(once per row per step, on the gradient summed over workers), never by the dense optimizer or the
dense allreduce. Each step the needed rows are assembled into a small workspace leaf [U, d]; the
pooled gather reads it, autograd fills its .grad, and apply_gradients() routes those row gradients
to their owners.

With a cache (cache.py + consistency.py) the remote rows of a training step come from the cache
where they are fresh enough, the rest through RowExchange.check; row gradients of cached rows stay
in the cache until their push is due. Evaluation always reads fresh rows from the owners after a
flush, so it measures the model the owners hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from ..comm import Collectives
from ..data.batch import Batch
from .cache import Pushes, RowCache
from .consistency import Bounds
from .exchange import LookupPlan, RowExchange, plan_lookup
from .sharding import RowSharding
from .store import ShardStore


@dataclass
class LookupStats:
    """Counts of the last training step (per rank)."""

    ids: int = 0
    unique: int = 0
    remote: int = 0
    totals: dict[str, int] = field(default_factory=lambda: {"ids": 0, "unique": 0, "remote": 0})

    def record(self, ids: int, unique: int, remote: int) -> None:
        self.ids, self.unique, self.remote = ids, unique, remote
        for k, v in (("ids", ids), ("unique", unique), ("remote", remote)):
            self.totals[k] += v


CACHE_COUNTERS = ("requested", "hits", "fresh_hits", "pulled", "transient", "pushed_rows",
                  "pushed_updates", "evicted_dirty")


class CacheStats:
    """Per-table counters of this rank's cache traffic ([T] int64 each)."""

    def __init__(self, num_tables: int, device: torch.device) -> None:
        self.t = {k: torch.zeros(num_tables, dtype=torch.int64, device=device) for k in CACHE_COUNTERS}
        self.num_tables = num_tables

    def add(self, key: str, tables: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        self.t[key] += torch.bincount(tables, weights=weights, minlength=self.num_tables).to(torch.int64)

    def reads(self, table: torch.Tensor, hit: torch.Tensor, need: torch.Tensor,
              transient: torch.Tensor) -> None:
        """One step's remote reads ([Ur] each): table, cache hit, row pulled, transient."""
        self.add("requested", table)
        self.add("hits", table[hit])
        self.add("fresh_hits", table[hit & ~need])
        self.add("pulled", table[need])
        self.add("transient", table[transient])

    def pushes(self, table: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows pushed ([n] table of each) and the updates they carry ([n] counts)."""
        self.add("pushed_rows", table)
        self.add("pushed_updates", table, counts.double())

    def vector(self) -> torch.Tensor:
        """[len(CACHE_COUNTERS) * T] float64, for one allreduce over ranks."""
        return torch.cat([self.t[k] for k in CACHE_COUNTERS]).double().cpu()


class Audit:
    """Test-only record (embedding.audit=true): every cached-path remote read (step, gid, version
    read at), every owner version change (step, gid, version after), the sum of row gradients."""

    def __init__(self, n_ids: int, dim: int) -> None:
        self.reads: list[torch.Tensor] = []
        self.updates: list[torch.Tensor] = []
        self.grads = torch.zeros(n_ids, dim, dtype=torch.float64)

    def read(self, step: int, gids: torch.Tensor, versions: torch.Tensor) -> None:
        self.reads.append(torch.stack([torch.full_like(gids, step), gids, versions], 1).cpu())

    def update(self, step: int, gids: torch.Tensor, versions: torch.Tensor) -> None:
        self.updates.append(torch.stack([torch.full_like(gids, step), gids, versions], 1).cpu())

    def result(self) -> dict[str, torch.Tensor]:
        empty = torch.zeros(0, 3, dtype=torch.int64)
        return {"reads": torch.cat(self.reads) if self.reads else empty,
                "updates": torch.cat(self.updates) if self.updates else empty, "grads": self.grads}


class HybridEmbedding:
    """Pooled lookups [B, T, d] over row-sharded tables, with owner-side sparse updates."""

    def __init__(self, comm: Collectives, sharding: RowSharding, store: ShardStore,
                 pooling: str, cache: RowCache | None = None, bounds: Bounds | None = None,
                 audit: bool = False) -> None:
        self.comm, self.sharding, self.store, self.pooling = comm, sharding, store, pooling
        self.exchange = RowExchange(comm, store)
        self.stats = LookupStats()
        self.cache, self.bounds = cache, bounds
        if cache is not None and bounds is None:
            raise ValueError("a cache needs consistency bounds")
        dev = store.weight.device
        self.cache_stats = CacheStats(sharding.num_tables, dev)
        self.audit = Audit(int(sharding.table_offsets[-1]), store.dim) if audit else None
        self.step = -1  # index of the current training step
        self._pending: tuple[LookupPlan, torch.Tensor, torch.Tensor | None] | None = None
        self._evicted: Pushes | None = None

    @property
    def dim(self) -> int:
        return self.store.dim

    def lookup(self, batch: Batch, train: bool = True) -> torch.Tensor:
        """[B, T, d] pooled embeddings of the batch. Collective: every rank must call it."""
        gids = self.sharding.global_ids(batch.values, batch.table_index())
        plan = plan_lookup(self.sharding, gids)
        ws = torch.empty(plan.uniq.numel(), self.dim, dtype=self.store.weight.dtype,
                         device=self.store.weight.device)
        ws.index_copy_(0, plan.owned_pos, self.store.rows(plan.owned_ids))
        slots = None
        if train:
            self.step += 1
        if train and self.cache is not None:
            slots = self._remote_rows_cached(plan, ws)
        else:
            ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))
        if train:
            ws.requires_grad_(True)
            self._pending = (plan, ws, slots)
            self.stats.record(gids.numel(), plan.uniq.numel(), plan.remote_pos.numel())
        return kernels.pooled_gather(ws, plan.inverse, batch.offsets(), batch.num_tables,
                                     mode=self.pooling)

    def _remote_rows_cached(self, plan: LookupPlan, ws: torch.Tensor) -> torch.Tensor:
        """Fill ws's remote positions from the cache, checking versions with the owners.
        Returns the cache slot of every remote id ([Ur], -1 = transient)."""
        cache, remote, step = self.cache, plan.remote_ids, self.step
        table = self.sharding.decode(remote)[0]
        slots = cache.lookup(remote)
        hit = slots >= 0
        cache.touch(slots[hit], step)
        cached_ver = cache.versions_of(slots)
        need, versions, rows = self.exchange.check(remote, cached_ver, plan.splits, self.bounds.pull)
        at = torch.cumsum(need.long(), 0) - 1  # row index of each needed id in `rows`
        stale = hit & need
        cache.refresh(slots[stale], rows[at[stale]], versions[stale])
        miss = ~hit
        new_slots, self._evicted = cache.install(remote[miss], table[miss], rows[at[miss]],
                                                 versions[miss], step)
        slots[miss] = new_slots
        transient = slots < 0
        remote_rows = cache.rows.index_select(0, slots.clamp(min=0)) if cache.size else \
            torch.empty(slots.numel(), self.dim, device=ws.device)
        remote_rows[transient] = rows[at[transient]]
        ws.index_copy_(0, plan.remote_pos, remote_rows)
        self.cache_stats.reads(table, hit, need, transient)
        if self.audit is not None:
            read_ver = torch.where(need, versions, cached_ver)
            self.audit.read(step, remote, read_ver)
        return slots

    def apply_gradients(self) -> None:
        """Push remote row gradients to owners; owners update every touched row once. Collective."""
        if self._pending is None:
            raise RuntimeError("apply_gradients() called without a training lookup")
        plan, ws, slots = self._pending
        self._pending = None
        grad = ws.grad if ws.grad is not None else torch.zeros_like(ws)
        if self.audit is not None:
            self.audit.grads.index_add_(0, plan.uniq.cpu(), grad.detach().double().cpu())
        owned = Pushes(plan.owned_ids, grad[plan.owned_pos], torch.ones_like(plan.owned_ids))
        if slots is None:
            recv_ids, recv_grads = self.exchange.push(grad[plan.remote_pos])
            self._apply(owned, Pushes(recv_ids, recv_grads, torch.ones_like(recv_ids)))
            return
        self._apply(owned, self.exchange.push_updates(self._cached_pushes(plan, grad, slots)))

    def _cached_pushes(self, plan: LookupPlan, grad: torch.Tensor, slots: torch.Tensor) -> Pushes:
        """Local updates of this step: apply to cached copies, collect the due, transient and
        evicted-dirty pushes."""
        remote, g = plan.remote_ids, grad[plan.remote_pos]
        cached = slots >= 0
        self.cache.record_updates(slots[cached], g[cached])
        due = self.cache.take_due(slots[cached], self.bounds.push)
        transient = Pushes(remote[~cached], g[~cached], torch.ones_like(remote[~cached]))
        evicted = self._evicted if self._evicted is not None else Pushes.empty(self.dim, g.device)
        self._evicted = None
        st = self.cache_stats
        st.add("evicted_dirty", self.sharding.decode(evicted.gids)[0])
        pushes = Pushes.cat([due, transient, evicted])
        st.pushes(self.sharding.decode(pushes.gids)[0], pushes.counts)
        return pushes

    def _apply(self, owned: Pushes, received: Pushes) -> None:
        """Owner update: own rows plus what peers pushed, once per row, versions advanced."""
        both = Pushes.cat([owned, received])
        self.store.apply(both.gids, both.grads, unique=len(received) == 0, counts=both.counts)
        if self.audit is not None and len(both):
            g = torch.unique(both.gids)
            self.audit.update(self.step, g, self.store.versions(self.sharding.local_index(g)))

    def flush(self) -> int:
        """Push every pending local update to its owner (before eval, checkpoint, exit).
        Collective when a cache is on; returns the number of rows this rank pushed."""
        if self.cache is None:
            return 0
        pushes = self.cache.take_all()
        self.cache_stats.pushes(self.sharding.decode(pushes.gids)[0], pushes.counts)
        empty = Pushes.empty(self.dim, self.store.weight.device)
        self._apply(empty, self.exchange.push_updates(pushes))
        return len(pushes)

    def full_tables(self) -> list[torch.Tensor]:
        """Every table, whole ([rows_t, d] each), assembled from all shards. Collective."""
        shards = self.comm.allgather(self.store.weight.detach().cpu(), kind="meta")
        w, r = self.sharding.world, self.sharding.local_rows
        by_gid = shards.view(w, r, self.dim).transpose(0, 1).reshape(w * r, self.dim)
        offs = self.sharding.table_offsets
        return [by_gid[int(offs[t]): int(offs[t]) + n].clone()
                for t, n in enumerate(self.sharding.table_rows)]
