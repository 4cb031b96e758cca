#!/usr/bin/env python
"""Logistic-regression baseline on a prepared Criteo directory (scripts/prepare_criteo.py --out DIR),
on exactly the rows the trainer trains and evaluates on (trainer/tools/baseline.py):

    scripts/baseline_lr.py DIR [data.key=value ...]             # one JSON line
    scripts/baseline_lr.py DIR --compare [trainer overrides ...] # also python -m trainer on DIR

Overrides are the trainer's (`python -m trainer data=criteo data.dir=DIR <overrides>`): the data.*
ones that pick rows (data.test_fraction, data.train_samples, data.test_samples, data.max_table_rows)
apply to the baseline too, so both always see the same splits. C is chosen on folds of the TRAIN
split (never on the eval split; --folds), then the model is refitted on the whole train split.
Output: train_rows, eval_rows, eval_auc, eval_logloss, C, seconds (+ the trainer's run and
trainer_auc - lr_auc with --compare). Exit status 2 on a bad directory or config, or without
scikit-learn (the `baseline` extra: pip install 'hybrid-trainer[baseline]').
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from trainer.tools.baseline import DEFAULT_CS, SOLVERS, compose, run_baseline
from trainer.tools.cli import bad_input, input_errors


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="directory written by scripts/prepare_criteo.py --out DIR")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (key=value), passed to the trainer with "
                                                 "--compare; data.* ones also select the baseline's rows")
    ap.add_argument("--C", dest="cs", type=_floats, default=list(DEFAULT_CS),
                    help="inverse regularisation strengths to try, comma-separated (one value: no search); "
                         f"default {','.join(map(str, DEFAULT_CS))}")
    ap.add_argument("--folds", type=int, default=0,
                    help="choose C by mean validation AUC over K contiguous folds of the TRAIN split; "
                         "1 = its last --val-fraction; 0 (default) = 5 below 1M training rows, else 1")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="--folds 1: last share of the TRAIN split used to choose C (default 0.1)")
    ap.add_argument("--solver", choices=SOLVERS, default="liblinear")
    ap.add_argument("--max-train-rows", type=int, default=0,
                    help="fit on the first N training rows only (0 = all; for Kaggle-size data)")
    ap.add_argument("--compare", action="store_true", help="also run python -m trainer on DIR and compare")
    ap.add_argument("--run-dir", default=None,
                    help="--compare: the trainer's hydra.run.dir, kept (default: a temporary one)")
    return ap.parse_intermixed_args(argv)


def run_trainer(directory: str, overrides: list[str], run_dir: str) -> dict:
    """`python -m trainer data=criteo data.dir=DIR <overrides>` in one process; its summary.json,
    with "_seconds" (the whole command's) and "_command". A failed run raises RuntimeError with its
    exit status and the end of its stderr."""
    cmd = [sys.executable, "-m", "trainer", "data=criteo", f"data.dir={directory}", "train.progress=off",
           f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the trainer failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    s["_seconds"], s["_command"] = round(wall, 3), " ".join(cmd[1:])
    return s


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        c = compose(a.dir, a.overrides)
        base = run_baseline(c, a.cs, a.folds, a.val_fraction, a.solver, a.max_train_rows)
    except input_errors() as exc:
        return bad_input(exc)
    if not a.compare:
        print(json.dumps(base))
        return 0
    with tempfile.TemporaryDirectory(prefix="baseline_lr_") as tmp:
        try:
            s = run_trainer(a.dir, a.overrides, a.run_dir or tmp)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    trainer = {"model": s["config"]["model"]["name"], "optim": s["config"]["optim"]["name"],
               "steps": s["steps"], "ensemble": len(s["ensemble"]["members"]) if s.get("ensemble") else 1,
               "eval_samples": s["eval_samples"], "eval_auc": s["eval_auc"],
               "eval_logloss": s["eval_logloss"], "seconds": s["_seconds"], "command": s["_command"]}
    if s["eval_samples"] != base["eval_rows"]:
        print(f"warning: the trainer evaluated {s['eval_samples']} rows, the baseline {base['eval_rows']}",
              file=sys.stderr)
    diff = None if s["eval_auc"] is None or base["eval_auc"] is None else s["eval_auc"] - base["eval_auc"]
    print(json.dumps({"lr_eval_auc": base["eval_auc"], "trainer_eval_auc": s["eval_auc"],
                      "trainer_minus_lr_auc": diff, "baseline": base, "trainer": trainer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
