"""Two settings compared split by split (dev/recipe_study/paired.py): the paired difference of two
dev/recipe_study/compare_splits.py outputs, run on the same splits.

    python -m dev.recipe_study.compare_splits FILE.tsv --splits 16 > base.jsonl
    python -m dev.recipe_study.compare_splits FILE.tsv --splits 16 model.dropout=0.2 > new.jsonl
    python -m dev.recipe_study.paired_splits base.jsonl new.jsonl

One JSON line per model: new - base test AUC and logloss (mean, standard error, min, max), on how
many splits the new setting was higher / lower, the mean over each half of the splits, and both
settings' mean difference to LR. Splits or models only one file has are left out (stderr says
which). Exit status 2 on a missing or malformed file, or two files with no run in common.
"""
from __future__ import annotations

import argparse
import sys

from dev.recipe_study.paired import PairedInputError, paired, read_records
from dev.recipe_study.rotations import print_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.recipe_study.paired_splits",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
