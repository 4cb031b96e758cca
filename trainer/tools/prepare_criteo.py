"""Criteo raw TSV (Kaggle train.txt, Terabyte day_N, .gz too) -> blocks + meta.json for training.

The command line over trainer/workload/data/prepare.py (streaming, parallel over cores, resumable per file),
installed as `hybrid-trainer-prepare-criteo` (scripts/prepare_criteo.py in a checkout):

    hybrid-trainer-prepare-criteo --train train.txt [--test test.tsv] --out DIR [--hash-rows N | --min-count K | --raw-ids]
    hybrid-trainer data=criteo data.dir=DIR

Bad rows are skipped, counted and listed (first line numbers) on screen and in DIR/meta.json;
--strict stops at the first one, naming file and line (exit status 2).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..workload.data.criteo import NUM_CAT, CriteoFormatError
from ..workload.data.prepare import PrepOptions, prepare

DEFAULT_HASH_ROWS = 1_000_000


def _hash_rows(text: str) -> list[int]:
    rows = [int(x) for x in text.split(",")]
    return rows * NUM_CAT if len(rows) == 1 else rows


def parse_args(argv: list[str] | None = None) -> PrepOptions:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", nargs="+", required=True, help="training files, in order (.gz allowed)")
    ap.add_argument("--test", nargs="*", default=[], help="test files (default: the trainer holds out a tail)")
    ap.add_argument("--out", required=True, help="output directory (re-running resumes per file)")
    enc = ap.add_mutually_exclusive_group()
    enc.add_argument("--hash-rows", type=_hash_rows, default=None,
                     help=f"hash every table into N rows (or 26 comma-separated sizes); "
                          f"default {DEFAULT_HASH_ROWS} when neither --min-count nor --raw-ids is given")
    enc.add_argument("--min-count", type=int, default=None,
                     help="vocabulary of values seen >= K times in the training files; others -> OOV id")
    enc.add_argument("--raw-ids", action="store_true",
                     help="keep each value's 32 bits as its id (no hashing, no vocabulary): for "
                          "embedding.kind=dynamic")
    ap.add_argument("--strict", action="store_true", help="fail at the first bad row")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)")
    ap.add_argument("--chunk-mb", type=float, default=16.0,
                    help="MB of text per chunk = one block (default 16; a worker needs ~12x this in memory)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    hash_rows = a.hash_rows if a.hash_rows is not None or a.min_count is not None or a.raw_ids \
        else [DEFAULT_HASH_ROWS] * NUM_CAT
    return PrepOptions(out=a.out, train=a.train, test=a.test, hash_rows=hash_rows, min_count=a.min_count,
                       raw_ids=a.raw_ids,
                       strict=a.strict, workers=a.workers, chunk_mb=a.chunk_mb, progress=not a.no_progress)


def report(meta: dict) -> str:
    """The closing summary: rows per split, bad rows by reason and the first line numbers."""
    lines = [f"{s}: {m['rows']} rows in {len(m['blocks'])} blocks" for s, m in meta["splits"].items()]
    bad = meta["bad_rows"]
    lines.append(f"bad rows skipped: {bad['total']}" +
                 (f" ({', '.join(f'{k}: {v}' for k, v in bad['by_reason'].items())})" if bad["total"] else ""))
    lines += [f"  {b['file']}:{b['line']}: {b['reason']}" for b in bad["first"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opt = parse_args(argv)
    try:
        meta = prepare(opt)
    except CriteoFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(meta))
    print(f"metadata: {os.path.join(opt.out, 'meta.json')}")
    return 0
