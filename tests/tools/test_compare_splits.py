"""dev/recipe_study/compare_splits.py on the suite's Criteo-format sample: K train / test splits of the raw file, each
prepared, the LR baseline and the default command per model on each, one JSON line per result."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_helpers import N_TRAIN, sample_lines
from dev.recipe_study.splits import split_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dev.recipe_study import compare_splits  # noqa: E402

FAST = ["data.max_table_rows=1000", "data.epochs=3", "data.loader=memmap", "train.threads=1", "train.ensemble=1"]


def test_split_one_is_the_file_order_and_the_others_shuffle():
    lines = sample_lines()
    test_rows = len(lines) - N_TRAIN
    train, test = split_lines(lines, 1, test_rows)
    assert train == lines[:N_TRAIN] and test == lines[N_TRAIN:]
    train2, test2 = split_lines(lines, 2, test_rows)
    assert len(train2) == N_TRAIN and sorted(train2 + test2) == sorted(lines) and test2 != test
    assert split_lines(lines, 2, test_rows) == (train2, test2)  # deterministic
    for bad in (0, len(lines)):
        with pytest.raises(ValueError, match="test-rows"):
            split_lines(lines, 1, bad)


def test_each_split_against_its_own_baseline(sample_file, tmp_path, capsys):
    work = tmp_path / "work"
    assert compare_splits.main([sample_file, "--splits", "2", "--models", "dlrm", "--work", str(work), *FAST]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines()]
    assert len(lines) == 5
    lr1, run1, lr2, run2, total = lines
    for k, lr, r in ((1, lr1, run1), (2, lr2, run2)):
        assert lr["split"] == k and lr["baseline"] == "lr" and lr["train_rows"] == N_TRAIN and lr["test_rows"] == 399
        assert r["split"] == k and r["model"] == "dlrm" and r["recipe"] == "tiny"
        assert r["auc_vs_lr"] == pytest.approx(r["test_auc"] - lr["test_auc"], abs=1e-12)
        assert r["logloss_vs_lr"] == pytest.approx(r["test_logloss"] - lr["test_logloss"], abs=1e-12)
        assert (work / f"split{k}" / "prepared" / "meta.json").exists()
    assert lr1["test_auc"] != lr2["test_auc"]  # other test rows
    assert total["model"] == "dlrm" and total["splits"] == 2
    assert total["auc_vs_lr"]["mean"] == pytest.approx(np.mean([run1["auc_vs_lr"], run2["auc_vs_lr"]]))
    assert total["logloss_vs_lr"]["max"] == max(run1["logloss_vs_lr"], run2["logloss_vs_lr"])
    assert total["splits_at_or_above_lr_auc"] == sum(r["auc_vs_lr"] >= 0 for r in (run1, run2))
    assert total["splits_at_or_below_lr_logloss"] == sum(r["logloss_vs_lr"] <= 0 for r in (run1, run2))
    assert "split 2/2: dlrm" in captured.err


def test_first_starts_at_a_later_split(sample_file, tmp_path, capsys):
    work = tmp_path / "work"
    assert compare_splits.main([sample_file, "--first", "3", "--splits", "1", "--models", "dlrm", "--work", str(work),
                                *FAST]) == 0
    captured = capsys.readouterr()
    lr, run, total = [json.loads(x) for x in captured.out.splitlines()]
    assert lr["split"] == 3 and run["split"] == 3 and total["splits"] == 1
    assert sorted(os.listdir(work)) == ["split3"]
    train, test = split_lines(sample_lines(), 3, 399)
    with open(work / "split3" / "test.tsv", encoding="utf-8") as f:
        assert f.readlines() == test
    assert "split 3/3: dlrm" in captured.err


def test_a_given_test_file_is_split_one_as_given(sample_file, tmp_path, capsys):
    # TRAIN.tsv --test TEST.tsv: the pair as it is, one split. The sample's first 1,600 lines and the
    # rest are split 1 of the whole file (file order), so both ways give the same rows and results.
    lines = sample_lines()
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    train.write_text("".join(lines[:N_TRAIN]))
    test.write_text("".join(lines[N_TRAIN:]))
    work = tmp_path / "work"
    assert compare_splits.main([str(train), "--test", str(test), "--models", "dlrm", "--work", str(work), *FAST]) == 0
    given = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert compare_splits.main([sample_file, "--splits", "1", "--models", "dlrm", "--work", str(tmp_path / "w1"), *FAST]) == 0
    whole = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for r in given + whole:
        r.pop("seconds", None)  # wall time, the one field that differs
    assert given == whole and given[0]["train_rows"] == N_TRAIN and given[0]["test_rows"] == len(lines) - N_TRAIN
    assert (work / "split1" / "test.tsv").read_text() == "".join(lines[N_TRAIN:])
    for extra in (["--splits", "2"], ["--first", "3"], ["--test-rows", "100"]):
        assert compare_splits.main([str(train), "--test", str(test), *extra, "--models", "dlrm"]) == 2
        assert f"{extra[0]}: with --test" in capsys.readouterr().err
    assert compare_splits.main([str(train), "--test", str(tmp_path / "none.tsv"), "--models", "dlrm"]) == 2
    assert "none.tsv" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(sample_file, tmp_path, capsys):
    assert compare_splits.main([str(tmp_path / "missing.tsv"), "--splits", "1"]) == 2
    assert "missing.tsv" in capsys.readouterr().err
    assert compare_splits.main([sample_file, "--test-rows", "0", "--models", "dlrm"]) == 2
    assert "--test-rows 0" in capsys.readouterr().err
    assert compare_splits.main([sample_file, "--first", "0", "--models", "dlrm"]) == 2
    assert "--first 0" in capsys.readouterr().err


def test_models_and_overrides_are_checked_before_any_work(sample_file, tmp_path, capsys):
    # `--models wdl deepfm` takes one name; "deepfm" lands among the overrides. Refused before a
    # split is prepared (--work stays empty), with the comma-separated form to use instead.
    work = tmp_path / "work"
    assert compare_splits.main([sample_file, "--models", "wdl", "deepfm", "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert "override 'deepfm' is not key=value" in err and "--models wdl,deepfm" in err
    assert not work.exists()
    assert compare_splits.main([sample_file, "--models", "dlrm,xdeepfm", "--work", str(work)]) == 2
    assert "'xdeepfm' is not a model" in capsys.readouterr().err
    assert compare_splits.main([sample_file, "--models", ",", "--work", str(work)]) == 2
    assert "no model named" in capsys.readouterr().err
    assert compare_splits.main([sample_file, "--models", "dlrm", "train.ensemble", "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert "override 'train.ensemble' is not key=value" in err and "--models" not in err
    assert not work.exists()
