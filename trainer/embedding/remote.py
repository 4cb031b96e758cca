"""How a rank gets the remote rows of a training step and returns their gradients: one small
protocol object per consistency model, chosen by config (DESIGN.md: policies are objects).

- PlainRemote: no cache. Every remote row is pulled and its gradient pushed in the same step (BSP).
- HetRemote: HET's cache with per-row version clocks and bounded pull/push staleness
  (cache.py + consistency.py; bounds of 0 are BSP).
- HeraldRemote (herald.py): Herald's on-demand synchronisation, driven by the global plan.

Every protocol answers the same three calls, all collective: `read` fills the workspace rows of the
remote ids, `write` sends this step's remote row gradients and returns what this rank received as
owner (to be applied once per row with its own rows), `flush` pushes whatever is still pending.
`discard` (train.nonfinite=skip; every rank calls it instead of `write`, no communication) drops
the step: nothing is written anywhere, and a protocol with state leaves it as it was before `read`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .cache import Pushes, RowCache
from .consistency import Bounds
from .exchange import LookupPlan, RowExchange
from .sharding import RowSharding

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


class PlainRemote:
    """No cache: pull every remote row, push every row gradient, in the same step."""

    def __init__(self, exchange: RowExchange) -> None:
        self.exchange = exchange

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None) -> None:
        ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))

    def write(self, plan: LookupPlan, grad: torch.Tensor) -> Pushes:
        ids, grads = self.exchange.push(grad[plan.remote_pos])
        return Pushes(ids, grads, torch.ones_like(ids))

    def discard(self) -> None:
        """Reads changed nothing; the pulled rows' gradients are simply not pushed."""
        self.exchange.forget()

    def flush(self) -> Optional[Pushes]:
        """Nothing is ever pending (and no collective runs)."""
        return None


class HetRemote:
    """HET: remote rows come from the cache where fresh enough, the rest through RowExchange.check;
    row gradients of cached rows stay in the cache until their push is due."""

    def __init__(self, exchange: RowExchange, sharding: RowSharding, cache: RowCache, bounds: Bounds,
                 stats: CacheStats, audit: Optional[Audit]) -> None:
        self.exchange, self.sharding, self.cache, self.bounds = exchange, sharding, cache, bounds
        self.stats, self.audit = stats, audit
        self._slots: torch.Tensor | None = None
        self._evicted: Pushes | None = None
        self.undoable = False  # train.nonfinite=skip: journal each read so discard() can undo it

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None) -> None:
        """Fill ws's remote positions from the cache, checking versions with the owners."""
        cache, remote = self.cache, plan.remote_ids
        if self.undoable:
            cache.begin()
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
            torch.empty(slots.numel(), ws.shape[1], device=ws.device)
        remote_rows[transient] = rows[at[transient]]
        ws.index_copy_(0, plan.remote_pos, remote_rows)
        self.stats.reads(table, hit, need, transient)
        if self.audit is not None:
            self.audit.read(step, remote, torch.where(need, versions, cached_ver))
        self._slots = slots

    def write(self, plan: LookupPlan, grad: torch.Tensor) -> Pushes:
        """Local updates of this step: apply to cached copies, push the due, transient and
        evicted-dirty ones; returns what this rank received as owner."""
        slots, self._slots = self._slots, None
        self.cache.commit()
        remote, g = plan.remote_ids, grad[plan.remote_pos]
        cached = slots >= 0
        self.cache.record_updates(slots[cached], g[cached])
        due = self.cache.take_due(slots[cached], self.bounds.push)
        transient = Pushes(remote[~cached], g[~cached], torch.ones_like(remote[~cached]))
        evicted = self._evicted if self._evicted is not None else Pushes.empty(g.shape[1], g.device)
        self._evicted = None
        self.stats.add("evicted_dirty", self.sharding.decode(evicted.gids)[0])
        return self._send(Pushes.cat([due, transient, evicted]))

    def discard(self) -> None:
        """Undo the read: installs, evictions (their dirty updates go back into the cache),
        refreshed copies and use counts; the owners changed nothing (version checks only read)."""
        self.cache.rollback()
        self._slots, self._evicted = None, None

    def flush(self) -> Pushes:
        return self._send(self.cache.take_all())

    def _send(self, pushes: Pushes) -> Pushes:
        self.stats.pushes(self.sharding.decode(pushes.gids)[0], pushes.counts)
        return self.exchange.push_updates(pushes)

