#!/usr/bin/env python
"""Criteo raw TSV (Kaggle train.txt, Terabyte day_N, .gz too) -> blocks + meta.json for training.

    scripts/prepare_criteo.py --train train.txt [--test test.tsv] --out DIR [--hash-rows N | --min-count K | --raw-ids]
    python -m trainer data=criteo data.dir=DIR

The same command as the installed `hybrid-trainer-prepare-criteo` (trainer/tools/prepare_criteo.py).
Bad rows are skipped, counted and listed (first line numbers) on screen and in DIR/meta.json;
--strict stops at the first one, naming file and line (exit status 2).
"""
from __future__ import annotations

import sys

from trainer.tools.prepare_criteo import main, parse_args, report  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
