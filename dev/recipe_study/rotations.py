"""How much one train / validation split says: the recipe over several validation slices, against LR.

Why: on a few thousand rows the test AUC of one run moves by about 0.02 with the choice of the
validation rows alone (which rows train, when early stopping fires), so one run per model can make a
recipe look better or worse than it is. This runs the same command once per validation slice
(data.val_slice = 1, 1 + S/K, ...: K of the S = 1 / data.val_fraction slices of the training rows,
spread over them) and compares every run with the logistic-regression baseline on the same test
split (trainer/tools/baseline.py, fitted once: it uses every training row).

Each run is the trainer's own (`trainer.run.runner.run`, one process, no output directory, no
checkpoint), one model (train.ensemble=1 unless the overrides say otherwise: the recipe's ensemble of 5 is
these very runs, averaged). One JSON line per run and one per model with the mean and spread of the differences.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from trainer.base.config import Config
from trainer.tools.baseline import compose, run_baseline

QUIET = ["train.progress=off", "checkpoint.enabled=false", "train.tensorboard=false", "comm=local"]


def model_names(models: str, overrides: Sequence[str]) -> list[str]:
    """The tools' `--models a,b` as a list, checked with their overrides before any work starts:
    every name a model (config.MODELS) and every override key=value (Hydra's +key=, ++key= and
    ~key forms too). `--models wdl deepfm` leaves "deepfm" among the overrides, which Hydra would
    only reject when the first run composes its config; the error names the fix."""
    from trainer.base.config import MODELS

    names = [m for m in models.split(",") if m]
    if not names:
        raise ValueError("--models: no model named (comma-separated, e.g. --models dlrm,dcn)")
    for m in names:
        if m not in MODELS:
            raise ValueError(f"--models: {m!r} is not a model (one of {', '.join(MODELS)})")
    loose = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if loose:
        stray = [o for o in loose if o in MODELS]  # model names given apart: `--models wdl deepfm`
        hint = f"; several models go in one comma-separated --models {','.join([*names, *stray])}" if stray else ""
        raise ValueError(f"override {loose[0]!r} is not key=value{hint}")
    return names


def slices(c: Config, count: int) -> list[int]:
    """`count` data.val_slice values spread over the slices there are (trainer.workload.data.val_slices)."""
    from trainer.workload.data import val_slices

    if not c.data.val_fraction:
        raise ValueError("the run has no validation split (data.val_fraction=0): nothing to rotate")
    if count < 1:
        raise ValueError(f"--slices {count}: must be >= 1")
    return val_slices(c.data, count)


def _one(directory: str, model: str, j: int, overrides: Sequence[str]) -> dict[str, Any]:
    from trainer.run.runner import run

    t0 = time.perf_counter()
    # one model per run (train.ensemble=1 unless overridden): the slice is what varies
    s = run(compose(directory, ["train.ensemble=1", *overrides, f"model={model}", f"data.val_slice={j}", *QUIET])).summary
    cal = s.get("calibration") or {}
    return {"model": model, "val_slice": j, "test_auc": s["test_auc"], "test_logloss": s["test_logloss"],
            "val_auc": s["val_auc"], "best_step": s["best_step"], "steps": s["steps"],
            "temperature": cal.get("temperature"), "seconds": round(time.perf_counter() - t0, 1)}


def _spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


def rotate(directory: str, models: Sequence[str], count: int, overrides: Sequence[str],
           emit: Callable[[dict[str, Any]], None], log: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """Run every model over `count` validation slices; emit() each JSON record (the baseline's,
    one per run, one per model); returns them all."""
    log = log or (lambda msg: None)
    c = compose(directory, overrides)
    js = slices(c, count)
    lr = run_baseline(c)
    out = [{"baseline": "lr", "test_auc": lr["eval_auc"], "test_logloss": lr["eval_logloss"], "C": lr["C"],
            "train_rows": lr["train_rows"], "test_rows": lr["eval_rows"], "val_slices": js}]
    emit(out[-1])
    for model in models:
        runs = []
        for j in js:
            log(f"{model}: validation slice {j} ({len(runs) + 1}/{len(js)})")
            r = _one(directory, model, j, overrides)
            r["auc_vs_lr"] = r["test_auc"] - lr["eval_auc"]
            r["logloss_vs_lr"] = r["test_logloss"] - lr["eval_logloss"]
            runs.append(r)
            emit(r)
            gc.collect()  # the previous run's tables go before the next one allocates its own
        out += runs
        out.append({"model": model, "runs": len(runs), "auc_vs_lr": _spread([r["auc_vs_lr"] for r in runs]),
                    "logloss_vs_lr": _spread([r["logloss_vs_lr"] for r in runs]),
                    "runs_at_or_above_lr_auc": sum(r["auc_vs_lr"] >= 0 for r in runs)})
        emit(out[-1])
    return out


def print_json(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def stderr(msg: str) -> None:
    print(f"[val_rotations] {msg}", file=sys.stderr, flush=True)
