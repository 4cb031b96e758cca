"""The cost-model planner (placement=sca) and the simulator's placements.

- Analytic costs match their formulas by brute force; buckets cover every rank once.
- The planner's choice is never worse than FAE's plan on predicted bytes (same budget).
- Predicted bytes = measured bytes of the training run (replayed on the run's own feed), within 15%
  (exact when plan_steps covers the run).
- placement=sca is exact: W = 2 and 3 reproduce the single-process reference (BSP).
- scripts/plan.py prints the plan as JSON; bad input gives a clear error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import make_cfg, run_single, run_world
from parity_helpers import assert_same_run
from trainer.base.config import ConfigError, cache_capacities
from trainer.run.resolve.configure import load_config
from trainer.workload.data import SyntheticData
from trainer.sparse.placement import fae_plan, profile_stream, row_bytes
from trainer.sparse.placement.sca import analytic_costs, bucket_edges, predict_bytes, sca_plan, slot_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["data=tiny", "data.max_bag=1", "train.steps=24", "data.global_batch_size=48",
        "data.test_samples=480", "data.eval_batch_size=40", "train.threads=1", "train.progress=off"]
SCA = BASE + ["placement=sca"]


def _setup(overrides, world):
    c = load_config(make_cfg(BASE + list(overrides)))
    data = SyntheticData(c.data, c.data.table_rows, 0, world, c.data.global_batch_size // world)
    prof = profile_stream(data, c.data.table_rows, c.train.steps * c.data.global_batch_size,
                          c.placement.profile_fraction)
    return c, data, prof


def test_bucket_edges_cover_every_rank_once():
    for n, k in ((0, 4), (1, 32), (10, 32), (1000, 32), (12345, 7)):
        e = bucket_edges(n, k)
        assert e[0] == 0 and e[-1] == n and np.all(np.diff(e) > 0)
        assert e.size - 1 <= max(k, 1) + 1
    e = bucket_edges(1000, 32)
    assert np.diff(e)[0] <= np.diff(e)[-1]  # finest buckets for the hottest rows


def test_analytic_costs_match_brute_force():
    p = np.array([1.0, 0.5, 0.01, 0.0])
    w, b, d = 4, 8, 16
    shard, repl = analytic_costs(p, w, b, d)
    q = 1 - (1 - np.minimum(p, 1 - 1e-12)) ** b
    t = 1 - (1 - np.minimum(p, 1 - 1e-12)) ** (w * b)
    assert np.allclose(shard, (w - 1) * q * (8 + 8 * d))
    assert np.allclose(repl, 2 * (w - 1) * t * 4 * d)
    assert shard[-1] == repl[-1] == 0
    assert shard[0] > repl[0]  # a row every step reads: replication saves the id bytes
    assert shard[2] < repl[2]  # a rarely read row: the allreduce costs more than the pulls


@pytest.mark.parametrize("extra,world", [(["cache=lru"], 2), (["optim=adagrad"], 3),
                                         (["cache=lru", "placement.budget_bytes=40000"], 3)])
def test_sca_never_worse_than_fae_on_predicted_bytes(extra, world):
    c, data, prof = _setup(["placement=sca"] + extra, world)
    per_row = row_bytes(c.model.embedding_dim, c.optim.sparse)
    plan = sca_plan(prof, c.placement.budget_bytes, per_row, c, world, data)
    cache_bytes = sum(cache_capacities(c)) * slot_bytes(c.model.embedding_dim)
    fae = fae_plan(prof, c.placement.budget_bytes - cache_bytes, per_row)
    fae_pred = predict_bytes(c, world, fae, data)["total"]
    got = sum(plan.predicted.values())
    assert got <= fae_pred + 1e-9
    info = plan.info
    assert info["memory_bytes"] <= c.placement.budget_bytes
    assert {x["name"] for x in info["candidates"]} >= {"shard", "fae", "analytic"}
    assert min(x["predicted_bytes_per_sample"] for x in info["candidates"]) == pytest.approx(got)
    decisions = [b["decision"] for b in info["buckets"]]
    assert sum(b["ranks"][1] - b["ranks"][0] for b in info["buckets"]) == prof.ids.size
    assert set(decisions) <= {"replicate", "split", "cache", "shard"}


def test_sca_budget_zero_replicates_nothing_and_config_errors():
    c, data, prof = _setup(["placement=sca", "placement.budget_bytes=0"], 2)
    plan = sca_plan(prof, 0, 64, c, 2, data)
    assert plan.hot.size == 0
    with pytest.raises(ConfigError, match="placement.plan_steps"):
        load_config(make_cfg(["placement=sca", "placement.plan_steps=0"]))
    with pytest.raises(ConfigError, match="placement.buckets"):
        load_config(make_cfg(["placement=sca", "placement.buckets=0"]))


# ---------------------------------------------------------------------------- real runs
@pytest.mark.dist
@pytest.mark.parametrize("world,extra", [(2, ["optim=sgd", "cache=lru"]), (3, ["optim=adagrad"])])
def test_sca_parity_and_prediction_matches_measurement(world, extra):
    ref = run_single(SCA + extra)
    got = run_world(world, SCA + extra)
    for res in got:
        assert_same_run(ref, res)
    p = got[0].summary["placement"]
    assert p["name"] == "sca" and p["hot_rows"] > 0 and got[0].summary["bytes"]["replica"] > 0
    pm = p["predicted_vs_measured"]
    assert abs(pm["error"]) < 0.01  # plan_steps (32) covers the 24 steps: the replay is the run


@pytest.mark.dist
def test_prediction_from_a_prefix_is_within_15_percent():
    got = run_world(2, SCA + ["cache=lru", "placement.plan_steps=6"], return_state=False)
    pm = got[0].summary["placement"]["predicted_vs_measured"]
    assert pm["measured"] > 0 and abs(pm["error"]) < 0.15


def test_plan_script_prints_json_and_rejects_bad_input():
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "plan.py"), "-W", "2", "data=tiny",
           "placement=sca", "cache=lru", "train.steps=8"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["name"] == "sca" and line["predicted_total_bytes_per_sample"] > 0
    assert "predicted" in out.stderr and "decision" in out.stderr
    bad = subprocess.run(cmd[:2] + ["-W", "0", "placement=sca"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert bad.returncode == 2 and "--workers" in bad.stderr
    none = subprocess.run(cmd[:2] + ["-W", "2", "data=tiny"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert none.returncode == 2 and "nothing to plan" in none.stderr
