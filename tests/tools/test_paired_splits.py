"""dev/recipe_study/paired_splits.py (dev/recipe_study/paired.py): two compare_splits outputs compared split by
split. Checked against a plain-Python computation on records written as compare_splits writes them."""
from __future__ import annotations

import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dev.recipe_study import paired_splits  # noqa: E402


def _records(aucs: dict[str, list[float]], lls: dict[str, list[float]], lr: list[tuple[float, float]]) -> list[dict]:
    """compare_splits' lines: per split its LR line, then one line per model; then the summaries."""
    out = []
    for k, (lr_auc, lr_ll) in enumerate(lr, 1):
        out.append({"split": k, "baseline": "lr", "test_auc": lr_auc, "test_logloss": lr_ll, "C": 0.1,
                    "train_rows": 1600, "test_rows": 399})
        for m in aucs:
            out.append({"split": k, "model": m, "test_auc": aucs[m][k - 1], "test_logloss": lls[m][k - 1],
                        "auc_vs_lr": aucs[m][k - 1] - lr_auc, "logloss_vs_lr": lls[m][k - 1] - lr_ll,
                        "recipe": "tiny", "seconds": 1.0})
    out += [{"model": m, "splits": len(lr)} for m in aucs]  # the per-model summaries carry no split
    return out


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


LR = [(0.70, 0.47), (0.73, 0.42), (0.74, 0.43), (0.77, 0.44)]


def test_paired_differences_against_a_plain_computation(tmp_path, capsys):
    base_auc = {"dlrm": [0.71, 0.72, 0.76, 0.76], "wdl": [0.70, 0.71, 0.75, 0.77]}
    base_ll = {"dlrm": [0.47, 0.43, 0.42, 0.44], "wdl": [0.48, 0.43, 0.42, 0.44]}
    new_auc = {"dlrm": [0.72, 0.72, 0.77, 0.75], "wdl": [0.70, 0.72, 0.76, 0.78]}
    new_ll = {"dlrm": [0.46, 0.44, 0.41, 0.44], "wdl": [0.47, 0.42, 0.41, 0.43]}
    a = _write(tmp_path / "a.jsonl", _records(base_auc, base_ll, LR))
    b = _write(tmp_path / "b.jsonl", _records(new_auc, new_ll, LR))
    assert paired_splits.main([a, b]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["model"] for r in out] == ["dlrm", "wdl"]
    for r in out:
        m = r["model"]
        d = [y - x for x, y in zip(base_auc[m], new_auc[m])]
        dl = [y - x for x, y in zip(base_ll[m], new_ll[m])]
        mean = sum(d) / 4
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / 3) / 2
        assert r["splits"] == 4 and (r["first_split"], r["last_split"]) == (1, 4)
        assert r["auc_diff"]["mean"] == pytest.approx(mean) and r["auc_diff"]["se"] == pytest.approx(se)
        assert (r["auc_diff"]["min"], r["auc_diff"]["max"]) == pytest.approx((min(d), max(d)))
        assert r["logloss_diff"]["mean"] == pytest.approx(sum(dl) / 4)
        assert r["splits_higher_auc"] == sum(x > 0 for x in d)
        assert r["splits_lower_logloss"] == sum(x < 0 for x in dl)
        assert r["auc_diff_halves"] == pytest.approx([sum(d[:2]) / 2, sum(d[2:]) / 2])
        assert r["base_auc_vs_lr"] == pytest.approx(sum(x - lr for x, (lr, _) in zip(base_auc[m], LR)) / 4)
        assert r["new_auc_vs_lr"] == pytest.approx(sum(x - lr for x, (lr, _) in zip(new_auc[m], LR)) / 4)
        assert r["baseline_differs"] == 0
    # the same file against itself: every difference is 0
    assert paired_splits.main([a, a]) == 0
    same = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all(r["auc_diff"]["mean"] == 0 and r["splits_higher_auc"] == 0 for r in same)


def test_only_common_runs_are_paired_and_other_rows_are_named(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _records({"dlrm": [0.71, 0.72, 0.76, 0.76]}, {"dlrm": [0.47, 0.43, 0.42, 0.44]}, LR))
    other_lr = [LR[0], (0.74, 0.41), LR[2]]  # split 2 with other training rows; no split 4
    b = _write(tmp_path / "b.jsonl", _records({"dlrm": [0.72, 0.73, 0.75]}, {"dlrm": [0.46, 0.43, 0.43]}, other_lr))
    assert paired_splits.main([a, b]) == 0
    captured = capsys.readouterr()
    (r,) = [json.loads(x) for x in captured.out.splitlines()]
    assert r["splits"] == 3 and r["auc_diff"]["mean"] == pytest.approx((0.01 + 0.01 - 0.01) / 3)
    assert r["baseline_differs"] == 1
    assert "dlrm split 4" in captured.err and "splits [2]" in captured.err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    good = _write(tmp_path / "a.jsonl", _records({"dlrm": [0.7]}, {"dlrm": [0.45]}, LR[:1]))
    assert paired_splits.main([good, str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"split": 1}\nnot json\n')
    assert paired_splits.main([good, str(broken)]) == 2
    assert "broken.jsonl:2" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", [{"split": 1, "baseline": "lr", "test_auc": 0.7, "test_logloss": 0.4}])
    assert paired_splits.main([good, empty]) == 2
    assert "no run records" in capsys.readouterr().err
    other = _write(tmp_path / "other.jsonl", _records({"wdl": [0.7]}, {"wdl": [0.45]}, LR[:1]))
    assert paired_splits.main([good, other]) == 2
    assert "no (model, split) run in common" in capsys.readouterr().err
    twice = _write(tmp_path / "twice.jsonl", _records({"dlrm": [0.7]}, {"dlrm": [0.45]}, LR[:1]) * 2)
    assert paired_splits.main([good, twice]) == 2
    assert "two runs on split 1" in capsys.readouterr().err
