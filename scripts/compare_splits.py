#!/usr/bin/env python
"""The default command of every model against logistic regression on K train / test splits of one
raw Criteo TSV (trainer/tools/splits.py): how the recipe compares with LR, as a mean over splits
rather than on one noisy test split.

    scripts/compare_splits.py FILE.tsv [--splits 8] [--first 1] [--test-rows 399] [--models dlrm,wdl,deepfm,dcn]
                              [--work DIR] [trainer overrides ...]

Split 1 keeps the file's order (the last --test-rows lines test), split k > 1 shuffles the lines
with random.Random(k - 1) first; --first N runs splits N .. N + K - 1 (fresh splits to confirm a
choice made on others). Each split is prepared into --work (default: a temporary directory,
removed at the end) as scripts/prepare_criteo.py does by default, the baseline is
scripts/baseline_lr.py's and every model runs `python -m trainer data=criteo data.dir=DIR model=M`
with the overrides. One JSON line per baseline, per run and per model (mean / min / max of the
differences to LR over the splits, and on how many the model reaches LR's AUC and logloss).
Progress on stderr. Exit status 2 on a bad file or config.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile

from trainer.tools.baseline import exit_status, model_names
from trainer.tools.rotations import print_json
from trainer.tools.splits import compare


def log(msg: str) -> None:
    print(f"[compare_splits] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="raw Criteo TSV (label, 13 integer and 26 categorical columns)")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (key=value) for every run")
    ap.add_argument("--splits", type=int, default=8, help="train / test splits (default 8)")
    ap.add_argument("--first", type=int, default=1,
                    help="number of the first split (default 1): --first 17 --splits 16 runs splits 17-32")
    ap.add_argument("--test-rows", type=int, default=399, help="test rows per split (default 399)")
    ap.add_argument("--models", default="dlrm,wdl,deepfm,dcn", help="comma-separated (default all four)")
    ap.add_argument("--work", default=None, help="keep the prepared splits here (default: a temporary dir)")
    a = ap.parse_intermixed_args(argv)

    def run() -> None:
        models = model_names(a.models, a.overrides)
        with contextlib.nullcontext(a.work) if a.work is not None else \
                tempfile.TemporaryDirectory(prefix="compare_splits-") as work:
            compare(a.file, a.splits, a.test_rows, models, a.overrides, work, print_json, log, a.first)
    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
