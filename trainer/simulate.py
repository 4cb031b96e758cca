"""Cache simulator: replay an id trace through the trainer's own cache and consistency code for W
simulated workers, without training, and compare the policy with Belady's optimal offline policy.

Why a simulator: the HET cache's value (pulls and pushes saved, bytes, staleness) depends only on
which ids each worker reads in which step, not on the model. Replaying a trace through the SAME
objects the trainer uses (embedding/cache.py RowCache, consistency.py needs_row / Bounds,
exchange.py plan_lookup and the byte formulas het_wire_bytes / no_cache_wire_bytes) answers "what
would policy P, capacity C and bounds (s_pull, s_push) cost at W workers" without training, for W
up to 64 on one machine. The trainer's cache counters for the same config and steps are equal to the
simulator's (tests/test_simulate_cache.py checks this against a real 2-process run).

Pieces (later placements and schedules plug in here): a trace source (ConfigTrace: synthetic
presets / a prepared Criteo dir through the data pipeline; ArrayTrace: an id file), Owners (who
owns a row, which ids a worker must fetch), one worker object per simulated worker (CachedWorker /
UncachedWorker), CacheSimulator (one step of all W workers, the owner versions), and belady_hits
(OPT).

One simulated step, mirroring HybridEmbedding (module.py) step for step:
  phase 1, reads (every worker, against the owner versions at the end of the previous step):
    dedup the worker's batch ids (fused global ids), split owned / remote (remote ids in the
    trainer's request order: grouped by owner rank, ascending within a group); look the remote ids
    up in the cache (a hit = the cache holds a slot), touch the hits, send (id, cached version or
    -1); the owner rule needs_row(cached, owner, pull_bound) decides which rows are pulled; the
    read staleness of each id (owner - cached where not pulled, 0 where pulled) is recorded; stale
    hits are refreshed, misses installed (dirty entries evicted on the way are pushed this step),
    misses that find no slot are transient (used once, their update pushed at once).
  phase 2, writes: one local update per cached remote row (RowCache.record_updates; the value does
    not matter, rows are 1 wide inside, bytes are counted at the configured embedding_dim), the due
    ones (count > push_bound) are taken, plus transient and evicted-dirty pushes; each pushed row
    adds its update count to the owner version, each owned row a worker used adds 1.
  after the last step: every worker flushes (take_all), counted as pushes too (the trainer flushes
  before its final eval). cache.policy=none is the trainer's no-cache protocol: every remote id is
  pulled and pushed every step; its bytes are also the baseline of every run (no_cache_*).

Owners: --owners sharded (our trainer: fused global id g is owned by worker g mod W); --owners
server (HET's parameter-server setting: every row lives on a server outside the workers, so every
id is remote for every worker and nothing is owned; versions are still per row, at the server);
--owners auto (the CLI default): sharded when W > 1, server when W = 1 (where sharded would make
every row local and leave nothing to cache).

Trace sources: (1) a Hydra config (synthetic presets, data=criteo data.dir=DIR with the memmap
reader): worker w's batch of step s is exactly rank w's batch of a W-worker training run. (2) an
id file: .npz with `ids` int [S, B, T] (S steps, B global samples per step, T single-hot tables) and
optional `table_rows` [T]; or text (.txt/.csv): one sample per line, T integer ids separated by
commas and/or whitespace (blank lines and lines starting with # are skipped), grouped into steps of
B samples (a last partial step is dropped). Table sizes: table_rows if given, else max id + 1.
Sample j of a step goes to worker j * W // B (contiguous equal slices; B must divide by W).

OPT (opt_hit_rate), precisely: for every (worker w, table t) separately, the access stream is w's
remote ids of table t, deduplicated within each step, steps in order, ids ascending within a step
(the same accesses the policy's hit_rate counts: a hit there = cache.lookup found a slot). The cache
holds capacity_t = the simulated cache's capacity of table t (rows). Belady's MIN on that stream:
an access is a hit iff its id is in the cache; on a miss the id is inserted, and if the cache was
full, first the cached id whose next use in the stream is farthest (never used again = infinity)
is evicted (no bypass: every accessed id is inserted; with capacity 0 nothing is ever a hit).
opt_hit_rate = sum of OPT hits / sum of accesses over all (w, t) streams; hit_rate_vs_opt =
hit_rate / opt_hit_rate (null when opt_hit_rate is 0). Because the real cache may leave a miss
uncached (transient, when the table's region holds only rows of the current step), it can
occasionally beat this textbook OPT: hit_rate_vs_opt may exceed 1. `opt_bypass=True` (CLI
--opt-bypass) also reports opt_bypass_hit_rate: MIN where the incoming id competes too (it is not
inserted when its own next use is the farthest), an upper bound of every policy incl. transients.

Output (one JSON line, summed over workers, flush included): requested (remote accesses, = the OPT
accesses), hits, hit_rate = hits / requested, fresh_hits (hits not re-pulled), pulled, pushed_rows,
pushed_updates (= requested: every remote read makes one update that reaches its owner once),
evicted_dirty, transient, max_staleness and staleness_hist (read staleness, the trainer's format),
bytes {version_check, rows, pushes, total} by exchange.het_wire_bytes (for cache.policy=none:
exchange.no_cache_wire_bytes, its id requests in the version_check slot), bytes_per_sample (per
global sample), no_cache_bytes_per_sample (the no-cache protocol on the same reads), bytes_reduction
= 1 - bytes / no-cache bytes; pull_bound / push_bound as configured (-1 = unbounded; a list when
per-table overrides differ); capacity_rows per worker; per_table with --per-table.
"""
from __future__ import annotations

import copy
import heapq
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, TextIO

import numpy as np
import torch

from .config import (Config, cache_capacities, local_batch_size, needs_global_view, staleness_bounds,
                     table_rows)
from .configure import compose_config
from .embedding.cache import Pushes, RowCache, make_policy
from .embedding.consistency import HIST_BINS, UNBOUNDED, Bounds, needs_row, staleness_histogram
from .embedding.exchange import het_wire_bytes, no_cache_wire_bytes, plan_lookup, wire_dtype
from .embedding.module import CacheStats
from .embedding.sharding import RowSharding

OWNERS = ("sharded", "server")
ROW_ELEM = 4  # float32 rows on the wire


class TraceError(ValueError):
    """A trace file or trace option is malformed; the message names the file and position."""


# ============================================================================ trace sources
class Trace(Protocol):
    """Per-table ids each worker reads at each step."""

    table_rows: list[int]
    workers: int
    global_batch: int  # samples per step over all workers
    steps: Optional[int]  # steps available (None = endless)
    description: str

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N] per-table ids, tables [N] table of each) of `worker`'s batch `step`."""


class ConfigTrace:
    """The training data of a config: worker w's batch of step s is rank w's train_batch(s)."""

    def __init__(self, cfg: Config, workers: int) -> None:
        self.workers, self.table_rows = workers, table_rows(cfg)
        b = local_batch_size(cfg, workers)
        self.global_batch = b * workers
        self.description = f"data={cfg.data.preset}"
        self._data = self._sources(cfg, b)
        self.steps = None  # sources loop over epochs; criteo/movielens set train.steps (data.epochs)

    def _sources(self, cfg: Config, b: int) -> list[Any]:
        """One data source per worker. Synthetic: one generator, shallow copies differing only in
        rank (the planted-weight table is shared, so W = 64 costs no more memory than W = 1)."""
        from .data import SyntheticData, make_data
        if cfg.data.name == "synthetic":
            base = SyntheticData(cfg.data, self.table_rows, 0, self.workers, b)
            return [_with_rank(base, w) for w in range(self.workers)]
        cfg.data.loader = "memmap"  # the reference reader: same rows as DALI, no pipeline to start
        return [make_data(cfg, w, self.workers) for w in range(self.workers)]  # steps: compose_config(.., W)

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._data[worker].train_batch(step)
        return b.values, b.table_index()


def _with_rank(data: Any, rank: int) -> Any:
    view = copy.copy(data)
    view.rank = rank
    return view


class ArrayTrace:
    """An id array [S, B, T]: sample j of step s goes to worker j * W // B."""

    def __init__(self, ids: np.ndarray, rows: list[int], workers: int, description: str) -> None:
        s, b, t = ids.shape
        if b % workers:
            raise TraceError(f"{description}: {b} samples per step do not divide among {workers} "
                             f"workers (use --batch with a multiple of --workers)")
        self.ids, self.table_rows, self.workers = ids, list(rows), workers
        self.global_batch, self.steps, self.description = b, s, description
        self._b = b // workers
        self._tables = torch.arange(t, dtype=torch.int64).repeat(self._b)

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.ids[step, worker * self._b:(worker + 1) * self._b]
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64).reshape(-1)), self._tables


def load_trace(path: str, batch: Optional[int], log: Optional[TextIO] = None) -> tuple[np.ndarray, list[int]]:
    """(ids [S, B, T] int64, table_rows [T]) of a .npz or text trace file (see module docstring)."""
    if path.endswith(".npz"):
        ids, rows = _load_npz(path)
    else:
        if not batch or batch <= 0:
            raise TraceError(f"{path}: a text trace needs --batch B (global samples per step) > 0")
        ids, rows = _load_text(path, batch, log)
    if ids.shape[0] == 0:
        raise TraceError(f"{path}: no complete step in the trace")
    return ids, _table_rows(path, ids, rows)


def _load_npz(path: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    with np.load(path) as f:
        if "ids" not in f:
            raise TraceError(f"{path}: no array named 'ids' (need ids int [S, B, T])")
        ids, rows = f["ids"], (f["table_rows"] if "table_rows" in f else None)
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise TraceError(f"{path}: ids must be an integer array [steps, batch, tables], got "
                         f"{ids.dtype} {list(ids.shape)}")
    ids = ids.astype(np.int64)
    if (ids < 0).any():
        s, j, t = (int(v) for v in np.argwhere(ids < 0)[0])
        raise TraceError(f"{path}: negative id {int(ids[s, j, t])} at ids[{s}, {j}, {t}] "
                         f"(step {s}, sample {j}, table {t})")
    return ids, rows


def _load_text(path: str, batch: int, log: Optional[TextIO]) -> tuple[np.ndarray, None]:
    """Text trace -> [S, batch, T]; a trailing partial step is dropped (and said on `log`)."""
    with open(path) as f:
        numbered = [(i + 1, ln) for i, ln in enumerate(f) if ln.strip() and not ln.lstrip().startswith("#")]
    if not numbered:
        raise TraceError(f"{path}: no samples")
    rows = [re.split(r"[,\s]+", ln.strip()) for _, ln in numbered]
    width = len(rows[0])
    for (no, _), r in zip(numbered, rows):
        if len(r) != width:
            raise TraceError(f"{path}:{no}: {len(r)} ids, but the first sample has {width}")
    ids = _parse_ints(path, numbered, rows)
    steps, left = divmod(len(rows), batch)
    if left and log is not None:
        print(f"simulate: {path}: dropped the last {left} samples (a partial step of "
              f"{batch}); {steps} steps", file=log)
    return ids[:steps * batch].reshape(steps, batch, width), None


def _parse_ints(path: str, numbered: list[tuple[int, str]], rows: list[list[str]]) -> np.ndarray:
    """[n, T] int64; the first bad token (non-integer or negative) is named by line and column."""
    try:
        ids = np.array(rows, dtype=np.int64)
    except (ValueError, OverflowError):
        ids = None
    bad = None if ids is not None else next(
        (k, c) for k, r in enumerate(rows) for c, tok in enumerate(r) if not re.fullmatch(r"[+-]?\d+", tok))
    if ids is not None and (ids < 0).any():
        bad = tuple(int(v) for v in np.argwhere(ids < 0)[0])
    if bad is not None:
        k, c = bad
        tok = rows[k][c]
        what = "negative id" if re.fullmatch(r"-\d+", tok) else "not an integer id"
        raise TraceError(f"{path}:{numbered[k][0]}: {what} {tok!r} in column {c + 1} (table {c})")
    return ids


def _table_rows(path: str, ids: np.ndarray, rows: Optional[np.ndarray]) -> list[int]:
    """Given table sizes (checked against the ids) or max id + 1 per table."""
    top = ids.reshape(-1, ids.shape[2]).max(0) + 1
    if rows is None:
        return [int(v) for v in top]
    rows = np.asarray(rows).reshape(-1)
    if rows.size != ids.shape[2]:
        raise TraceError(f"{path}: table_rows has {rows.size} entries for {ids.shape[2]} tables")
    over = np.nonzero(top > rows)[0]
    if over.size:
        t = int(over[0])
        raise TraceError(f"{path}: table {t} has id {int(top[t]) - 1} >= table_rows[{t}] = {int(rows[t])}")
    return [int(v) for v in rows]


# ============================================================================ owners, spec
class FeedTrace:
    """The trainer's global feed (schedule/feed.py), as a run with a placement or a schedule feeds
    its ranks: the order (the data's own, or FAE's hot/cold batches) and the partition (contiguous
    slices, or Herald's). Worker w's batch of step s is exactly rank w's batch of such a run."""

    def __init__(self, cfg: Config, workers: int, hot_flat: np.ndarray, data: Any = None,
                 partition: Any = None, sync: Any = None) -> None:
        from .data import make_data
        from .schedule.feed import Feed, make_order
        self.workers, self.table_rows = workers, table_rows(cfg)
        self.global_batch = local_batch_size(cfg, workers) * workers
        self.description = f"data={cfg.data.preset} placement={cfg.placement.name}"
        self.data = data if data is not None else make_data(cfg, 0, workers)
        order = make_order(self.data, self.global_batch, np.asarray(hot_flat, np.int64), self.table_rows,
                           cfg.placement)
        self.feed = Feed(self.data, order, self.table_rows, 0, workers, hot_flat, partition, sync)
        self.steps = None
        self._at: tuple[int, Any, Any, Any] = (-1, None, None, None)

    def global_step(self, step: int) -> tuple[Any, np.ndarray, np.ndarray]:
        """(GlobalBatch, [G] worker of each sample, [N] table of each id) of `step` (cached)."""
        if self._at[0] != step:
            gb = self.feed.global_batch(step)
            t = gb.lengths.shape[1]
            tables = np.repeat(np.tile(np.arange(t), gb.keys.size), gb.lengths.reshape(-1))
            self._at = (step, gb, self.feed.workers(gb), tables)
        return self._at[1], self._at[2], self._at[3]

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        gb, owner, tables = self.global_step(step)
        sel = owner[gb.sample] == worker
        return (torch.from_numpy(np.ascontiguousarray(gb.values[sel], np.int64)),
                torch.from_numpy(tables[sel]))


class Owners:
    """Who owns a row: worker g mod W (sharded) or a server outside the workers (server)."""

    def __init__(self, rows: list[int], workers: int, mode: str,
                 hot_flat: Optional[np.ndarray] = None) -> None:
        if mode not in OWNERS:
            raise ValueError(f"owners={mode!r} is not one of {', '.join(OWNERS)}")
        self.mode, self.workers = mode, workers
        self.layout = RowSharding(rows, workers if mode == "sharded" else 1, 0)  # fused id space
        self._shards = [RowSharding(rows, workers, r) for r in range(workers)] if mode == "sharded" else []
        # replicated rows (placement): read locally on every worker, never in the protocol
        self.hot = torch.zeros(self.n_ids, dtype=torch.bool)
        if hot_flat is not None and len(hot_flat):
            from .schedule.herald import IdSpace
            space = IdSpace(rows, self.layout.table_offsets.numpy(), np.asarray(hot_flat))
            self.hot[torch.from_numpy(space.gids(np.asarray(hot_flat, np.int64)))] = True
        self.any_hot = bool(self.hot.any())

    @property
    def n_ids(self) -> int:
        return int(self.layout.table_offsets[-1])

    @property
    def wire(self) -> int:
        """Bytes of an id/version/count on the wire (int32 while an owner's rows fit)."""
        return wire_dtype(self.layout.local_rows).itemsize

    def gids(self, values: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        return self.layout.global_ids(values, tables)

    def table(self, gids: torch.Tensor) -> torch.Tensor:
        return self.layout.decode(gids)[0]

    def split(self, rank: int, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owned [Uo], remote [Ur] in the trainer's request order, remote ascending [Ur]) of a batch
        (replicated rows are in neither)."""
        if self.any_hot:
            gids = gids[~self.hot[gids]]
        if self.mode == "server":
            uniq = torch.unique(gids)
            return uniq[:0], uniq, uniq
        plan = plan_lookup(self._shards[rank], gids)
        return plan.owned_ids, plan.remote_ids, plan.uniq[torch.sort(plan.remote_pos).values]


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

    @classmethod
    def from_config(cls, c: Config, workers: int, owners: str = "sharded", plan: Any = None) -> "SimSpec":
        """The spec of config `c`; with a placement Plan, its replicated rows and cache capacities."""
        pull, push = staleness_bounds(c)
        caps = cache_capacities(c)
        if plan is not None and plan.cache_rows is not None and c.cache.policy != "none":
            caps = list(plan.cache_rows)
        hot = plan.hot if plan is not None else np.zeros(0, np.int64)
        return cls(table_rows(c), workers, caps, pull, push, c.cache.policy, owners,
                   c.cache.pin_threshold, c.model.embedding_dim, hot)


# ============================================================================ counters, audit
class Counters(CacheStats):
    """The trainer's per-table cache counters (summed over workers here) plus what the trainer
    records owner-side: the read-staleness histogram [T, bins] and max [T]."""

    def __init__(self, num_tables: int) -> None:
        super().__init__(num_tables, torch.device("cpu"))
        self.hist = torch.zeros(num_tables, HIST_BINS, dtype=torch.int64)
        self.max_staleness = torch.zeros(num_tables, dtype=torch.int64)

    def reads(self, table: torch.Tensor, hit: torch.Tensor, need: torch.Tensor,
              transient: torch.Tensor, gap: Optional[torch.Tensor] = None) -> None:
        """One worker's remote reads of a step ([Ur] each) and their staleness `gap`."""
        super().reads(table, hit, need, transient)
        if gap is not None:
            self.hist += staleness_histogram(gap, table, self.num_tables)
            self.max_staleness.scatter_reduce_(0, table, gap, reduce="amax")


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


# ============================================================================ workers
@dataclass
class StepReads:
    """A worker's phase-1 result, consumed by its phase 2."""

    owned: torch.Tensor  # [Uo] owned gids used
    remote: torch.Tensor  # [Ur] remote gids, request order
    slots: torch.Tensor  # [Ur] cache slot of each (-1 = transient / no cache)
    ascending: torch.Tensor  # [Ur] the remote gids sorted (this step's part of the OPT stream)
    evicted: Optional[Pushes] = None  # dirty entries evicted by this step's installs


class UncachedWorker:
    """cache.policy=none: the no-cache protocol, every remote row pulled and pushed every step."""

    def __init__(self, rank: int, owners: Owners) -> None:
        self.rank, self.owners = rank, owners

    def read(self, step: int, gids: torch.Tensor, versions: torch.Tensor, st: Counters,
             audit: Optional[Audit]) -> StepReads:
        owned, remote, ascending = self.owners.split(self.rank, gids)
        table = self.owners.table(remote)
        none = torch.zeros_like(table, dtype=torch.bool)
        st.reads(table, none, ~none, none)
        if audit is not None:
            now = versions.index_select(0, remote)
            audit.read(step, self.rank, remote, now, now)
        return StepReads(owned, remote, torch.full_like(remote, -1), ascending)

    def pushes_of(self, r: StepReads) -> tuple[torch.Tensor, torch.Tensor]:
        return r.remote, torch.ones_like(r.remote)

    def flush(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)


class CachedWorker:
    """One worker's RowCache driven exactly like HybridEmbedding._remote_rows_cached /
    _cached_pushes / flush (rows are 1 wide and zero: only slots, versions and counts matter)."""

    def __init__(self, rank: int, owners: Owners, spec: SimSpec, bounds: Bounds) -> None:
        self.rank, self.owners, self.bounds = rank, owners, bounds
        policy = make_policy(spec.policy, spec.pin_threshold)
        self.cache = RowCache(spec.capacities, 1, policy, owners.n_ids, local_lr=0.0)
        self._pushes: tuple[torch.Tensor, torch.Tensor] | None = None

    def read(self, step: int, gids: torch.Tensor, versions: torch.Tensor, st: Counters,
             audit: Optional[Audit]) -> StepReads:
        """Phase 1: lookup, version check against `versions` [n_ids], refresh, install."""
        owned, remote, ascending = self.owners.split(self.rank, gids)
        cache, table = self.cache, self.owners.table(remote)
        slots = cache.lookup(remote)
        hit = slots >= 0
        cache.touch(slots[hit], step)
        cached_ver = cache.versions_of(slots)
        now = versions.index_select(0, remote)
        need = needs_row(cached_ver, now, self.bounds.pull[table])
        gap = torch.where(need, torch.zeros_like(now), now - cached_ver)
        stale = hit & need
        cache.refresh(slots[stale], torch.zeros(int(stale.sum()), 1), now[stale])
        miss = ~hit
        new, evicted = cache.install(remote[miss], table[miss], torch.zeros(int(miss.sum()), 1),
                                     now[miss], step)
        slots[miss] = new
        st.reads(table, hit, need, slots < 0, gap)
        if audit is not None:
            audit.read(step, self.rank, remote, torch.where(need, now, cached_ver), now)
        return StepReads(owned, remote, slots, ascending, evicted)

    def pushes_of(self, r: StepReads) -> tuple[torch.Tensor, torch.Tensor]:
        """Phase 2 on the cache: local updates recorded, (gids, counts) of due + transient +
        evicted-dirty pushes (module._cached_pushes' order)."""
        cached = r.slots >= 0
        k = r.slots[cached]
        self.cache.record_updates(k, torch.zeros(k.numel(), 1))
        due = self.cache.take_due(k, self.bounds.push)
        transient = r.remote[~cached]
        ev = r.evicted if r.evicted is not None else Pushes.empty(1, torch.device("cpu"))
        return (torch.cat([due.gids, transient, ev.gids]),
                torch.cat([due.counts, torch.ones_like(transient), ev.counts]))

    def flush(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.cache.take_all()
        return p.gids, p.counts


def make_worker(rank: int, owners: Owners, spec: SimSpec,
                bounds: Bounds) -> "CachedWorker | UncachedWorker":
    if spec.policy == "none":
        return UncachedWorker(rank, owners)
    return CachedWorker(rank, owners, spec, bounds)


# ============================================================================ the simulator
class CacheSimulator:
    """W workers over one owner-version array; step() = phase 1 for all, then phase 2 for all."""

    def __init__(self, spec: SimSpec, audit: bool = False) -> None:
        self.spec = spec
        self.owners = Owners(spec.table_rows, spec.workers, spec.owners, spec.hot)
        self.replica_rows = 0  # sum over steps of the replicated rows the step's batches touched
        self.bounds = Bounds.from_lists(spec.pull, spec.push)
        self.versions = torch.zeros(self.owners.n_ids, dtype=torch.int64)  # updates applied per row
        self.workers = [make_worker(r, self.owners, spec, self.bounds) for r in range(spec.workers)]
        self.stats = Counters(len(spec.table_rows))
        self.audit = Audit() if audit else None
        self.streams: list[list[np.ndarray]] = [[] for _ in range(spec.workers)]  # OPT input
        self.steps_run = 0

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One step; batches[w] = (values [N], tables [N]) of worker w."""
        s = self.steps_run
        reads = []
        all_gids = [self.owners.gids(values, tables) for values, tables in batches]
        if self.owners.any_hot:  # one allreduce of the union of touched replicated rows
            g = torch.cat(all_gids)
            self.replica_rows += int(torch.unique(g[self.owners.hot[g]]).numel())
        for w, gids in zip(self.workers, all_gids):
            reads.append(w.read(s, gids, self.versions, self.stats, self.audit))
            self.streams[w.rank].append(reads[-1].ascending.numpy())
        for w, r in zip(self.workers, reads):
            gids, counts = w.pushes_of(r)
            self.stats.pushes(self.owners.table(gids), counts)
            if r.evicted is not None:
                self.stats.add("evicted_dirty", self.owners.table(r.evicted.gids))
            self._apply(s, torch.cat([gids, r.owned]), torch.cat([counts, torch.ones_like(r.owned)]))
        self.steps_run += 1

    def finish(self) -> None:
        """The final flush of every worker's pending updates."""
        for w in self.workers:
            gids, counts = w.flush()
            self.stats.pushes(self.owners.table(gids), counts)
            self._apply(self.steps_run, gids, counts)

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


# ============================================================================ OPT
def next_use(seq: np.ndarray) -> np.ndarray:
    """[n] index of the next access to the same id after each position (n = never again)."""
    n = seq.size
    order = np.argsort(seq, kind="stable")  # positions grouped by id, ascending within an id
    s = seq[order]
    nxt = np.full(n, n, dtype=np.int64)
    same = s[1:] == s[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(seq: np.ndarray, capacity: int, bypass: bool = False) -> np.ndarray:
    """[n] bool: which accesses of `seq` hit under Belady's MIN with `capacity` slots.

    Miss with a full cache: evict the cached id with the farthest next use (never = infinity).
    bypass=True: the incoming id competes too (not inserted when its next use is the farthest).
    O(n log n): next uses by a stable argsort, the cache as a max-heap with lazy deletion.
    """
    seq = np.asarray(seq, dtype=np.int64).reshape(-1)
    n = seq.size
    if capacity <= 0 or n == 0:
        return np.zeros(n, dtype=bool)
    uniq, codes = np.unique(seq, return_inverse=True)
    if uniq.size <= capacity:  # everything fits: only first accesses miss
        first = np.zeros(n, dtype=bool)
        first[np.unique(codes, return_index=True)[1]] = True
        return ~first
    return _min_loop(codes.reshape(-1).tolist(), next_use(codes.reshape(-1)).tolist(), int(uniq.size),
                     capacity, bypass)


def _min_loop(codes: list[int], nxt: list[int], k: int, capacity: int, bypass: bool) -> np.ndarray:
    """The MIN loop over compact ids 0..k-1; heap keys -(next_use * k + id), stale keys skipped."""
    hit = np.zeros(len(codes), dtype=bool)
    cached = [-1] * k  # next use of each cached id, -1 = not cached
    heap: list[int] = []
    size = 0
    for i, (x, nu) in enumerate(zip(codes, nxt)):
        if cached[x] >= 0:
            hit[i] = True
        elif size < capacity:
            size += 1
        else:
            while True:  # drop stale heap entries until the top is a cached id's current key
                far, y = divmod(-heap[0], k)
                if cached[y] == far:
                    break
                heapq.heappop(heap)
            if bypass and nu >= far:
                continue
            heapq.heappop(heap)
            cached[y] = -1
        cached[x] = nu
        heapq.heappush(heap, -(nu * k + x))
    return hit


def opt_hits_by_table(worker: np.ndarray, table: np.ndarray, gid: np.ndarray, caps: list[int],
                      bypass: bool = False) -> np.ndarray:
    """[T] OPT hits summed over workers; each (worker, table) stream keeps its order in `gid`."""
    out = np.zeros(len(caps), dtype=np.int64)
    key = worker * len(caps) + table
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(key.max() + 2 if key.size else 1))
    for k in range(bounds.size - 1):
        lo, hi = bounds[k], bounds[k + 1]
        if hi > lo:
            t = k % len(caps)
            out[t] += int(belady_hits(gid[order[lo:hi]], caps[t], bypass).sum())
    return out


# ============================================================================ run + report
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


def _bound(values: list[int]) -> Any:
    """A bound as configured (-1 = unbounded): one number when all tables agree, else the list."""
    vals = [-1 if v < 0 or v >= UNBOUNDED else int(v) for v in values]
    return vals[0] if len(set(vals)) == 1 else vals


def _ratio(a: float, b: float) -> Optional[float]:
    return float(a) / float(b) if b else None


def _bytes(sim: CacheSimulator) -> tuple[dict[str, int], int]:
    """(HET bytes by kind + total, no-cache baseline total) over all workers and steps."""
    t, spec = sim.stats.t, sim.spec
    req = int(t["requested"].sum())
    base = sum(no_cache_wire_bytes(req, spec.dim, ROW_ELEM).values())
    if spec.policy == "none":  # the no-cache protocol: id requests, rows, row gradients
        nb = no_cache_wire_bytes(req, spec.dim, ROW_ELEM)
        out = {"version_check": nb["ids"], "rows": nb["rows"], "pushes": nb["grads"]}
    else:
        out = het_wire_bytes(req, int(t["pulled"].sum()), int(t["pushed_rows"].sum()), spec.dim,
                             ROW_ELEM, sim.owners.wire)
    out = {k: int(v) for k, v in out.items()}
    if sim.owners.any_hot:  # ring allreduce of [u, d] float32: 2 (W - 1) / W * bytes per worker
        out["replica"] = int(2 * (spec.workers - 1) * sim.replica_rows * spec.dim * ROW_ELEM)
    out["total"] = sum(out.values())
    return out, base


def _hist(h: torch.Tensor) -> dict[str, int]:
    """The trainer's staleness histogram format: {"0": n, ..., ">=64": n}, non-zero bins only."""
    return {str(b) if b < HIST_BINS - 1 else f">={b}": int(n) for b, n in enumerate(h.tolist()) if n}


def report(sim: CacheSimulator, trace: Trace, seconds: float, per_table: bool = False,
           opt_bypass: bool = False) -> dict[str, Any]:
    """The JSON line's dict (keys in a stable order)."""
    spec, st = sim.spec, sim.stats
    t = {k: v.numpy() for k, v in st.t.items()}
    streams = sim.access_streams()
    opt = opt_hits_by_table(*streams, spec.capacities)
    req, hits = int(t["requested"].sum()), int(t["hits"].sum())
    hit_rate, opt_rate = _ratio(hits, req) or 0.0, _ratio(int(opt.sum()), req) or 0.0
    out: dict[str, Any] = {
        "workers": spec.workers, "steps": sim.steps_run, "owners": spec.owners, "policy": spec.policy,
        "trace": trace.description, "global_batch": trace.global_batch,
        "capacity_rows": int(sum(spec.capacities)), "pull_bound": _bound(spec.pull),
        "push_bound": _bound(spec.push), "requested": req, "hits": hits, "hit_rate": hit_rate,
        "opt_hit_rate": opt_rate, "hit_rate_vs_opt": _ratio(hit_rate, opt_rate),
        **{k: int(t[k].sum()) for k in ("fresh_hits", "pulled", "pushed_rows", "pushed_updates",
                                        "evicted_dirty", "transient")},
        "max_staleness": int(st.max_staleness.max()) if st.max_staleness.numel() else 0,
        "staleness_hist": _hist(st.hist.sum(0)),
        **_bytes_report(sim, sim.steps_run * trace.global_batch),
    }
    if opt_bypass:
        bypass = opt_hits_by_table(*streams, spec.capacities, bypass=True)
        out["opt_bypass_hit_rate"] = _ratio(int(bypass.sum()), req) or 0.0
    if per_table:
        out["per_table"] = _per_table(spec, t, opt)
    out["seconds"] = seconds
    return out


def _bytes_report(sim: CacheSimulator, samples: int) -> dict[str, Any]:
    nbytes, base = _bytes(sim)
    return {"bytes": nbytes, "bytes_per_sample": nbytes["total"] / max(samples, 1),
            "no_cache_bytes_per_sample": base / max(samples, 1),
            "bytes_reduction": 1.0 - nbytes["total"] / base if base else 0.0}


def _per_table(spec: SimSpec, t: dict[str, np.ndarray], opt: np.ndarray) -> list[dict[str, int]]:
    return [{"table": i, "capacity_rows": spec.capacities[i], "requested": int(t["requested"][i]),
             "hits": int(t["hits"][i]), "opt_hits": int(opt[i]), "pulled": int(t["pulled"][i]),
             "pushed_rows": int(t["pushed_rows"][i])} for i in range(len(spec.capacities))]


def simulate(trace: Trace, spec: SimSpec, steps: int, per_table: bool = False,
             opt_bypass: bool = False, log: Optional[TextIO] = None) -> dict[str, Any]:
    """Replay, flush, compute OPT and return the report dict (seconds = all of it)."""
    t0 = time.perf_counter()
    sim = run_simulation(trace, spec, steps, log=log)
    if log is not None:
        print(f"simulate: OPT over {int(sim.stats.t['requested'].sum())} accesses", file=log, flush=True)
    out = report(sim, trace, 0.0, per_table, opt_bypass)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def simulate_schedule(cfg: Config, workers: int, steps: int,
                      log: Optional[TextIO] = None) -> dict[str, Any]:
    """Herald for W simulated workers (config schedule=herald): the trainer's own feed, partition
    and on-demand sync planner (schedule/herald.py) over `steps` global batches, then the final
    flush. Counts rows: pulls (rows sent to a reader, lends included), pushes (gradients +
    writebacks), both against the naive baseline (contiguous = random partition of the shuffled
    global batch, every remote read pulled and its gradient pushed every step)."""
    from .data import make_data
    from .placement import plan_run
    from .schedule.herald import HeraldPartition, HeraldPlanner, IdSpace
    t0 = time.perf_counter()
    rows = table_rows(cfg)
    data = make_data(cfg, 0, workers)
    plan = plan_run(cfg, data, workers)
    space = IdSpace(rows, RowSharding(rows, workers, 0).table_offsets.numpy(), plan.hot)
    caps = plan.cache_rows if plan.cache_rows is not None else cache_capacities(cfg)
    planner = HeraldPlanner(workers, space, sum(caps))
    part = (HeraldPartition(workers, space, planner, cfg.schedule.cache_aware, cfg.schedule.passes)
            if cfg.schedule.name == "herald" else None)
    trace = FeedTrace(cfg, workers, plan.hot, data, part, planner)
    every = max(1, steps // 10)
    for s in range(steps):
        gb, owner, _ = trace.global_step(s)
        if not gb.hot:
            planner.plan(s, gb, owner)
        if log is not None and ((s + 1) % every == 0 or s + 1 == steps):
            print(f"simulate: step {s + 1}/{steps} {time.perf_counter() - t0:.1f}s", file=log, flush=True)
    planner.flush()
    out: dict[str, Any] = {"workers": workers, "steps": steps, "global_batch": trace.global_batch,
                           "trace": trace.description, "schedule": cfg.schedule.name,
                           "on_demand_sync": True, "placement": plan.name,
                           "replicated_rows": int(plan.hot.size), **planner.summary()}
    if part is not None:
        out["remote_reads"], out["random_remote_reads"] = part.remote, part.random_remote
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def resolve_owners(owners: str, workers: int, log: Optional[TextIO] = None) -> str:
    """auto: sharded over the workers when W > 1; at W = 1 every row would be local (nothing to
    cache), so the rows live on a parameter server (HET's setting) instead, said on `log`."""
    if owners != "auto":
        return owners
    if workers == 1 and log is not None:
        print("simulate: W=1: rows live on a parameter server (--owners server), so every id is "
              "remote and cacheable; --owners sharded would make every row local", file=log)
    return "server" if workers == 1 else "sharded"


def build(overrides: list[str], workers: int, owners: str = "auto", trace_file: Optional[str] = None,
          batch: Optional[int] = None, log: Optional[TextIO] = sys.stderr) -> tuple[Trace, SimSpec, Config]:
    """The trace and spec of a CLI call: Hydra overrides, plus an optional trace file whose table
    sizes replace data.table_rows (so cache capacities and per-table overrides apply to it)."""
    if workers <= 0:
        raise TraceError(f"--workers {workers}: must be > 0")
    owners = resolve_owners(owners, workers, log)
    if trace_file is None:
        cfg = compose_config(overrides, workers)  # data.epochs -> train.steps for W workers
        if needs_global_view(cfg):  # placement / schedule: the trainer's global feed and its plan
            from .data import make_data
            from .placement import plan_run
            data = make_data(cfg, 0, workers)
            plan = plan_run(cfg, data, workers)
            if log is not None and plan.name != "none":
                print(f"simulate: placement={plan.name}: {plan.hot.size} replicated rows "
                      f"({plan.info.get('plan_seconds')}s to plan)", file=log, flush=True)
            trace: Trace = FeedTrace(cfg, workers, plan.hot, data)
            return trace, SimSpec.from_config(cfg, workers, owners, plan), cfg
        trace = ConfigTrace(cfg, workers)
        return trace, SimSpec.from_config(cfg, workers, owners), cfg
    if any(o.split("=")[0].lstrip("+~") in ("data",) for o in overrides):
        raise TraceError("--trace replaces the data config: drop the data=... override")
    ids, rows = load_trace(trace_file, batch, log)
    rows_override = f"data.table_rows=[{','.join(str(r) for r in rows)}]"
    cfg = compose_config(list(overrides) + [rows_override, "data.max_table_rows=0"])
    trace = ArrayTrace(ids, rows, workers, os.path.basename(trace_file))
    return trace, SimSpec.from_config(cfg, workers, owners), cfg


def resolve_steps(trace: Trace, cfg: Config, steps: Optional[int], log: Optional[TextIO]) -> int:
    """--steps, else the trace's length (file / criteo epochs), else train.steps; clipped to the trace."""
    want = steps if steps is not None else (trace.steps if trace.steps is not None else cfg.train.steps)
    if want <= 0:
        raise TraceError(f"--steps {want}: must be > 0")
    if trace.steps is not None and want > trace.steps:
        if log is not None:
            print(f"simulate: the trace has {trace.steps} steps; simulating {trace.steps}, not {want}",
                  file=log)
        return trace.steps
    return want


__all__ = ["ArrayTrace", "CacheSimulator", "ConfigTrace", "FeedTrace", "simulate_schedule", "Owners", "SimSpec", "Trace", "TraceError",
           "belady_hits", "build", "compose_config", "load_trace", "next_use", "opt_hits_by_table",
           "resolve_steps", "run_simulation", "simulate"]
