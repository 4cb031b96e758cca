"""scripts/baseline_lr.py: the logistic-regression baseline on the prepared Criteo-format sample sees exactly
the trainer's train/eval rows (test split and held-out tail), reaches a sane AUC, chooses C on the
training split only, compares against a real trainer run, and fails clearly on a bad directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_helpers import N_TRAIN, prepare_sample
from helpers import make_cfg
from trainer.base.config import table_rows
from trainer.run.resolve.configure import load_config
from trainer.workload.data.blocks import CriteoData, memmap_reader
from trainer.tools.baseline import Features, Split, _folds, load_splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "baseline_lr.py")
N_ROWS = 1999
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import baseline_lr  # noqa: E402


@pytest.fixture(scope="module")
def prepared_tail(tmp_path_factory) -> str:
    """The whole sample as training file: the trainer holds out the last data.test_fraction."""
    out = tmp_path_factory.mktemp("criteo_lr_tail")
    prepare_sample(str(out), with_test=False)
    return str(out / "prepared")


def _trainer_split_rows(d: str, *overrides: str) -> tuple[int, int]:
    c = load_config(make_cfg(["data=criteo", f"data.dir={d}", "data.loader=memmap", *overrides]))
    data = CriteoData(c.data, table_rows(c), 0, 1, c.data.batch_size, memmap_reader(c.data.num_dense))
    # the baseline fits on every training row: the trainer's validation split is carved from them
    return data.train_rows + data.val_rows, sum(s.rows for s in data.eval_segs)


def _main_json(capsys, *argv: str) -> dict:
    assert baseline_lr.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_baseline_auc_on_the_real_criteo_sample(criteo_sample, tmp_path, capsys):
    """Real Criteo statistics: 1,600 rows of Criteo's own, the other 399 held out."""
    prepare_sample(str(tmp_path), source=criteo_sample)
    r = _main_json(capsys, str(tmp_path / "prepared"))
    assert (r["train_rows"], r["eval_rows"]) == (N_TRAIN, N_ROWS - N_TRAIN)
    assert 0.65 < r["eval_auc"] < 0.75 and 0.4 < r["eval_logloss"] < 0.55, r  # ~0.70 and ~0.49


def test_baseline_auc_and_split_sizes_match_the_trainer(prepared, capsys):
    r = _main_json(capsys, prepared)
    assert (r["train_rows"], r["eval_rows"]) == (N_TRAIN, N_ROWS - N_TRAIN)
    assert (r["train_rows"], r["eval_rows"]) == _trainer_split_rows(prepared)
    assert r["eval_auc"] > 0.6, r  # ~0.77 on this split
    assert 0 < r["eval_logloss"] < 0.69 and r["C"] in baseline_lr.DEFAULT_CS and r["folds"] == 5
    assert set(r["val_auc"]) == {repr(c) for c in baseline_lr.DEFAULT_CS} and r["seconds"] > 0


@pytest.mark.parametrize("overrides", [[], ["data.test_fraction=0.25"], ["data.train_samples=1000",
                                                                          "data.test_samples=150"]])
def test_held_out_tail_and_sample_limits_follow_the_trainer(prepared_tail, overrides):
    c = baseline_lr.compose(prepared_tail, overrides)
    train, evals = load_splits(c)
    assert (train.rows, evals.rows) == _trainer_split_rows(prepared_tail, *overrides)
    if not overrides:
        assert (train.rows, evals.rows) == (N_ROWS - 200, 200)  # ceil(0.1 * 1999) rows held out


def test_eval_rows_are_the_trainers_tail(prepared_tail):
    """Held-out tail: baseline train rows + eval rows are the sample's rows in file order."""
    train, evals = load_splits(baseline_lr.compose(prepared_tail, []))
    _, whole = load_splits(baseline_lr.compose(prepared_tail, ["data.test_fraction=0.99"]))
    both = np.concatenate([train.ids, evals.ids])
    assert np.array_equal(both[-whole.rows:], whole.ids) and np.array_equal(evals.ids, whole.ids[-evals.rows:])


def test_c_is_chosen_on_training_folds_only():
    for n, k in ((1600, 5), (1601, 3), (10, 1)):
        folds = _folds(n, k, 0.1)
        vals = np.concatenate([v for _, v in folds])
        assert len(folds) == k and vals.max() < n
        for fit, val in folds:
            assert np.intersect1d(fit, val).size == 0 and fit.size + val.size == n
        if k > 1:
            assert np.array_equal(np.sort(vals), np.arange(n))
    assert _folds(10, 1, 0.1)[0][1].tolist() == [9]


def test_one_hot_columns_are_the_training_ids():
    """Each row has F dense + one 1 per (table, id) seen in training; unseen eval ids have no column."""
    rng = np.random.default_rng(0)
    train = Split(rng.integers(0, 2, 50).astype(np.float32), rng.random((50, 3), np.float32),
                  rng.integers(0, 4, (50, 2)))
    feats = Features(train, [5, 5])
    x = feats(train).toarray()
    assert x.shape == (50, 3 + len(np.unique(train.ids[:, 0])) + len(np.unique(train.ids[:, 1])))
    assert np.allclose(x[:, :3].mean(0), 0, atol=1e-6) and (x[:, 3:].sum(1) == 2).all()
    unseen = Split(np.zeros(1, np.float32), np.zeros((1, 3), np.float32), np.array([[4, 0]]))
    assert feats(unseen).toarray()[0, 3:].sum() == (1 if 0 in train.ids[:, 1] else 0)


def test_compare_runs_the_trainer_on_the_same_rows(prepared, capsys):
    r = _main_json(capsys, prepared, "--compare", "--C", "0.03", "data.loader=memmap", "data.epochs=0",
                   "train.steps=3", "model=wdl")
    t = r["trainer"]
    # the default command: the tiny recipe's bag of 5 models, 3 steps each
    assert t["model"] == "wdl" and t["ensemble"] == 5 and t["steps"] == 5 * 3 and t["eval_samples"] == r["baseline"]["eval_rows"]
    assert r["lr_eval_auc"] == r["baseline"]["eval_auc"] and r["baseline"]["C"] == 0.03
    assert r["trainer_minus_lr_auc"] == pytest.approx(r["trainer_eval_auc"] - r["lr_eval_auc"])


def test_missing_directory_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope")
    p = subprocess.run([sys.executable, SCRIPT, missing], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "is not a directory" in p.stderr
    assert missing in p.stderr and p.stdout == ""


def test_without_scikit_learn_one_line_names_the_extra(prepared, capsys, monkeypatch):
    """scikit-learn comes with the `baseline` extra: without it the script says so in one line."""
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what importlib finds when it is not installed
    assert baseline_lr.main([prepared]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "scikit-learn" in err and "pip install 'hybrid-trainer[baseline]'" in err, err


def test_directory_without_metadata_is_a_clear_error(tmp_path, capsys):
    assert baseline_lr.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "meta.json is missing" in err and "prepare_criteo.py" in err
