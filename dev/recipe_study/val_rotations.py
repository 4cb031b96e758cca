"""One model of the default recipe (train.ensemble=1; or any overrides) over several validation slices of
a prepared Criteo directory, each run against the logistic-regression baseline on the same test
split (dev/recipe_study/rotations.py). The recipe's ensemble trains exactly these models (one per slice)
and averages them; this shows how much one of them varies:

    python -m dev.recipe_study.val_rotations DIR [--slices 5] [--models dlrm,wdl,deepfm,dcn]
        [trainer overrides ...]

Run k uses data.val_slice = 1, 1 + S/K, ... (S = the slices of data.val_fraction there are), so the
validation rows, and with them the training rows and the early stop, differ from run to run while
the test split stays. One JSON line for the baseline, one per run (test AUC / logloss, their
difference to LR, best step, temperature), one per model (mean / min / max of the differences).
Progress on stderr. Exit status 2 on a bad directory or config.
"""
from __future__ import annotations

import argparse
import sys

from trainer.tools.cli import exit_status

from dev.recipe_study.rotations import model_names, print_json, rotate, stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.recipe_study.val_rotations",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="directory written by scripts/prepare_criteo.py --out DIR")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (key=value) for every run")
    ap.add_argument("--slices", type=int, default=5, help="validation slices per model (default 5)")
    ap.add_argument("--models", default="dlrm,wdl,deepfm,dcn", help="comma-separated (default all four)")
    a = ap.parse_intermixed_args(argv)
    return exit_status(lambda: rotate(a.dir, model_names(a.models, a.overrides), a.slices, a.overrides, print_json, stderr))


if __name__ == "__main__":
    sys.exit(main())
