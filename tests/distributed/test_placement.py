"""Placement (FAE hot rows replicated, hot/cold batches) against the single-process reference.

- Replication is exact: W workers with hot rows replicated (allreduced) reproduce the W = 1
  reference that replicates nothing, when the data order is the same (hot_batches=false).
- FAE's hot/cold order is the same for every W, so W = 2 and 3 reproduce W = 1 with it too.
- A hot step runs no alltoall at all (counted by the collectives' call counter).
- Profiles, FAE's budget rule and the hot/cold windows are checked against brute force.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from helpers import assert_same_eval, make_cfg, run_single, run_world
from parity_helpers import assert_same_run
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data import SyntheticData
from trainer.sparse.placement import fae_plan, flat_ids, profile_stream, row_bytes
from trainer.sparse.schedule import HotColdOrder

BASE = ["data=tiny", "data.max_bag=1", "train.steps=24", "data.global_batch_size=48",
        "data.test_samples=480", "data.eval_batch_size=40", "train.threads=1", "train.progress=off",
        "placement.window_batches=8"]
FAE = BASE + ["placement=fae", "placement.budget_bytes=16000"]


def _tiny(overrides=()):
    c = load_config(make_cfg(["data=tiny"] + list(overrides)))
    return SyntheticData(c.data, c.data.table_rows, 0, 1, 48)


# ---------------------------------------------------------------------------- units
def test_profile_counts_every_kth_sample_exactly():
    data = _tiny()
    prof = profile_stream(data, data.rows, stream_samples=1000, fraction=0.1, chunk=7)
    keys = data.stream_keys(np.arange(0, 1000, 10))
    values, lengths = data.sample_ids(keys)
    want = Counter(flat_ids(values, lengths, data.rows).tolist())
    assert prof.samples == 100
    assert dict(zip(prof.ids.tolist(), prof.counts.tolist())) == dict(want)


def test_fae_plan_takes_the_most_read_rows_that_fit_the_budget():
    data = _tiny()
    prof = profile_stream(data, data.rows, 2000, 0.5)
    per_row = row_bytes(16, "adagrad")
    assert per_row == 128 and row_bytes(16, "sgd") == 64 and row_bytes(16, "rowwise_adagrad") == 68
    plan = fae_plan(prof, budget_bytes=20 * per_row + 5, per_row=per_row)
    assert plan.hot.size == 20 and np.all(np.diff(plan.hot) > 0)
    counts = dict(zip(prof.ids.tolist(), prof.counts.tolist()))
    worst_hot = min(counts[i] for i in plan.hot.tolist())
    best_cold = max(c for i, c in counts.items() if i not in set(plan.hot.tolist()))
    assert worst_hot >= best_cold
    assert fae_plan(prof, budget_bytes=per_row - 1, per_row=per_row).hot.size == 0


def test_hot_cold_windows_partition_the_stream():
    data = _tiny(["data.max_bag=1"])
    prof = profile_stream(data, data.rows, 5000, 0.2)
    hot = fae_plan(prof, 12000, 64).hot
    is_hot = lambda f: np.isin(f, hot)  # noqa: E731
    g, m = 48, 8
    for rate in (0.25, 1.0):
        order = HotColdOrder(data, g, is_hot, data.rows, window=m, hot_rate=rate)
        batches = [order.batch(k) for k in range(2 * m)]
        n_hot = sum(h for _, h in batches[:m])
        assert 0 < n_hot <= rate * m
        for w in range(2):
            window = np.concatenate([k for k, _ in batches[w * m:(w + 1) * m]])
            assert np.array_equal(np.sort(window), np.arange(w * m * g, (w + 1) * m * g))
        for keys, h in batches:
            assert keys.size == g
            all_hot = is_hot(flat_ids(*data.sample_ids(keys), data.rows))
            if h:
                assert all_hot.all()
    assert order.hot_samples > 0


def test_placement_config_errors():
    with pytest.raises(ConfigError, match="placement.budget_bytes"):
        load_config(make_cfg(["placement=fae", "placement.budget_bytes=-1"]))
    with pytest.raises(ConfigError, match="placement.hot_rate"):
        load_config(make_cfg(["placement=fae", "placement.hot_rate=1.5"]))
    with pytest.raises(ConfigError, match="placement.profile_fraction"):
        load_config(make_cfg(["placement=fae", "placement.profile_fraction=0"]))


# ---------------------------------------------------------------------------- parity
@pytest.mark.dist
def test_replicated_rows_are_exact_against_the_plain_reference():
    """No reordering: W = 2 with the hot rows replicated == W = 1 with nothing replicated."""
    ref = run_single(BASE + ["optim=adagrad"])
    got = run_world(2, FAE + ["optim=adagrad", "placement.hot_batches=false"])
    for res in got:
        assert_same_run(ref, res)
    s = got[0].summary
    assert s["placement"]["hot_rows"] > 0 and s["bytes"]["replica"] > 0 and s["bytes"]["rows"] > 0


@pytest.mark.dist
@pytest.mark.parametrize("world,extra", [(2, ["optim=sgd"]), (3, ["optim=adagrad", "cache=lru"]),
                                         (2, ["optim=sgd", "train.pipeline=ids"])])
def test_fae_parity_and_hot_steps_run_no_alltoall(world, extra):
    """Also pipelined: a hot step prepares the cold step after it (whose requests are sent during
    the hot step); those alltoalls count for the cold step."""
    ref = run_single(FAE + extra)
    got = run_world(world, FAE + extra)
    for res in got:
        assert_same_run(ref, res)
        p = res.summary["placement"]
        assert p["hot_steps"] == ref.summary["placement"]["hot_steps"] > 0
        assert p["alltoalls_in_hot_steps"] == 0  # counted on every rank
        assert p["alltoalls_in_cold_steps"] > 0
    s = got[0].summary
    assert s["placement"]["hot_rows"] > 0 and s["bytes"]["replica"] > 0
    for res in got:  # the eval logits within the parity tolerance, the AUC within the pairs they let turn
        assert_same_eval(ref, res)
