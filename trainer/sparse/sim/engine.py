"""The cache simulator's engine: W simulated workers replaying an id trace through the trainer's own
remote-row protocol objects, without training and without communication.

Why the same objects: the HET cache's value (pulls and pushes saved, bytes, staleness) depends only
on which ids each worker reads in which step, not on the model. Every simulated worker is the
trainer's plan_lookup + PlainRemote / HetRemote (embedding/remote/), with its RowCache and the
consistency rules, connected to the owners by an in-process wire (InProcessHetWire / InProcessRowWire) instead of
alltoall: the owners are one shared version array. Rows are 1 wide and zero inside (only slots,
versions and counts matter); bytes are counted at the configured embedding_dim with the trainer's
formulas (het_wire_bytes / no_cache_wire_bytes). The trainer's cache counters for the same config and
steps equal the simulator's (tests/tools/test_simulate_cache.py runs both).

One simulated step, as one training step of every worker:
  reads (every worker, against the owner versions at the end of the previous step): the worker's
    batch ids -> plan_lookup (owned / remote in request order, replicated rows left out) ->
    protocol.read (cache lookup, version check answered by the owner rule, refresh, install,
    transient misses);
  writes (every worker): protocol.write (local updates, due / transient / evicted pushes); the
    pushes reach the owners, each adds its update count to the row's version, each owned row a
    worker used adds 1.
  after the last step: every worker flushes, counted as pushes too (the trainer flushes before its
  final eval).

Owners: "sharded" (the trainer: the run's Sharding decides) or "server" (HET's parameter-server
setting: every row lives outside the workers, so every id is remote for every worker; versions are
still per row, at the server).

This package imports only trainer/sparse/embedding (the driver with config and data sources is
trainer/tools/simulate.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, TextIO

import numpy as np
import torch

from ..embedding.cache.rows import RowCache, make_policy
from ..embedding.cache.consistency import UNBOUNDED, Bounds
from ..embedding.exchange import no_cache_wire_bytes, plan_lookup, wire_dtype
from ..embedding.remote import CacheStats, HetRemote, PlainRemote, StalenessStats, het_wire_bytes, serve_check
from ..embedding.sharding import RowSharding, Sharding
from ..embedding.types import LookupPlan, Pushes

OWNERS = ("sharded", "server")
ROW_ELEM = 4  # float32 rows on the wire


class Trace(Protocol):
    """Per-table ids each worker reads at each step."""

    table_rows: list[int]
    workers: int
    global_batch: int  # samples per step over all workers
    steps: Optional[int]  # steps available (None = endless)
    description: str

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N] per-table ids, tables [N] table of each) of `worker`'s batch `step`."""


@dataclass
class SimSpec:
    """What to simulate: tables, workers, ownership, cache policy and capacity, bounds."""

    table_rows: list[int]
    workers: int
    capacities: list[int]  # rows per table each worker may cache (0 = nothing)
    pull: list[int]  # per-table pull bound, -1 = unbounded
    push: list[int]  # per-table push bound, -1 = unbounded
    policy: str = "lru"  # none | lru | lfu | lfu_pinned
    owners: str = "sharded"
    pin_threshold: int = 8
    dim: int = 16  # embedding_dim the bytes are counted at
    hot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # replicated flat ids
    row_elem: int = ROW_ELEM  # bytes of a row element on the wire (comm.wire_precision)


class Owners:
    """Who owns a row: the run's row sharding over the workers, or a server outside them."""

    def __init__(self, rows: list[int], workers: int, mode: str,
                 hot_flat: Optional[np.ndarray] = None) -> None:
        if mode not in OWNERS:
            raise ValueError(f"owners={mode!r} is not one of {', '.join(OWNERS)}")
        self.mode, self.workers = mode, workers
        self.layout: Sharding = RowSharding(rows, workers if mode == "sharded" else 1, 0)  # fused id space
        self.shards = [self.layout.for_rank(r) for r in range(workers)] if mode == "sharded" else []
        # replicated rows (placement): read locally on every worker, never in the protocol
        self.hot = torch.zeros(self.n_ids, dtype=torch.bool)
        if hot_flat is not None and len(hot_flat):
            self.hot[torch.from_numpy(self.layout.from_flat(np.asarray(hot_flat, np.int64)))] = True
        self.any_hot = bool(self.hot.any())

    @property
    def n_ids(self) -> int:
        return self.layout.n_ids

    @property
    def wire(self) -> int:
        """Bytes of an id/version/count on the wire (int32 while an owner's rows fit)."""
        return wire_dtype(self.layout.local_rows).itemsize

    def gids(self, values: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        return self.layout.global_ids(values, tables)

    def table(self, gids: torch.Tensor) -> torch.Tensor:
        return self.layout.table_of(gids)

    def plan(self, rank: int, gids: torch.Tensor) -> LookupPlan:
        """The trainer's lookup plan of worker `rank`'s batch (replicated rows left out); with a
        server every id is remote."""
        if self.any_hot:
            gids = gids[~self.hot[gids]]
        if self.mode == "server":
            uniq, inverse = torch.unique(gids, sorted=True, return_inverse=True)
            none = uniq[:0]
            return LookupPlan(uniq, inverse, none, torch.arange(uniq.numel()), [uniq.numel()], none, none)
        return plan_lookup(self.shards[rank], gids)


@dataclass
class Audit:
    """Test record: every remote read (step, worker, gid, version read at, owner version then) and
    every update applied at an owner (step, gid, count; the flush has step = steps run)."""

    reads: list[torch.Tensor] = field(default_factory=list)
    updates: list[torch.Tensor] = field(default_factory=list)

    def read(self, step: int, worker: int, gids: torch.Tensor, read_at: torch.Tensor,
             owner: torch.Tensor) -> None:
        n = gids.numel()
        self.reads.append(torch.stack([torch.full((n,), step), torch.full((n,), worker), gids,
                                       read_at, owner], 1))

    def update(self, step: int, gids: torch.Tensor, counts: torch.Tensor) -> None:
        self.updates.append(torch.stack([torch.full_like(gids, step), gids, counts], 1))

    def result(self) -> dict[str, np.ndarray]:
        cat = lambda xs, k: torch.cat(xs).numpy() if xs else np.zeros((0, k), np.int64)  # noqa: E731
        return {"reads": cat(self.reads, 5), "updates": cat(self.updates, 3)}


class InProcessHetWire:
    """A simulated worker's HET wire (HetWire's request / serve / result / push_updates_start), answered
    at once from the simulator's owner-version array (the simulator never overlaps steps). Pushes are
    returned to the simulator, which applies them to the owners."""

    dynamic = False  # fixed tables' rows only
    announce = None  # no push sizes sent ahead: the pushes are returned at once

    def __init__(self, sim: "CacheSimulator", rank: int) -> None:
        self.sim, self.rank = sim, rank
        self.staleness = sim.staleness  # owner side, shared: the trainer sums it over ranks

    def request(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
                pull_bound: torch.Tensor, counts: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sim = self.sim
        now = sim.versions.index_select(0, remote_ids)
        table = sim.owners.table(remote_ids)
        send, gap = serve_check(cached_versions, now, pull_bound[table])
        self.staleness.record(gap, table)
        if sim.audit is not None:
            sim.audit.read(sim.steps_run, self.rank, remote_ids, torch.where(send, now, cached_versions), now)
        versions = torch.where(send, now, torch.full_like(now, -1))
        return send, versions, torch.zeros(int(send.sum()), self.sim.row_width)

    def serve(self, answered: Any) -> None:
        pass

    def cancel(self, answered: Any) -> None:
        pass

    def result(self, answered: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return answered

    def push_updates_start(self, pushes: Pushes, announced: Any = None) -> Callable[[], Pushes]:
        return lambda: pushes


class InProcessRowWire:
    """A simulated worker's no-cache wire (RowExchange's request / serve / result / push_start)."""

    def __init__(self, sim: "CacheSimulator", rank: int) -> None:
        self.sim, self.rank = sim, rank

    def request(self, remote_ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
        sim = self.sim
        table = sim.owners.table(remote_ids)
        none = torch.zeros_like(table, dtype=torch.bool)
        sim.stats.reads(table, none, ~none, none)
        if sim.audit is not None:
            now = sim.versions.index_select(0, remote_ids)
            sim.audit.read(sim.steps_run, self.rank, remote_ids, now, now)
        return remote_ids

    def serve(self, pulled: torch.Tensor) -> None:
        pass

    def result(self, pulled: torch.Tensor) -> torch.Tensor:
        return torch.zeros(pulled.numel(), self.sim.row_width)

    def push_start(self, pulled: torch.Tensor, grads: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        self.sim.stats.pushes(self.sim.owners.table(pulled), torch.ones_like(pulled))
        return lambda: (pulled, grads)


class CacheSimulator:
    """W workers over one owner-version array; step() = reads for all, then writes for all."""

    def __init__(self, spec: SimSpec, audit: bool = False, row_width: int = 1) -> None:
        self.spec = spec
        # values per cached row: 1 is all the counts need; the run's d times the bookkeeping at the
        # real row width (benchmarks/bench_cache.py)
        self.row_width = row_width
        self.owners = Owners(spec.table_rows, spec.workers, spec.owners, spec.hot)
        self.replica_rows = 0  # sum over steps of the replicated rows the step's batches touched
        self.bounds = Bounds.from_lists(spec.pull, spec.push)
        self.versions = torch.zeros(self.owners.n_ids, dtype=torch.int64)  # updates applied per row
        self.stats = CacheStats(len(spec.table_rows), torch.device("cpu"))
        self.staleness = StalenessStats(len(spec.table_rows), torch.device("cpu"))
        self.audit = Audit() if audit else None
        self.streams: list[list[np.ndarray]] = [[] for _ in range(spec.workers)]  # OPT input
        self.steps_run = 0
        self.workers = [self._protocol(r) for r in range(spec.workers)]

    def _protocol(self, rank: int) -> Any:
        if self.spec.policy == "none":
            return PlainRemote(InProcessRowWire(self, rank))
        wire = InProcessHetWire(self, rank)
        cache = RowCache(self.spec.capacities, self.row_width, make_policy(self.spec.policy, self.spec.pin_threshold),
                         self.owners.n_ids, local_lr=0.0)
        return HetRemote(wire, self.owners.layout, cache, self.bounds, self.stats)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One step; batches[w] = (values [N], tables [N]) of worker w."""
        s = self.steps_run
        all_gids = [self.owners.gids(values, tables) for values, tables in batches]
        if self.owners.any_hot:  # one allreduce of the union of touched replicated rows
            g = torch.cat(all_gids)
            self.replica_rows += int(torch.unique(g[self.owners.hot[g]]).numel())
        plans, reads = [], []
        for rank, (protocol, gids) in enumerate(zip(self.workers, all_gids)):
            plan = self.owners.plan(rank, gids)
            reads.append(protocol.read(plan, torch.zeros(plan.uniq.numel(), self.row_width), s))
            self.streams[rank].append(plan.uniq[torch.sort(plan.remote_pos).values].numpy())
            plans.append(plan)
        for protocol, plan, read in zip(self.workers, plans, reads):
            got = protocol.write(plan, torch.zeros(plan.uniq.numel(), self.row_width), read)
            owned = plan.owned_ids
            self._apply(s, torch.cat([got.gids, owned]), torch.cat([got.counts, torch.ones_like(owned)]))
        self.steps_run += 1

    def finish(self) -> None:
        """The final flush of every worker's pending updates."""
        for protocol in self.workers:
            got = protocol.flush()
            if got is not None:
                self._apply(self.steps_run, got.gids, got.counts)

    def _apply(self, step: int, gids: torch.Tensor, counts: torch.Tensor) -> None:
        self.versions.index_add_(0, gids, counts)
        if self.audit is not None and gids.numel():
            self.audit.update(step, gids, counts)

    def access_streams(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(worker [A], table [A], gid [A]) of every remote access, in OPT stream order."""
        per = [np.concatenate(s) if s else np.zeros(0, np.int64) for s in self.streams]
        gid = np.concatenate(per) if per else np.zeros(0, np.int64)
        worker = np.repeat(np.arange(len(per)), [p.size for p in per])
        table = self.owners.table(torch.from_numpy(gid)).numpy()
        return worker, table, gid

    def bytes(self) -> tuple[dict[str, int], int]:
        """(bytes by kind + total, no-cache baseline total) over all workers and steps so far."""
        t, spec = self.stats.t, self.spec
        req = int(t["requested"].sum())
        base = sum(no_cache_wire_bytes(req, spec.dim, spec.row_elem).values())
        if spec.policy == "none":  # the no-cache protocol: id requests, rows, row gradients
            nb = no_cache_wire_bytes(req, spec.dim, spec.row_elem)
            out = {"version_check": nb["ids"], "rows": nb["rows"], "pushes": nb["grads"]}
        else:
            out = het_wire_bytes(req, int(t["pulled"].sum()), int(t["pushed_rows"].sum()), spec.dim,
                                 spec.row_elem, self.owners.wire)
        out = {k: int(v) for k, v in out.items()}
        if self.owners.any_hot:  # ring allreduce of [u, d] float32: 2 (W - 1) / W * bytes per worker
            out["replica"] = int(2 * (spec.workers - 1) * self.replica_rows * spec.dim * ROW_ELEM)  # fp32
        out["total"] = sum(out.values())
        return out, base


def run_simulation(trace: Trace, spec: SimSpec, steps: int, audit: bool = False,
                   log: Optional[TextIO] = None) -> CacheSimulator:
    """Replay `steps` steps of `trace` (progress every ~10% on `log`) and flush."""
    sim = CacheSimulator(spec, audit=audit)
    every, t0 = max(1, steps // 10), time.perf_counter()
    for s in range(steps):
        sim.step([trace.batch(s, w) for w in range(spec.workers)])
        if log is not None and ((s + 1) % every == 0 or s + 1 == steps):
            print(f"simulate: step {s + 1}/{steps} ({100 * (s + 1) // steps}%) "
                  f"{time.perf_counter() - t0:.1f}s", file=log, flush=True)
    sim.finish()
    return sim


def bound_value(values: list[int]) -> Any:
    """A bound as configured (-1 = unbounded): one number when all tables agree, else the list."""
    vals = [-1 if v < 0 or v >= UNBOUNDED else int(v) for v in values]
    return vals[0] if len(set(vals)) == 1 else vals
