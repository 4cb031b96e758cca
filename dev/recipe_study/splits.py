"""The default command against logistic regression over several train / test splits of one raw file.

Why: on a few thousand Criteo rows one 400-row test split moves a model's AUC by about 0.02 against
logistic regression (more than any recipe change we measured), so "the recipe beats LR" is a
statement about the mean over several splits, and it must be easy to re-run on other rows (the
same command on a held-out file). Split 1 is the file's order (the first rows train, the last
`test_rows` test); split k > 1 is the same sizes after `random.Random(k - 1).shuffle` of the lines.
Each split is prepared like `scripts/prepare_criteo.py --train TRAIN --test TEST --out DIR` (hashing
into 1M rows per table), the baseline is `scripts/baseline_lr.py DIR` and each model runs the
default command `python -m trainer data=criteo data.dir=DIR model=M` (one process, no output
directory, no checkpoint: the same training). One JSON line per baseline and per run, one per model
over the splits (mean / min / max of the differences to LR, and on how many splits the model is at
or above LR's AUC and at or below its logloss).
"""
from __future__ import annotations

import gc
import os
import random
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from trainer.tools.baseline import compose, run_baseline
from dev.recipe_study.rotations import QUIET, _spread

HASH_ROWS = 1_000_000  # scripts/prepare_criteo.py's default


def read_lines(path: str) -> list[str]:
    """The file's non-empty lines (raw Criteo TSV: label, 13 ints, 26 hex ids per line)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    return lines


def split_lines(lines: Sequence[str], k: int, test_rows: int) -> tuple[list[str], list[str]]:
    """(train, test) lines of split k (1-based): split 1 in file order, split k > 1 after
    random.Random(k - 1).shuffle; the last test_rows lines test."""
    if k < 1:
        raise ValueError(f"split {k}: splits are numbered from 1")
    if not 0 < test_rows < len(lines):
        raise ValueError(f"--test-rows {test_rows}: must be between 1 and the {len(lines)} lines - 1")
    order = list(lines)
    if k > 1:
        random.Random(k - 1).shuffle(order)
    cut = len(order) - test_rows
    return order[:cut], order[cut:]


def split_pairs(path: str, splits: int, test_rows: int, first: int = 1,
                test_path: Optional[str] = None) -> Iterator[tuple[int, list[str], list[str]]]:
    """(k, train lines, test lines) of splits first .. first + splits - 1 of the file `path`; with
    `test_path`, the one split "1" the two files make as they are (`path` trains, `test_path` tests:
    a held-out pair compared exactly as given)."""
    if test_path is not None:
        yield 1, read_lines(path), read_lines(test_path)
        return
    lines = read_lines(path)
    for k in range(first, first + splits):
        yield (k, *split_lines(lines, k, test_rows))


def prepare_split(train: Sequence[str], test: Sequence[str], directory: str) -> str:
    """Write the split's two TSVs under `directory` and prepare them (1M hashed rows per table);
    returns the prepared directory."""
    from trainer.workload.data.prepare import PrepOptions, prepare

    os.makedirs(directory, exist_ok=True)
    files = []
    for name, lines in (("train.tsv", train), ("test.tsv", test)):
        files.append(os.path.join(directory, name))
        with open(files[-1], "w", encoding="utf-8") as f:
            f.writelines(lines)
    out = os.path.join(directory, "prepared")
    prepare(PrepOptions(out=out, train=[files[0]], test=[files[1]], hash_rows=[HASH_ROWS] * 26,
                        workers=1, progress=False))
    return out


def _summary(model: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(key: str) -> dict[str, float]:
        return _spread([r[key] for r in runs])

    return {"model": model, "splits": len(runs), "auc_vs_lr": spread("auc_vs_lr"),
            "logloss_vs_lr": spread("logloss_vs_lr"),
            "splits_at_or_above_lr_auc": sum(r["auc_vs_lr"] >= 0 for r in runs),
            "splits_at_or_below_lr_logloss": sum(r["logloss_vs_lr"] <= 0 for r in runs)}


def compare(path: str, splits: int, test_rows: int, models: Sequence[str], overrides: Sequence[str],
            work: str, emit: Callable[[dict[str, Any]], None],
            log: Optional[Callable[[str], None]] = None, first: int = 1,
            test_path: Optional[str] = None) -> list[dict[str, Any]]:
    """Every model's default command against LR on `splits` splits of the raw file `path`, splits
    first .. first + splits - 1 (split directories under `work`), or on the one split `path` /
    `test_path` (split_pairs); emit() each JSON record; returns them all."""
    from trainer.run.runner import run

    log = log or (lambda msg: None)
    if splits < 1:
        raise ValueError(f"--splits {splits}: must be >= 1")
    if first < 1:
        raise ValueError(f"--first {first}: splits are numbered from 1")
    out: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in models}
    last = 1 if test_path is not None else first + splits - 1
    for k, train, test in split_pairs(path, splits, test_rows, first, test_path):
        log(f"split {k}/{last}: preparing {len(train)} training and {len(test)} test rows")
        directory = prepare_split(train, test, os.path.join(work, f"split{k}"))
        lr = run_baseline(compose(directory, overrides))
        out.append({"split": k, "baseline": "lr", "test_auc": lr["eval_auc"], "test_logloss": lr["eval_logloss"],
                    "C": lr["C"], "train_rows": lr["train_rows"], "test_rows": lr["eval_rows"]})
        emit(out[-1])
        for m in models:
            log(f"split {k}/{last}: {m}")
            t0 = time.perf_counter()
            s = run(compose(directory, [*overrides, f"model={m}", *QUIET])).summary
            r = {"split": k, "model": m, "test_auc": s["test_auc"], "test_logloss": s["test_logloss"],
                 "auc_vs_lr": s["test_auc"] - lr["eval_auc"], "logloss_vs_lr": s["test_logloss"] - lr["eval_logloss"],
                 "recipe": (s.get("recipe") or {}).get("name"), "seconds": round(time.perf_counter() - t0, 1)}
            runs[m].append(r)
            out.append(r)
            emit(r)
            gc.collect()  # the previous run's tables go before the next one allocates its own
    for m in models:
        out.append(_summary(m, runs[m]))
        emit(out[-1])
    return out
