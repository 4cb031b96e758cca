"""Evaluation metrics, per-step JSONL logging and the run summary.

Why one module: every claim the project makes (accuracy, throughput, bytes on the wire) comes out
of here, computed the same way for every backend and world size.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import numpy as np


def logloss_rows(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each row's log loss from its logit z and label y: softplus(z) - y z (stable, no clipping)."""
    return np.logaddexp(0.0, z) - y * z


def auc_logloss(logits: np.ndarray, labels: np.ndarray) -> tuple[float | None, float | None]:
    """Exact ROC AUC and mean log loss over the whole eval split; None when undefined (no rows;
    AUC with one class only). Computed here rather than by scikit-learn, whose import costs every
    process that evaluates ~2 s: AUC is the Mann-Whitney statistic over the logits' ranks, tied
    logits sharing their average rank (a tied positive-negative pair counts one half, as the area
    under the ROC curve's steps does); the log loss is softplus(z) - y z per row, exact in the
    logits (no clipping of probabilities)."""
    if labels.size == 0:
        return None, None
    z, pos = logits.astype(np.float64).ravel(), labels.ravel() > 0.5
    ll = float(np.mean(logloss_rows(z, pos)))
    n_pos = int(np.count_nonzero(pos))
    n_neg = pos.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None, ll
    order = np.argsort(z, kind="stable")
    _, first, counts = np.unique(z[order], return_index=True, return_counts=True)
    mean_rank = first + (counts + 1) / 2.0  # 1-based average rank of each distinct value
    ranks = np.repeat(mean_rank, counts)  # in sorted order
    rank_sum = float(ranks[pos[order]].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg), ll


TEMPERATURES = np.unique(np.append(np.exp(np.linspace(np.log(0.02), np.log(5.0), 401)), 1.0))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float, float]:
    """Temperature scaling (one parameter, Guo et al. 2017): the T > 0 in TEMPERATURES minimising
    the mean log loss of sigmoid(T * logit) on these rows. Returns (T, logloss at T = 1, at T).

    A scale by T > 0 keeps the order of the logits, so it changes no AUC; it only undoes over- (or
    under-) confidence. The rows are sorted first, so the same set of rows gathered in another
    order (another W) gives bit-identical sums and the same T. No rows: T = 1."""
    if labels.size == 0:
        return 1.0, float("nan"), float("nan")
    order = np.lexsort((labels, logits))
    z, y = logits.astype(np.float64)[order], labels.astype(np.float64)[order]
    tz = TEMPERATURES[:, None] * z[None, :]  # [K, n]
    losses = logloss_rows(tz, y[None, :]).mean(axis=1)
    k = int(np.argmin(losses))  # first of equal losses
    one = int(np.flatnonzero(TEMPERATURES == 1.0)[0])
    return float(TEMPERATURES[k]), float(losses[one]), float(losses[k])


class JsonlWriter:
    """Appends one JSON object per line; a no-op when path is None (non-zero ranks, tests).

    A log must never end a run: when a write fails (a full disk, a quota, an I/O error) the file is
    cut back to its last complete line, one warning goes to stderr, and later records are counted
    as lost instead of written; report() says so for the summary. Each record is written with
    one unbuffered write loop, so a failure cannot leave half a line in a buffer for the next one."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.written = 0  # records in the file
        self.lost = 0  # records not written after a failure
        self.error: str | None = None
        self._f = None
        if path:
            try:
                self._f = open(path, "ab", buffering=0)
            except OSError as exc:
                self._fail(exc, None)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is None:
            self.lost += 1
            return
        line = (json.dumps(record, default=_jsonable) + "\n").encode()
        end = self._f.tell()
        try:
            view = memoryview(line)
            while view:
                view = view[self._f.write(view):]
        except OSError as exc:
            self.lost += 1
            self._fail(exc, end)
            return
        self.written += 1

    def _fail(self, exc: OSError, end: int | None) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        if self._f is not None and end is not None:
            try:
                self._f.truncate(end)  # no partial line (also frees what it held)
            except OSError:
                pass
        self._close()
        print(f"[trainer] warning: cannot write {self.path} ({self.error}); training goes on without "
              "its per-step log (the summary counts the records lost)", file=sys.stderr)

    def report(self) -> dict[str, Any] | None:
        """For summary.json: None when every record was written (or there is no log)."""
        if self.error is None:
            return None
        return {"path": self.path, "error": self.error, "records_written": self.written,
                "records_lost": self.lost}

    def _close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        self._close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def write_json_atomic(path: str, obj: dict[str, Any]) -> None:
    """Write obj as pretty JSON via a temporary file and rename (never a half-written file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:  # no half-written temporary file left behind (it may be what filled the disk)
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """write_json_atomic for summary.json; when the disk refuses it, the summary goes to stdout
    (one JSON line, so the results of the run are not lost) before the error is raised."""
    try:
        write_json_atomic(path, summary)
    except OSError as exc:
        print(f"[trainer] warning: cannot write {path} ({exc}); the summary follows on stdout",
              file=sys.stderr)
        print(json.dumps(summary, default=_jsonable), flush=True)
        raise


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
