#!/usr/bin/env python
"""Two settings compared split by split (dev/recipe_study/paired.py): the paired difference of two
dev/recipe_study/compare_splits.py outputs, run on the same splits.

    dev/recipe_study/compare_splits.py FILE.tsv --splits 16 > base.jsonl
    dev/recipe_study/compare_splits.py FILE.tsv --splits 16 model.dropout=0.2 > new.jsonl
    dev/recipe_study/paired_splits.py base.jsonl new.jsonl

One JSON line per model: new - base test AUC and logloss (mean, standard error, min, max), on how
many splits the new setting was higher / lower, the mean over each half of the splits, and both
settings' mean difference to LR. Splits or models only one file has are left out (stderr says
which). Exit status 2 on a missing or malformed file, or two files with no run in common.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the repository root: dev/ and benchmarks/ are importable from it
    sys.path.insert(0, ROOT)
from dev.recipe_study.paired import PairedInputError, paired, read_records  # noqa: E402
from dev.recipe_study.rotations import print_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="compare_splits output of the base setting (JSON lines)")
    ap.add_argument("new", help="compare_splits output of the new setting, on the same splits")
    a = ap.parse_args(argv)
    try:
        records = paired(read_records(a.base), read_records(a.new), a.base, a.new,
                         lambda msg: print(f"[paired_splits] {msg}", file=sys.stderr, flush=True))
    except (PairedInputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in records:
        print_json(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
