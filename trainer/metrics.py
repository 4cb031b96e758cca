"""Evaluation metrics, per-step JSONL logging and the run summary.

Why one module: every claim the project makes (accuracy, throughput, bytes on the wire) comes out
of here, computed the same way for every backend and world size.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def auc_logloss(logits: np.ndarray, labels: np.ndarray) -> tuple[float | None, float | None]:
    """Exact ROC AUC and log loss (scikit-learn) over the whole eval split; None when undefined."""
    from sklearn.metrics import log_loss, roc_auc_score

    if labels.size == 0:
        return None, None
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    auc = float(roc_auc_score(labels, probs)) if 0 < labels.sum() < labels.size else None
    ll = float(log_loss(labels, probs, labels=[0.0, 1.0]))
    return auc, ll


class JsonlWriter:
    """Appends one JSON object per line; a no-op when path is None (non-zero ranks, tests)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._f = open(path, "a", buffering=1) if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f:
            self._f.write(json.dumps(record, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def write_json_atomic(path: str, obj: dict[str, Any]) -> None:
    """Write obj as pretty JSON via a temporary file and rename (never a half-written file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
