"""The cost-model planner (after "Stochastic Communication Avoidance for Recommendation Systems"):
choose, per frequency bucket, replicate / cache / shard to minimise the predicted embedding bytes
per step under a per-worker memory budget.

Two cost models, one cheap and one exact:

1. Analytic, per row, from the access profile (p_r = expected reads of row r per sample; B local
   and G = W B global samples per step; rows assumed read independently):
     sharded:    (W - 1) * q_r * (8 + 2 * 4d)       q_r = 1 - (1 - p_r)^B: a non-owner worker reads
                                                    it in a step (an int64 id, the row, its gradient)
     replicated: 2 (W - 1) * P_r * 4d               P_r = 1 - (1 - p_r)^G: the global batch touches
                                                    it (one ring allreduce of its gradient)
   Rows are sorted by frequency and cut into `buckets` geometric frequency buckets; the replicated
   set is the prefix of buckets with the largest summed saving that fits the budget. (Note what
   this says: a row read every step costs about the same either way, 2 (W - 1) 4d; replication saves
   the ids and the alltoall, and loses on rows a step touches on few workers.)
2. Replay ("streamed statistics"): each candidate placement (sharded / cached with a capacity and
   the configured bounds / replicated) runs through the cache simulator (trainer/sparse/sim/: the
   trainer's own cache, consistency and byte formulas, the trainer's own feed) over the first
   K = placement.plan_steps steps of the run's stream; the run's other steps are extrapolated at the
   rate of the last K/2 replayed steps (warm caches), and the final flush is added. This is the prediction reported, and the one the
   choice is made on; training reports the measured bytes next to it (summary.json placement).

Candidates (each within the budget; the budget counts replicated rows, per_row bytes each = row +
optimizer state, and, when a cache is configured, cached rows, slot_bytes each): all sharded with
the configured cache, FAE's plan (the most read rows filling what the configured cache leaves), the
analytic prefix, and with a cache the budget moved from replication to cache capacity. FAE's plan is
a candidate, so the choice is never worse than FAE's on predicted bytes.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ...base.config import Config, cache_capacities, local_batch_size
from ...workload.data.source import GlobalData
from ..schedule.replay import FeedTrace, spec_from_config
from ..sim import CacheSimulator
from .plan import Plan, register
from .profile import AccessProfile


def slot_bytes(dim: int) -> int:
    """Bytes one cache slot costs a worker (RowCache: row + pending update, version, count, gid,
    frequency, last use)."""
    return 2 * dim * 4 + 5 * 8


def bucket_edges(n: int, buckets: int) -> np.ndarray:
    """[k + 1] rank edges of geometric frequency buckets over n rows sorted most read first
    (bucket i = ranks [edges[i], edges[i + 1]); the hottest rows get the finest buckets)."""
    if n == 0:
        return np.zeros(1, np.int64)
    e = np.unique(np.round(np.geomspace(1, n + 1, buckets + 1)).astype(np.int64) - 1)
    return np.unique(np.concatenate([[0], e, [n]]))


def analytic_costs(p: np.ndarray, world: int, local_batch: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """([n] sharded, [n] replicated) predicted bytes per step of each row (all workers)."""
    p = np.clip(p, 0.0, 1.0)
    q = -np.expm1(local_batch * np.log1p(-np.minimum(p, 1 - 1e-12)))
    touched = -np.expm1(world * local_batch * np.log1p(-np.minimum(p, 1 - 1e-12)))
    shard = (world - 1) * q * (8 + 2 * 4 * dim)
    repl = 2 * (world - 1) * touched * 4 * dim
    return shard, repl


def sca_plan(profile: AccessProfile, budget_bytes: int, per_row: int, config: Config, world: int,
             data: Optional[GlobalData] = None, **_: Any) -> Plan:
    """The planner's Plan: replicated rows, cache capacities, predicted bytes per global sample."""
    c, d = config, config.model.embedding_dim
    b = local_batch_size(c, world)
    order = profile.by_frequency()
    ranked = profile.ids[order]
    p = profile.counts[order] / max(profile.samples, 1)
    shard, repl = analytic_costs(p, world, b, d)
    edges = bucket_edges(ranked.size, c.placement.buckets)
    gain = np.array([float((shard - repl)[lo:hi].sum()) for lo, hi in zip(edges[:-1], edges[1:])])

    cached = c.cache.policy != "none" and world > 1
    cfg_caps = cache_capacities(c) if cached else [0] * len(profile.table_rows)
    slot = slot_bytes(d)
    cfg_cache_bytes = sum(cfg_caps) * slot
    max_hot = int(min(budget_bytes // per_row, ranked.size))

    def prefix_at(n_max: int) -> int:
        """Rows in the analytic best bucket prefix with at most n_max rows."""
        best, best_gain, acc = 0, 0.0, 0.0
        for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            if hi > n_max:
                break
            acc += gain[i]
            if acc > best_gain:
                best, best_gain = int(hi), acc
        return best

    cands: list[tuple[str, int, Optional[list[int]]]] = []
    if cfg_cache_bytes <= budget_bytes:
        n_fae = int(min((budget_bytes - cfg_cache_bytes) // per_row, ranked.size))
        cands += [("shard", 0, None), ("fae", n_fae, None), ("analytic", prefix_at(n_fae), None)]
    if cached:  # move budget from replication to cache capacity
        for name, n in (("cache", 0), ("analytic+cache", prefix_at(max_hot)),
                        ("half+cache", prefix_at(max_hot // 2))):
            caps = _cache_caps(profile, ranked[:n], (budget_bytes - n * per_row) // slot)
            cands.append((name, n, caps))
    if not cands:  # the configured cache alone exceeds the budget: replication only, no cache change
        cands = [("shard", 0, None), ("analytic", prefix_at(max_hot), None)]

    seen, evaluated = set(), []
    for name, n, caps in cands:
        key = (n, tuple(caps) if caps is not None else None)
        if key in seen:
            continue
        seen.add(key)
        hot = np.sort(ranked[:n])
        trial = Plan("sca", hot, cache_rows=caps)
        pred = predict_bytes(c, world, trial, data) if data is not None else None
        mem = n * per_row + (sum(caps) if caps is not None else sum(cfg_caps)) * slot
        evaluated.append((name, trial, pred, mem))
    chosen = min(evaluated, key=lambda e: (e[2]["total"] if e[2] is not None else 0.0, e[1].hot.size))
    name, plan, pred, mem = chosen
    caps = plan.cache_rows if plan.cache_rows is not None else cfg_caps
    plan.predicted = {k: v for k, v in pred.items() if k != "total"} if pred is not None else None
    plan.info = {
        "budget_bytes": int(budget_bytes), "bytes_per_row": per_row, "cache_slot_bytes": slot,
        "memory_bytes": int(mem), "replicated_bytes": int(plan.hot.size * per_row),
        "chosen": name, "plan_steps": _plan_steps(c),
        "candidates": [{"name": n_, "hot_rows": int(t.hot.size),
                        "cache_rows": int(sum(t.cache_rows) if t.cache_rows is not None else sum(cfg_caps)),
                        "memory_bytes": int(m),
                        "predicted_bytes_per_sample": pr["total"] if pr is not None else None}
                       for n_, t, pr, m in evaluated],
        "buckets": _bucket_table(edges, p, ranked, plan.hot.size, shard, repl, caps, profile),
        "profile": profile.summary(),
    }
    return plan


def _plan_steps(c: Config) -> int:
    return int(max(1, min(c.train.steps, c.placement.plan_steps)))


def predict_bytes(c: Config, world: int, plan: Plan, data: GlobalData) -> dict[str, float]:
    """Embedding bytes per global sample by kind (+ total) of `plan` over the run's train.steps:
    the first K = plan_steps steps of the run's own feed replayed exactly through the cache
    simulator (caches warming up included), the remaining steps at the rate of the last K/2
    replayed steps (warm caches), plus the final flush."""
    k, total = _plan_steps(c), max(c.train.steps, 1)
    trace = FeedTrace(c, world, plan.hot, data)
    sim = CacheSimulator(spec_from_config(c, world, "sharded", plan))
    tail = max(1, k // 2)
    mark: dict[str, int] = {}
    for s in range(k):
        if s == k - tail:
            mark = sim.bytes()[0]
        sim.step([trace.batch(s, w) for w in range(world)])
    before_flush = sim.bytes()[0]
    sim.finish()
    done = sim.bytes()[0]
    rest = total - k
    out = {}
    for key, v in done.items():
        rate = (before_flush[key] - mark.get(key, 0)) / tail
        out[key] = (v + rest * rate) / (total * trace.global_batch)
    return out


def _cache_caps(profile: AccessProfile, hot: np.ndarray, rows: int) -> list[int]:
    """`rows` cache slots per worker spread over the tables in proportion to the profiled rows
    each table has beyond the replicated ones (capped at the table's rows)."""
    t = profile.table_of(profile.ids[~np.isin(profile.ids, hot)])
    seen = np.bincount(t, minlength=len(profile.table_rows)).astype(np.float64)
    if rows <= 0 or seen.sum() == 0:
        return [0] * len(profile.table_rows)
    caps = np.floor(rows * seen / seen.sum()).astype(np.int64)
    return [int(min(x, n)) for x, n in zip(caps, profile.table_rows)]


def _bucket_table(edges: np.ndarray, p: np.ndarray, ranked: np.ndarray, n_hot: int, shard: np.ndarray,
                  repl: np.ndarray, caps: list[int], profile: AccessProfile) -> list[dict[str, Any]]:
    """Per frequency bucket: rows, reads per sample, the decision and its analytic bytes/step.
    cache = not replicated and within the most read rows the cache capacity could hold."""
    cache_rows = sum(caps)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi <= n_hot:
            what = "replicate"
        elif lo < n_hot:
            what = "split"
        elif cache_rows and lo < n_hot + cache_rows:
            what = "cache"
        else:
            what = "shard"
        out.append({"ranks": [int(lo), int(hi)], "reads_per_sample": float(p[lo:hi].sum()),
                    "decision": what, "shard_bytes_per_step": float(shard[lo:hi].sum()),
                    "replicate_bytes_per_step": float(repl[lo:hi].sum())})
    return out


register("sca", sca_plan)
