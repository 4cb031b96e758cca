"""Synthetic data and row sharding: determinism, slicing, skew, signal; owner/local-row mapping."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import make_cfg
from trainer.configure import load_config
from trainer.data import make_data
from trainer.data.synthetic import EVAL, zipf_rank
from trainer.embedding import RowSharding, plan_lookup


def _cfg(*extra):
    return load_config(make_cfg(["data=tiny", "data.global_batch_size=48", *extra]))


def test_rank_slices_concatenate_to_the_global_batch():
    c = _cfg()
    full = make_data(c, 0, 1).train_batch(5)
    parts = [make_data(c, r, 3).train_batch(5) for r in range(3)]
    assert torch.equal(torch.cat([p.values for p in parts]), full.values)
    assert torch.equal(torch.cat([p.lengths for p in parts]), full.lengths)
    assert torch.equal(torch.cat([p.dense for p in parts]), full.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), full.labels)


def test_deterministic_by_seed_and_different_across_seeds():
    a = make_data(_cfg(), 0, 1).train_batch(3)
    b = make_data(_cfg(), 0, 1).train_batch(3)
    c = make_data(_cfg("data.seed=7"), 0, 1).train_batch(3)
    assert torch.equal(a.values, b.values) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.dense, c.dense)


def test_ids_in_range_and_bags_respect_bounds():
    c = _cfg("data.min_bag=0", "data.max_bag=5")
    b = make_data(c, 0, 1).train_batch(0)
    assert b.lengths.min() >= 0 and b.lengths.max() <= 5 and (b.lengths == 0).any()
    rows = torch.tensor(c.data.table_rows)[b.table_index()]
    assert (b.values >= 0).all() and (b.values < rows).all()


def test_zipf_skew():
    n = np.full(200_000, 10_000)
    r = zipf_rank(np.random.default_rng(0).random(n.size), n, 1.1)
    counts = np.bincount(r, minlength=10_000)
    assert counts[0] > counts[1] > counts[10] > counts[1000]
    top = np.sort(counts)[::-1]
    assert top[:100].sum() / counts.sum() > 0.5  # the 1% hottest rows take most lookups
    assert r.min() >= 0 and r.max() < 10_000
    uniform = zipf_rank(np.linspace(0, 0.999999, 1000), np.full(1000, 10), 0.0)
    assert np.bincount(uniform).min() >= 99


def test_planted_signal_is_learnable():
    """Labels follow the planted weights: the Bayes logit alone separates classes well."""
    c = _cfg()
    d = make_data(c, 0, 1)
    b = d.samples(EVAL, np.arange(4000))
    assert 0.2 < b.labels.mean() < 0.8
    t = b.table_index().numpy()
    w = d.planted_weight(t, b.values.numpy())
    bag = np.repeat(np.arange(b.lengths.numel()), b.lengths.reshape(-1).numpy())
    bag_sum = np.bincount(bag, weights=w, minlength=b.lengths.numel()).reshape(b.lengths.shape)
    score = (bag_sum / np.maximum(b.lengths.numpy(), 1)).sum(1)  # the sparse half of the logit
    from sklearn.metrics import roc_auc_score
    assert roc_auc_score(b.labels.numpy(), score) > 0.65


def test_eval_split_is_covered_exactly_once_across_ranks():
    c = _cfg("data.eval_samples=1000", "data.eval_batch_size=96")
    per_rank = [list(make_data(c, r, 3).eval_batches()) for r in range(3)]
    assert len({len(x) for x in per_rank}) == 1  # same number of eval steps on every rank
    assert sum(b.batch_size for x in per_rank for b in x) == 1000


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_sharding_owner_and_local_rows(world):
    rows = [97, 1001, 13, 250]
    shards = [RowSharding(rows, world, r) for r in range(world)]
    seen = {}
    for r, s in enumerate(shards):
        gids = s.local_gids()
        valid = s.valid(gids)
        t, i = s.decode(gids[valid])
        for tt, ii in zip(t.tolist(), i.tolist()):
            assert ii % world == r  # owner = id mod W
            seen[(tt, ii)] = r
        assert torch.equal(s.local_index(gids), torch.arange(s.local_rows))
        assert s.local_rows - int(valid.sum()) <= len(rows)  # at most one padding row per table
    assert len(seen) == sum(rows)  # every row owned exactly once


def test_plan_lookup_dedups_and_groups_remote_by_owner():
    s = RowSharding([10, 10], 3, 1)
    values = torch.tensor([4, 4, 7, 1, 0, 9, 9, 2])
    table = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0])
    gids = s.global_ids(values, table)
    plan = plan_lookup(s, gids)
    assert torch.equal(plan.uniq[plan.inverse], gids)
    assert plan.uniq.numel() == len(set(gids.tolist()))
    assert plan.splits[1] == 0 and sum(plan.splits) == plan.remote_pos.numel()
    owners = s.owner(plan.remote_ids).tolist()
    assert owners == sorted(owners) and 1 not in owners
    assert set(s.owner(plan.owned_ids).tolist()) <= {1}
