"""The best-model snapshot with dynamic tables (a validation split, train.early_stop.restore_best):
the restore puts back the pool as it was at the best evaluation (which id holds which slot, in
which life, with its row; slots taken by other ids after it given back), so the final test
evaluation of the restored model is the evaluation of the model at the best step
(docs/dynamic.md, "Validation split and the best model").

train.early_stop.min_delta=1 makes the first validation evaluation (step 4) the best, so the
restore always has 12 steps of evictions and admissions to undo.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (assert_auc_close, assert_same_eval, eval_label_counts, make_cfg, run_single, spawn,
                     train_worker)
from dynamic_helpers import BASE as DYN, NO_EVICTION, assert_same_ids
from parity_helpers import assert_same_run, same_model, until_best
from trainer.base.comm import LocalCollectives
from trainer.run.resolve.configure import load_config
from trainer.run.runner import Trainer

VAL = ["data.train_samples=960", "data.val_fraction=0.25", "train.eval_every=4", "train.early_stop.patience=0",
       "train.early_stop.min_delta=1"]
EVICT = ["embedding.capacity=30", "embedding.admit_after=2", "optim=adagrad"]


def pool_of(st) -> dict[str, torch.Tensor]:
    ids, slots = st.pool.map.items()
    return {"slot_gid": st.pool.slot_gid.clone(), "version": st.version.clone(), "weight": st.weight.clone(),
            "map": torch.stack([ids, slots])}


@pytest.mark.parametrize("snapshot", ["memory", "disk"])
def test_the_restore_puts_back_the_pool_and_rows_of_the_best_step(snapshot, tmp_path):
    """W = 1, 30-row pools: snapshot at step 4, 12 more steps (slots reassigned to other ids, ids
    evicted and readmitted in new lives), restore: every slot's id, version and row, the id -> slot
    map and the free slots are those of step 4, and the test evaluation equals step 4's."""
    t = Trainer(load_config(make_cfg(DYN + EVICT + VAL + [f"train.early_stop.snapshot={snapshot}"])),
                LocalCollectives(), str(tmp_path))
    st = t.emb.store
    for s in range(4):
        t.train_step(s)
    t.best.take(4)
    at_best, free = pool_of(st), (list(st.pool._free_from), [h.clone() for h in st.pool._holes])
    test_at_best = t.evaluator.predict("test")
    for s in range(4, 16):
        t.train_step(s)
    moved = (st.pool.slot_gid != at_best["slot_gid"]) & (at_best["slot_gid"] >= 0)
    assert int(moved.sum()) > 30  # slots now held by other ids than at step 4
    relived = (st.pool.slot_gid == at_best["slot_gid"]) & (st.version >> 32 != at_best["version"] >> 32)
    assert bool((relived & (at_best["slot_gid"] >= 0)).any())  # the same id in the same slot, another life
    assert t.best.restore(t.comm) > 0
    for k, v in pool_of(st).items():
        assert torch.equal(v, at_best[k]), k
    assert st.pool._free_from == free[0] and all(torch.equal(a, b) for a, b in zip(st.pool._holes, free[1]))
    held = at_best["slot_gid"] >= 0
    slots, miss = st.pool.lookup(at_best["slot_gid"][held])
    assert not bool(miss.any()) and torch.equal(slots, torch.nonzero(held).squeeze(1))
    np.testing.assert_array_equal(t.evaluator.predict("test"), test_at_best)
    t.close()


def two_runs_worker(rank: int, world: int, runs: list[list[str]]) -> list:
    return [train_worker(rank, world, o, True) for o in runs]


@pytest.mark.dist
def test_w2_restores_the_best_pool_and_equals_the_single_process():
    """W = 2 with evictions: the run restored to its best step (4 of 16) ends with the very model
    (dense, every admitted id and row) and test metrics of the same run stopped at step 4, though
    hundreds of ids were evicted and admitted after it. Without evictions (W = 2 equals one
    process then) the restored model, its test metrics and the validation record equal the single
    process's."""
    evict, plain = DYN + EVICT + VAL, DYN + NO_EVICTION + VAL + ["embedding.admit_after=2", "optim=adagrad"]
    res = spawn(2, two_runs_worker, [evict, until_best(evict, 4), plain])
    ref = run_single(plain)
    for r, (full, until, same) in enumerate(res):
        s = full.summary
        assert s["early_stop"]["restored"] and s["best_step"] == 4 and s["steps"] == 16
        assert_same_ids(until, full)
        same_model(until.state, full.state, rtol=0, atol=0)
        assert (s["test_auc"], s["test_logloss"]) == (until.summary["test_auc"], until.summary["test_logloss"])
        assert same.summary["early_stop"]["restored"] and same.summary["best_step"] == 4
        assert_same_ids(ref, same)
        assert_same_run(ref, same)
        assert_same_eval(ref, same)  # test logits within the parity tolerance, AUC within the pairs they let turn
        assert same.summary["test_logloss"] == pytest.approx(ref.summary["test_logloss"], rel=1e-5)
        assert_auc_close(same.summary["val_auc"], ref.summary["val_auc"], *eval_label_counts(plain, "val"))
    d, d4 = res[0][0].summary["dynamic"], res[0][1].summary["dynamic"]
    assert d["evictions"] > d4["evictions"] + 300  # the pool after the best step was another
    assert d["admissions"] - d["evictions"] == d["rows_in_use"]  # the block is the pool as trained
