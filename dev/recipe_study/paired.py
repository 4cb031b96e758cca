"""Two settings compared split by split: the paired difference of two dev/recipe_study/compare_splits.py runs.

Why: on a few thousand Criteo rows a model's difference to logistic regression moves by ~0.02 AUC
from one 399-row test split to the next, so two settings compared through their means against LR
need many splits to tell ~0.003 apart. Run on the same splits (the same training and test rows),
most of that noise is the test rows' own and cancels in the per-split difference: over 16 splits
the standard error of a paired AUC difference was 0.0003-0.0019, against ~0.003 for a difference
to LR (README, "32 splits, and settings compared split by split"). This reads the JSON lines of
two compare_splits runs (the base, then the new setting), matches their runs by (model, split) and
gives, per model, the mean, standard error and spread of new - base (test AUC and logloss), on how
many splits the new one was higher / lower, and the mean over the first and the second half of the
splits (a gain that holds on both halves is less likely a lucky pick).

A split whose LR figures differ between the two files did not have the same rows in both runs
(another file, other --test-rows, or data.train_samples: other training rows). The difference is
still paired on that split's test rows when only the training rows changed; each such split is
named on stderr and counted in `baseline_differs`.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Iterable, Optional

import numpy as np

from dev.recipe_study.rotations import _spread

BASELINE_TOL = 1e-9  # LR's test AUC / logloss on a split: equal up to float printing, else other rows


class PairedInputError(ValueError):
    """A file that is no compare_splits output, or two with no run in common."""


def read_records(path: str) -> list[dict[str, Any]]:
    """The JSON records of a compare_splits output file (blank lines skipped; a line that is not
    JSON is an error naming the file and line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise PairedInputError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
    return out


def _runs(records: Iterable[dict[str, Any]], name: str) -> tuple[dict[tuple[str, int], dict], dict[int, dict]]:
    """({(model, split): run}, {split: LR baseline}) of one file's records."""
    runs: dict[tuple[str, int], dict] = {}
    lr: dict[int, dict] = {}
    for r in records:
        if r.get("baseline") == "lr" and "split" in r:
            lr[int(r["split"])] = r
        elif "model" in r and "split" in r and "test_auc" in r:
            key = (str(r["model"]), int(r["split"]))
            if key in runs:
                raise PairedInputError(f"{name}: model {key[0]} has two runs on split {key[1]}")
            runs[key] = r
    if not runs:
        raise PairedInputError(f"{name}: no run records (one JSON line per run, as dev/recipe_study/compare_splits.py prints)")
    return runs, lr


def _stats(d: np.ndarray) -> dict[str, float]:
    """compare_splits' mean / min / max, and the standard error of the mean."""
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("nan")
    return {**_spread(d), "se": se}


def _same(a: Optional[dict], b: Optional[dict]) -> bool:
    if a is None or b is None:
        return True  # nothing to compare with: the file kept no baseline line
    return all(abs(float(a[k]) - float(b[k])) <= BASELINE_TOL for k in ("test_auc", "test_logloss"))


def paired(base: list[dict[str, Any]], new: list[dict[str, Any]], base_name: str = "base",
           new_name: str = "new", warn: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """One record per model that both files ran on at least one common split: new - base, paired by
    split (see the module doc). warn() hears of the splits and models only one file has, and of the
    splits whose baselines differ."""
    warn = warn or (lambda msg: None)
    a, lr_a = _runs(base, base_name)
    b, lr_b = _runs(new, new_name)
    common = sorted(set(a) & set(b))
    if not common:
        raise PairedInputError(f"{base_name} and {new_name} have no (model, split) run in common")
    only = sorted(set(a) ^ set(b))
    if only:
        warn(f"{len(only)} runs are in one file only and left out: "
             + ", ".join(f"{m} split {k}" for m, k in only[:8]) + (" ..." if len(only) > 8 else ""))
    differs = sorted({k for _, k in common if not _same(lr_a.get(k), lr_b.get(k))})
    if differs:
        warn(f"splits {differs}: LR's figures differ between the files (other training rows or data); "
             "their differences are paired on the test rows only")
    out = []
    for model in dict.fromkeys(m for m, _ in common):
        keys = [k for k in common if k[0] == model]
        auc = np.asarray([b[k]["test_auc"] - a[k]["test_auc"] for k in keys], dtype=np.float64)
        ll = np.asarray([b[k]["test_logloss"] - a[k]["test_logloss"] for k in keys], dtype=np.float64)
        half = len(keys) // 2
        out.append({
            "model": model, "splits": len(keys), "first_split": keys[0][1], "last_split": keys[-1][1],
            "auc_diff": _stats(auc), "logloss_diff": _stats(ll),
            "splits_higher_auc": int((auc > 0).sum()), "splits_lower_logloss": int((ll < 0).sum()),
            "auc_diff_halves": [float(auc[:half].mean()), float(auc[half:].mean())] if half else None,
            "base_auc_vs_lr": _mean_vs_lr(a, keys), "new_auc_vs_lr": _mean_vs_lr(b, keys),
            "baseline_differs": sum(k[1] in differs for k in keys),
        })
    return out


def _mean_vs_lr(runs: dict[tuple[str, int], dict], keys: list[tuple[str, int]]) -> Optional[float]:
    vals = [runs[k].get("auc_vs_lr") for k in keys]
    return float(np.mean(vals)) if all(v is not None for v in vals) else None
