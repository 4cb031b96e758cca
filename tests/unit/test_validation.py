"""Validation-driven training: the validation split is carved from the training rows of
every data source (never from the test split), early stopping on validation AUC stops W = 1 and
W = 2 at the same step with the same model (BSP, real gloo processes), and the best model restored
for the final test evaluation is exactly the model of the best step, flushed cache rows included.

How "the restored model is the best step's" is checked: a second run with the same evaluations but
no early stop and no restore, stopped at the best step, must end with the very same model (dense
and every table row) and the same test metrics. Dropout is 0 in the parity runs (README: masks are
drawn per rank, so W = 1 and W = 2 differ with dropout on).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_auc_close, assert_same_eval, eval_label_counts, make_cfg, run_single, run_world
from parity_helpers import ES, assert_same_run, same_model, until_best
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data


def _val_aucs(s: dict) -> list[tuple[int, float]]:
    return [(ev["step"], ev["eval_auc"]) for ev in s["evals"] if ev.get("split") == "val"]


def _assert_same_validations(got: dict, ref: dict, n_pos: int, n_neg: int) -> None:
    """Another W's validation evaluations: at the same steps, each AUC within one pair of the
    reference's (a rank statistic: a last-bit difference of a logit can order one pair otherwise)."""
    assert [k for k, _ in _val_aucs(got)] == [k for k, _ in _val_aucs(ref)]
    for (k, a), (_, b) in zip(_val_aucs(got), _val_aucs(ref)):
        assert_auc_close(a, b, n_pos, n_neg, pairs=1)
    assert_auc_close(got["val_auc"], ref["val_auc"], n_pos, n_neg, pairs=1)


def _assert_clear_decisions(s: dict, n_pos: int, n_neg: int) -> None:
    """Every early-stopping decision of this run (a new best or not: AUC > best + min_delta) holds
    by more than two pairs, so a run whose validation AUCs are within one pair of these takes the
    same decisions (the same best step and stop): W = 2's equality to them does not rest on the
    order of a sum."""
    min_delta, best = s["config"]["train"]["early_stop"]["min_delta"], None
    for k, auc in _val_aucs(s):
        if best is not None:
            margin = abs(auc - (best + min_delta)) * n_pos * n_neg
            assert margin > 2, f"step {k}: validation AUC {auc} is {margin:.2f} pairs from the best {best} + min_delta"
        if best is None or auc > best + min_delta:
            best = auc


@pytest.mark.dist
def test_early_stop_restores_the_best_step_and_w2_equals_w1():
    ref = run_single(ES)
    s = ref.summary
    e = s["early_stop"]
    assert e["stopped_early"] and e["restored"] and s["steps"] == e["stopped_at"] < 80
    assert s["best_step"] % 4 == 0 and s["best_step"] < s["steps"]
    assert len(ref.losses) == s["steps"] and s["config"]["train"]["steps"] == 80
    vals = [ev for ev in s["evals"] if ev.get("split") == "val"]
    assert [ev["step"] for ev in vals] == list(range(4, s["steps"] + 1, 4))
    assert all(ev["eval_samples"] == 120 for ev in vals) and s["val_samples"] == 120
    best = max(vals, key=lambda ev: ev["eval_auc"])
    assert best["step"] == s["best_step"] and s["val_auc"] == best["eval_auc"]
    assert s["test_auc"] == s["eval_auc"] and s["eval_samples"] == 480
    # the restored model is the model of the best step
    plain = run_single(until_best(ES, s["best_step"]))
    same_model(plain.state, ref.state, rtol=0, atol=0)
    assert plain.summary["test_auc"] == s["test_auc"] and plain.summary["test_logloss"] == s["test_logloss"]
    assert not plain.summary["early_stop"]["restored"]
    # W = 2 (here with the HET cache at BSP, exact too): same stop, same best step, same model, its
    # test logits within the parity tolerance; every validation AUC within one (positive, negative)
    # pair, and each early-stopping decision clearer than that (_assert_clear_decisions)
    val = eval_label_counts(ES, "val")
    _assert_clear_decisions(s, *val)
    for r in run_world(2, ES + ["cache=lru"]):
        assert (r.summary["steps"], r.summary["best_step"]) == (s["steps"], s["best_step"])
        assert r.summary["early_stop"]["restored"]
        assert_same_run(ref, r)
        assert_same_eval(ref, r)
        _assert_same_validations(r.summary, s, *val)
    # pipelined (train.pipeline=ids, with the cache): the same stop and model; the step prepared
    # ahead of the early stop is never run (its begun read is waited for and dropped)
    for r in run_world(2, ES + ["train.pipeline=ids", "cache=lru"]):
        assert (r.summary["steps"], r.summary["best_step"]) == (s["steps"], s["best_step"])
        assert_same_run(ref, r)
        assert_same_eval(ref, r)
        _assert_same_validations(r.summary, s, *val)


@pytest.mark.dist
def test_best_restore_includes_cached_rows():
    """W = 2 with the HET cache at bounded staleness (pushes held back up to 4 updates): the best
    model restored at the end holds every update made before the best step, the ones that were
    still pending in a worker's cache at that evaluation included (the evaluation flushed them)."""
    over = ES + ["cache=lru", "consistency=ssp", "cache.capacity_fraction=0.5"]
    runs = run_world(2, over)
    s = runs[0].summary
    assert s["early_stop"]["restored"] and s["best_step"] < s["steps"]
    assert s["cache"]["pushed_updates"] > s["cache"]["pushed_rows"] > 0  # updates really waited in caches
    plain = run_world(2, until_best(over, s["best_step"]))
    for r, p in zip(runs, plain):
        same_model(p.state, r.state, rtol=0, atol=0)
        assert r.summary["test_auc"] == p.summary["test_auc"]


def test_validation_split_is_carved_from_the_training_rows_of_every_source():
    """synthetic: the last training samples; movielens: the last training rows of its seeded order;
    neither touches the eval split, and the training stream no longer visits the validation rows."""
    c = load_config(make_cfg(["data=tiny", "data.train_samples=100", "data.val_fraction=0.2"]))
    d = make_data(c, 0, 1)
    assert d.val_rows == 20 and d.n_train == 80
    assert set(np.concatenate([d.train_indices(s) for s in range(3)])) <= set(range(80))
    val = list(d.eval_batches("val"))
    assert sum(b.batch_size for b in val) == 20
    want = d.samples(0, np.arange(80, 100))  # training samples 80..99
    assert torch.equal(torch.cat([b.labels for b in val]), want.labels)
    # W = 2: each rank yields the same number of batches, together the whole validation split
    parts = [list(make_data(c, r, 2).eval_batches("val")) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) and sum(b.batch_size for p in parts for b in p) == 20

    ml = ["data=movielens", "data.val_fraction=0.1", "data.train_samples=5000"]
    m = make_data(load_config(make_cfg(ml)), 0, 1)
    assert m.val_rows == 500 and m.train_rows == 4500
    assert not set(m.val_idx) & set(m.train_idx) and not set(m.val_idx) & set(m.eval_idx)
    whole = make_data(load_config(make_cfg(ml[:1] + ml[2:])), 0, 1)  # no validation split
    assert list(whole.train_idx) == list(m.train_idx) + list(m.val_idx)
    assert list(whole.eval_idx) == list(m.eval_idx)
    sizes = [sum(b.batch_size for b in make_data(load_config(make_cfg(ml)), r, 2).eval_batches("val"))
             for r in range(2)]
    assert sum(sizes) == 500


def test_criteo_standardize_uses_the_training_rows_only(prepared):
    """data.standardize (the small recipe's): every split's dense features are (x - mean) / std with
    the statistics of the training rows, the validation tail and the test split left out."""
    from trainer.workload.data.criteo import from_block
    over = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", "data.shuffle=false", "data.batch_size=1440",
            "data.val_fraction=0.1"]
    on, off = (make_data(load_config(make_cfg(over + [f"data.standardize={v}"])), 0, 1) for v in ("true", "false"))
    raw = np.concatenate([from_block(np.load(s.file)[s.lo:s.hi])[1] for s in on.source.train_segs])
    assert raw.shape == (1440, 13)
    mean, std = raw.astype(np.float64).mean(0), raw.astype(np.float64).std(0)
    std = np.where(std > 1e-12, std, 1.0)
    np.testing.assert_allclose(on.source.norm[0].numpy(), mean, rtol=1e-6, atol=1e-6)
    got, plain = on.train_batch(0).dense.numpy(), off.train_batch(0).dense.numpy()
    np.testing.assert_allclose(got, (plain - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.mean(0), 0, atol=1e-5)
    test_on, test_off = next(on.eval_batches()).dense.numpy(), next(off.eval_batches()).dense.numpy()
    np.testing.assert_allclose(test_on, (test_off - mean) / std, rtol=1e-5, atol=1e-5)
    assert abs(test_on.mean()) > 1e-4  # the test split's own statistics were not used


def test_criteo_val_slice_holds_out_another_slice_of_the_training_rows(prepared):
    """data.val_slice = j: the j-th slice of val_fraction from the end is the validation split, the
    training rows are all the others in file order (dev/recipe_study/val_rotations.py runs one per slice)."""
    from trainer.workload.data.criteo import from_block
    over = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", "data.shuffle=false", "train.ensemble=1"]

    def rows(segs):
        return np.concatenate([np.load(s.file)[s.lo:s.hi] for s in segs])

    whole = rows(make_data(load_config(make_cfg(over + ["data.val_fraction=0"])), 0, 1).source.train_segs)
    assert len(whole) == 1600
    for j in (1, 2, 10):
        d = make_data(load_config(make_cfg(over + ["data.val_fraction=0.1", f"data.val_slice={j}"])), 0, 1)
        lo, hi = 1600 - j * 160, 1600 - (j - 1) * 160
        assert np.array_equal(rows(d.source.val_segs), whole[lo:hi])
        assert np.array_equal(rows(d.source.train_segs), np.concatenate([whole[:lo], whole[hi:]]))
        assert d.val_rows == 160
        labels = torch.cat([b.labels for b in d.eval_batches("val")]).numpy()
        assert np.array_equal(labels, from_block(whole[lo:hi])[0])
    with pytest.raises(ConfigError, match="data.val_slice=11.*does not fit in 1600 training rows"):
        make_data(load_config(make_cfg(over + ["data.val_fraction=0.1", "data.val_slice=11"])), 0, 1)
    with pytest.raises(ConfigError, match="data.val_slice=2.*data=criteo option"):
        load_config(make_cfg(["data=tiny", "data.train_samples=100", "data.val_fraction=0.2", "data.val_slice=2"]))


def test_resume_keeps_the_early_stopping_state(tmp_path, capsys):
    """A checkpoint carries the early-stopping state: resuming from step 40 stops at the same step
    as the uninterrupted run; the best model of before the resume is not in memory (a snapshot is
    not part of a checkpoint), which the run says, testing the model it has."""
    ck = str(tmp_path / "ck")
    over = ES + [f"checkpoint.dir={ck}", "checkpoint.every=8", "checkpoint.keep_last=0"]
    whole = run_single(over, return_state=False).summary
    assert whole["steps"] == 44 and whole["best_step"] == 32
    resumed = run_single(over + [f"checkpoint.resume={ck}/step_00000040"], return_state=False).summary
    assert resumed["start_step"] == 40 and (resumed["steps"], resumed["best_step"]) == (44, 32)
    assert resumed["early_stop"]["stopped_early"] and not resumed["early_stop"]["restored"]
    assert resumed["early_stop"]["evaluated_model_step"] == 44
    assert "not in memory" in capsys.readouterr().err
    again = run_single(over + [f"checkpoint.resume={ck}/step_00000044"], return_state=False).summary
    assert again["steps"] == 44 and again["start_step"] == 44  # a stopped run stays stopped


# ---- calibration (train.calibrate) -------------------------------------------------------------
def test_fit_temperature_recovers_a_known_scale_and_ignores_row_order():
    from scipy.optimize import minimize_scalar

    from trainer.run.evaluation.metrics import TEMPERATURES, auc_logloss, fit_temperature

    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 3.0, 20_000)
    y = (rng.random(z.size) < 1.0 / (1.0 + np.exp(-0.4 * z))).astype(np.float32)  # true scale 0.4
    t, before, after = fit_temperature(z, y)
    assert abs(t - 0.4) < 0.03 and after < before
    assert before == pytest.approx(auc_logloss(z, y)[1], rel=1e-9)  # T = 1 is the plain logloss
    assert after == pytest.approx(auc_logloss(t * z, y)[1], rel=1e-9)

    def loss(s):
        return float(np.mean(np.logaddexp(0.0, s * z) - y * s * z))

    best = minimize_scalar(loss, bounds=(0.02, 5.0), method="bounded", options={"xatol": 1e-6}).x
    step = np.exp(np.diff(np.log(TEMPERATURES)).max())  # the grid's coarsest ratio
    assert best / step <= t <= best * step
    perm = rng.permutation(z.size)  # another W gathers the rows in another order: the same T
    assert fit_temperature(z[perm], y[perm]) == (t, before, after)
    assert auc_logloss(t * z, y)[0] == pytest.approx(auc_logloss(z, y)[0], abs=1e-12)  # AUC unchanged
    assert fit_temperature(np.zeros(0), np.zeros(0))[0] == 1.0


@pytest.mark.dist
def test_calibration_is_fitted_on_validation_only_and_w2_equals_w1():
    """The temperature comes from the restored best model's validation logits; the test AUC is
    the uncalibrated run's, only the test logloss moves; W = 2 fits the same temperature."""
    plain = run_single(ES, return_state=False).summary
    cal = run_single(ES + ["train.calibrate=true"], return_state=False).summary
    k = cal["calibration"]
    assert plain["calibration"] is None and k["val_samples"] == cal["val_samples"] == 120
    assert k["val_logloss_before"] == pytest.approx(cal["val_logloss"], rel=1e-6)  # the best model's
    assert k["val_logloss_after"] < k["val_logloss_before"] and k["temperature"] != 1.0
    assert cal["test_auc"] == pytest.approx(plain["test_auc"], abs=1e-12)
    assert cal["test_logloss"] != plain["test_logloss"]
    assert (cal["steps"], cal["best_step"]) == (plain["steps"], plain["best_step"])
    for r in run_world(2, ES + ["train.calibrate=true"], return_state=False):
        assert r.summary["calibration"]["temperature"] == k["temperature"]
        assert r.summary["test_logloss"] == pytest.approx(cal["test_logloss"], rel=1e-6)


def test_early_stopping_waits_for_min_evals():
    """train.early_stop.min_evals: a model still at its start can score below its first evaluation
    for a few epochs (seen at W = 2 on the sample: AUC 0.45 at the first epoch, lower for three
    more, stopped after 20 steps); no stop comes before min_evals evaluations, and the count is in
    the checkpointed state."""
    from trainer.run.evaluation.best import EarlyStopping

    def run(min_evals: int, aucs: list[float]) -> EarlyStopping:
        e = EarlyStopping(patience=3, min_delta=0.0, min_evals=min_evals)
        for k, auc in enumerate(aucs, 1):
            e.update(5 * k, {"eval_auc": auc})
            if e.stop:
                break
        return e

    start = [0.45, 0.43, 0.41, 0.43, 0.60, 0.70, 0.69, 0.68, 0.67, 0.66]
    assert run(0, start).stopped_at == 20 and run(0, start).best_step == 5
    late = run(5, start)
    assert late.stopped_at == 45 and late.best_step == 30 and late.best_auc == 0.70
    flat = run(5, [0.5] * 10)  # patience ran out at evaluation 4: the stop waits for the 5th
    assert flat.stopped_at == 25 and flat.best_step == 5
    again = EarlyStopping(3, 0.0, 5)
    again.load(run(5, start[:3]).state())
    assert again.evals == 3 and not again.stop
    old = EarlyStopping(3, 0.0, 5)  # a state saved before the count existed: no minimum
    old.load({k: v for k, v in run(5, start[:3]).state().items() if k != "evals"})
    assert old.evals == 5
    c = load_config(make_cfg(["data=tiny", "data.train_samples=100", "data.val_fraction=0.2"]))
    assert c.train.early_stop.min_evals == 0  # outside the criteo recipes


@pytest.mark.parametrize("n, decimals", [(7, None), (5_000, 1), (50_000, None)])
def test_auc_and_logloss_equal_scikit_learns(n, decimals):
    """trainer.run.evaluation.metrics computes AUC (average ranks: tied logits count one half) and log loss
    itself; both equal scikit-learn's on the probabilities, with ties, float32 logits and rows far
    in the tails; one class: no AUC; no rows: neither."""
    from sklearn.metrics import log_loss, roc_auc_score

    from trainer.run.evaluation.metrics import auc_logloss

    rng = np.random.default_rng(n)
    z = rng.normal(0.0, 3.0, n)
    z = (np.round(z, decimals) if decimals is not None else z).astype(np.float32)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
    auc, ll = auc_logloss(z, y)
    assert auc == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    assert ll == pytest.approx(log_loss(y, p, labels=[0.0, 1.0]), rel=1e-9)
    assert auc_logloss(np.array([3.0, -1.0, 2.0]), np.ones(3))[0] is None
    assert auc_logloss(np.zeros(0), np.zeros(0)) == (None, None)
    assert auc_logloss(np.array([1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0]))[0] == 0.75  # a tie counts half
