"""dev/recipe_study/val_rotations.py on the suite's Criteo-format sample: one run per validation slice (different
validation rows each time, the same test split), each compared with the LR baseline fitted once."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dev.recipe_study import val_rotations  # noqa: E402

FAST = ["data.max_table_rows=1000", "data.epochs=3", "data.loader=memmap", "train.threads=1"]


def test_one_run_per_slice_against_one_baseline(prepared, capsys):
    assert val_rotations.main([prepared, "--slices", "2", "--models", "dlrm", *FAST]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines()]
    lr, runs, total = lines[0], lines[1:3], lines[3]
    assert len(lines) == 4 and lr["baseline"] == "lr" and lr["val_slices"] == [1, 3]  # 5 slices of 320 rows
    assert lr["train_rows"] == 1600 and lr["test_rows"] == 399
    assert [r["val_slice"] for r in runs] == [1, 3] and all(r["model"] == "dlrm" for r in runs)
    for r in runs:
        assert r["auc_vs_lr"] == pytest.approx(r["test_auc"] - lr["test_auc"], abs=1e-12)
        assert r["logloss_vs_lr"] == pytest.approx(r["test_logloss"] - lr["test_logloss"], abs=1e-12)
        assert r["temperature"] is not None and r["best_step"] <= r["steps"]  # the small recipe's
    assert runs[0]["val_auc"] != runs[1]["val_auc"]  # other validation rows
    assert total["model"] == "dlrm" and total["runs"] == 2
    assert total["auc_vs_lr"]["mean"] == pytest.approx(np.mean([r["auc_vs_lr"] for r in runs]))
    assert total["logloss_vs_lr"]["min"] == min(r["logloss_vs_lr"] for r in runs)
    assert total["runs_at_or_above_lr_auc"] == sum(r["auc_vs_lr"] >= 0 for r in runs)
    assert "dlrm: validation slice 3 (2/2)" in captured.err


def test_no_validation_split_is_a_clear_error(prepared, capsys):
    assert val_rotations.main([prepared, "--models", "dlrm", "data.val_fraction=0", *FAST]) == 2
    assert "nothing to rotate" in capsys.readouterr().err


def test_models_given_apart_are_a_clear_error(prepared, capsys):
    assert val_rotations.main([prepared, "--models", "dlrm", "dcn", *FAST]) == 2
    assert "--models dlrm,dcn" in capsys.readouterr().err
