"""`python -m trainer.serving export RUN_DIR --out DIR` and `... predict DIR --input ROWS.tsv --out SCORES`
(installed as hybrid-trainer-export and hybrid-trainer-predict). Bad input: one `error:` line, exit 2."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from ..base.core.atomic import replacing
from ..run.checkpoint import CheckpointError
from ..workload.data.ids import IdRangeError
from .artifact import ServingError
from .tables import WINDOW_BYTES

ERRORS = (ServingError, CheckpointError, IdRangeError)


def export_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hybrid-trainer-export", description=(
        "Export a trained run (its newest complete checkpoint) into one artifact directory: the dense model as a "
        "torch.export program, each table as one memory-mappable .npy file, the data's preprocessing, a manifest "
        "with every file's sha256 (docs/serving.md)."))
    ap.add_argument("run", help="the run's output directory (or a checkpoint directory)")
    ap.add_argument("--out", required=True, help="the artifact directory to create (must not exist)")
    ap.add_argument("--checkpoint", help="this checkpoint instead of the run's newest complete one")
    ap.add_argument("--window-mb", type=int, default=WINDOW_BYTES >> 20,
                    help="rows of a table held in memory at a time while merging the shards (MB)")
    ap.add_argument("--rows", default="saved", choices=["saved", "fp16", "int8"],
                    help="the tables' rows: as trained (default), float16, or int8 codes with a scale and bias per row")
    ap.add_argument("--onnx", action="store_true", help="also the dense model as ONNX (dense.onnx; needs onnx, onnxscript)")
    ap.add_argument("--aoti", action="store_true",
                    help="also the dense model as an AOTInductor package (dense.aoti.pt2; needs a C++ compiler)")
    a = ap.parse_args(argv)
    from .export import export, say_stderr
    try:
        if a.window_mb < 1:
            raise ServingError(f"--window-mb {a.window_mb}: must be >= 1")
        export(a.run, a.out, a.checkpoint, a.window_mb << 20, a.rows, a.onnx, a.aoti, say=say_stderr)
    except ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def predict_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hybrid-trainer-predict", description=(
        "Score raw rows with an exported artifact: one probability per input row, in order, one a line."))
    ap.add_argument("artifact", help="the directory `export` wrote")
    ap.add_argument("--input", required=True, help="rows in the training data's raw format (criteo: TSV, .gz too)")
    ap.add_argument("--out", required=True, help="the scores file (replaced whole once every row is scored)")
    ap.add_argument("--no-verify", action="store_true", help="skip checking the artifact's files against their sha256")
    a = ap.parse_args(argv)
    from .predictor import Predictor
    t0, n = time.monotonic(), 0
    try:
        if not os.path.isfile(a.input):
            raise ServingError(f"--input {a.input}: no such file")
        predictor = Predictor(a.artifact, verify=not a.no_verify)
        with replacing(a.out) as f:
            for p in predictor.score_file(a.input):
                f.write("".join(f"{x:.9g}\n" for x in p.tolist()))
                n += p.numel()
    except ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[predict] {n:,} rows scored into {os.path.abspath(a.out)} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("export", "predict"):
        print("usage: python -m trainer.serving {export,predict} ... (--help after either)", file=sys.stderr)
        return 2
    return (export_main if argv[0] == "export" else predict_main)(argv[1:])


def export_cli() -> None:
    sys.exit(export_main())


def predict_cli() -> None:
    sys.exit(predict_main())


if __name__ == "__main__":
    sys.exit(main())
