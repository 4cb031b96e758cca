"""The default command of every model against logistic regression on K train / test splits of one
raw Criteo TSV (dev/recipe_study/splits.py): how the recipe compares with LR, as a mean over splits
rather than on one noisy test split.

    python -m dev.recipe_study.compare_splits FILE.tsv [--splits 8] [--first 1] [--test-rows 399]
        [--models dlrm,wdl,deepfm,dcn] [--work DIR] [trainer overrides ...]
    python -m dev.recipe_study.compare_splits TRAIN.tsv --test TEST.tsv [--models ...] [--work DIR]
        [trainer overrides ...]

Split 1 keeps the file's order (the last --test-rows lines test), split k > 1 shuffles the lines
with random.Random(k - 1) first; --first N runs splits N .. N + K - 1 (fresh splits to confirm a
choice made on others). Each split is prepared into --work (default: a temporary directory,
removed at the end) as scripts/prepare_criteo.py does by default, the baseline is
scripts/baseline_lr.py's and every model runs `python -m trainer data=criteo data.dir=DIR model=M`
with the overrides. With --test, TRAIN.tsv trains and TEST.tsv tests as they are: one split,
numbered 1, not shuffled (a held-out pair, every model against LR in one command). One JSON line
per baseline, per run and per model (mean / min / max of the differences to LR over the splits,
and on how many the model reaches LR's AUC and logloss). Progress on stderr. Exit status 2 on a
bad file or config (--models and the overrides are checked before anything is prepared).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile

from trainer.tools.cli import exit_status

from dev.recipe_study.rotations import model_names, print_json
from dev.recipe_study.splits import compare


DEFAULTS = {"splits": 8, "first": 1, "test_rows": 399}  # None on the command line: these (one file only)


def log(msg: str) -> None:
    print(f"[compare_splits] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.recipe_study.compare_splits",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="raw Criteo TSV (label, 13 integer and 26 categorical columns)")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (key=value) for every run")
    ap.add_argument("--splits", type=int, default=None, help=f"train / test splits (default {DEFAULTS['splits']})")
    ap.add_argument("--first", type=int, default=None,
                    help=f"number of the first split (default {DEFAULTS['first']}): --first 17 --splits 16 runs splits 17-32")
    ap.add_argument("--test-rows", type=int, default=None, help=f"test rows per split (default {DEFAULTS['test_rows']})")
    ap.add_argument("--test", default=None, metavar="TEST.tsv",
                    help="raw test file: FILE trains, TEST.tsv tests, one split as given")
    ap.add_argument("--models", default="dlrm,wdl,deepfm,dcn", help="comma-separated (default all four)")
    ap.add_argument("--work", default=None, help="keep the prepared splits here (default: a temporary dir)")
    a = ap.parse_intermixed_args(argv)

    def run() -> None:
        models = model_names(a.models, a.overrides)
        given = [k for k in DEFAULTS if getattr(a, k) is not None]
        if a.test is not None and given:
            raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in given)}: with --test the two files "
                             "are the one split as given (--splits, --first and --test-rows split one file)")
        n = {k: DEFAULTS[k] if getattr(a, k) is None else getattr(a, k) for k in DEFAULTS}
        with contextlib.nullcontext(a.work) if a.work is not None else \
                tempfile.TemporaryDirectory(prefix="compare_splits-") as work:
            compare(a.file, n["splits"], n["test_rows"], models, a.overrides, work, print_json, log, n["first"],
                    a.test)
    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
