"""The cache simulator's driver (scripts/simulate_cache.py): trace sources, config -> spec, the JSON
report with Belady's OPT, and Herald's schedule replay. The engine is trainer/sparse/sim/.

Why a simulator: the HET cache's value (pulls and pushes saved, bytes, staleness) depends only on
which ids each worker reads in which step, not on the model. The engine (trainer/sparse/sim/) replays a
trace through the SAME objects the trainer uses (plan_lookup, HetRemote / PlainRemote with their
RowCache and consistency rules, the byte formulas het_wire_bytes / no_cache_wire_bytes) over an
in-process exchange, which answers "what would policy P, capacity C and bounds (s_pull, s_push)
cost at W workers" without training, for W up to 64 on one machine. The trainer's cache counters
for the same config and steps are equal to the simulator's (tests/tools/test_simulate_cache.py checks
this against a real 2-process run).

Pieces here: trace sources (ConfigTrace: synthetic presets / a prepared Criteo dir through the data
pipeline; ArrayTrace: an id file; schedule/replay.FeedTrace: the trainer's global feed with a
placement or schedule), the spec of a config (schedule/replay.spec_from_config), the report (OPT
by sim.opt_hits_by_table), simulate_schedule (Herald's partition and sync planner alone).

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
import os
import re
import sys
import time
from typing import Any, Optional, TextIO

import numpy as np
import torch

from ..base.config import Config, cache_capacities, local_batch_size, needs_global_view, table_rows
from ..run.resolve.configure import compose_config
from ..sparse.schedule.replay import FeedTrace, spec_from_config
from ..sparse.sim import CacheSimulator, SimSpec, Trace, bound_value, opt_hits_by_table, run_simulation
from ..sparse.embedding.cache.consistency import HIST_BINS
from ..sparse.sim import OWNERS, Owners, belady_hits, next_use  # noqa: F401 (re-exported for the CLI and tests)
from ..workload.data import DataSource, SyntheticData

class TraceError(ValueError):
    """A trace file or trace option is malformed; the message names the file and position."""


# ============================================================================ trace sources
class ConfigTrace:
    """The training data of a config: worker w's batch of step s is rank w's train_batch(s)."""

    def __init__(self, cfg: Config, workers: int) -> None:
        self.workers, self.table_rows = workers, table_rows(cfg)
        b = local_batch_size(cfg, workers)
        self.global_batch = b * workers
        self.description = f"data={cfg.data.preset}"
        self._data = self._sources(cfg, b)
        self.steps = None  # sources loop over epochs; criteo/movielens set train.steps (data.epochs)

    def _sources(self, cfg: Config, b: int) -> list[DataSource]:
        """One data source per worker. Synthetic: one generator, shallow copies differing only in
        rank (the planted-weight table is shared, so W = 64 costs no more memory than W = 1)."""
        from ..workload.data import SyntheticData, make_data
        if cfg.data.name == "synthetic":
            base = SyntheticData(cfg.data, self.table_rows, 0, self.workers, b)
            return [_with_rank(base, w) for w in range(self.workers)]
        cfg.data.loader = "memmap"  # the reference reader: same rows as DALI, no pipeline to start
        return [make_data(cfg, w, self.workers) for w in range(self.workers)]  # steps: compose_config(.., W)

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._data[worker].train_batch(step)
        return b.values, b.table_index()


def _with_rank(data: SyntheticData, rank: int) -> SyntheticData:
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


# ============================================================================ run + report
def _ratio(a: float, b: float) -> Optional[float]:
    return float(a) / float(b) if b else None


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
        "capacity_rows": int(sum(spec.capacities)), "pull_bound": bound_value(spec.pull),
        "push_bound": bound_value(spec.push), "requested": req, "hits": hits, "hit_rate": hit_rate,
        "opt_hit_rate": opt_rate, "hit_rate_vs_opt": _ratio(hit_rate, opt_rate),
        **{k: int(t[k].sum()) for k in ("fresh_hits", "pulled", "pushed_rows", "pushed_updates",
                                        "evicted_dirty", "transient")},
        "max_staleness": int(sim.staleness.max.max()) if sim.staleness.max.numel() else 0,
        "staleness_hist": _hist(sim.staleness.hist.sum(0)),
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
    nbytes, base = sim.bytes()
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
    from ..workload.data import make_data
    from ..sparse.placement import plan_run
    from ..sparse.embedding.sharding import RowSharding
    from ..sparse.schedule.herald import HeraldPlanner, IdSpace
    from ..sparse.schedule.partition import HeraldPartition
    t0 = time.perf_counter()
    rows = table_rows(cfg)
    data = make_data(cfg, 0, workers)
    plan = plan_run(cfg, data, workers)
    space = IdSpace(RowSharding(rows, workers, 0), plan.hot)
    caps = plan.cache_rows if plan.cache_rows is not None else cache_capacities(cfg)
    herald = cfg.schedule.name == "herald"
    sync = cfg.schedule.on_demand_sync or not herald  # the baseline (no Herald) counts through the planner
    planner = HeraldPlanner(workers, space, sum(caps)) if sync else None
    part = HeraldPartition(workers, space, planner, cfg.schedule.cache_aware, cfg.schedule.passes) if herald else None
    trace = FeedTrace(cfg, workers, plan.hot, data, part, planner)
    every = max(1, steps // 10)
    for s in range(steps):
        gb, owner, _ = trace.global_step(s)
        if planner is not None and not gb.hot:
            planner.plan(s, gb, owner)
        if log is not None and ((s + 1) % every == 0 or s + 1 == steps):
            print(f"simulate: step {s + 1}/{steps} {time.perf_counter() - t0:.1f}s", file=log, flush=True)
    if planner is not None:
        planner.flush()
        counts = planner.summary()
    else:  # schedule.on_demand_sync=false: the partition alone, every remote read pulled and pushed each step
        assert part is not None
        naive = part.random_remote
        counts = {"pulls": part.remote, "pushes": part.remote, "naive_remote_reads": naive,
                  "pulls_vs_naive": part.remote / naive if naive else None,
                  "pushes_vs_naive": part.remote / naive if naive else None}
    out: dict[str, Any] = {"workers": workers, "steps": steps, "global_batch": trace.global_batch,
                           "trace": trace.description, "schedule": cfg.schedule.name,
                           "on_demand_sync": sync, "placement": plan.name,
                           "replicated_rows": int(plan.hot.size), **counts}
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
        if cfg.embedding.kind == "dynamic":
            raise TraceError("embedding.kind=dynamic: the simulator models fixed tables (rows id mod W); "
                             "simulate dynamic tables' traffic by training them (docs/dynamic.md)")
        if needs_global_view(cfg):  # placement / schedule: the trainer's global feed and its plan
            from ..workload.data import make_data
            from ..sparse.placement import plan_run
            data = make_data(cfg, 0, workers)
            plan = plan_run(cfg, data, workers)
            if log is not None and plan.name != "none":
                print(f"simulate: placement={plan.name}: {plan.hot.size} replicated rows "
                      f"({plan.info.get('plan_seconds')}s to plan)", file=log, flush=True)
            trace: Trace = FeedTrace(cfg, workers, plan.hot, data)
            return trace, spec_from_config(cfg, workers, owners, plan), cfg
        trace = ConfigTrace(cfg, workers)
        return trace, spec_from_config(cfg, workers, owners), cfg
    if any(o.split("=")[0].lstrip("+~") in ("data",) for o in overrides):
        raise TraceError("--trace replaces the data config: drop the data=... override")
    ids, rows = load_trace(trace_file, batch, log)
    rows_override = f"data.table_rows=[{','.join(str(r) for r in rows)}]"
    cfg = compose_config(list(overrides) + [rows_override, "data.max_table_rows=0"])
    trace = ArrayTrace(ids, rows, workers, os.path.basename(trace_file))
    return trace, spec_from_config(cfg, workers, owners), cfg


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
