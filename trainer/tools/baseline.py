"""A logistic-regression baseline on a prepared Criteo directory, on exactly the trainer's splits.

Why: an eval AUC means little on its own; "a simple logistic regression on the same rows" is the
yardstick for the neural models. To be the *same rows*, the splits come from the trainer's own code
(blocks.split_segments with the composed data config: the test split or the held-out tail,
data.train_samples / data.test_samples) and the ids are folded into the trainer's table sizes
(data.max_table_rows), read with the reference memmap decoding (criteo.from_block).

Features: the 13 dense values (already log(1 + max(x, 0)), standardised with training-split
statistics) and a one-hot of each of the 26 categorical ids (a column per (table, id) seen in
training: a sparse matrix with 26 non-zeros per row; see Features). Model: scikit-learn
LogisticRegression (liblinear, or saga). C is chosen by mean validation AUC over contiguous folds of
the TRAIN split (5 on small data: a single 10% slice of 1,600 rows is 160 rows, too noisy to choose
by; on large data its last `val_fraction`, like the trainer's tail rule), then the model is refitted
on the whole training split (the rows the trainer splits into training and validation rows with
data.val_fraction: the baseline uses them all); the eval split is only scored.
Metrics come from trainer.run.evaluation.metrics.auc_logloss, the trainer's own AUC/logloss code.
scikit-learn (and scipy) come with the `baseline` extra: `pip install 'hybrid-trainer[baseline]'`.

Memory: the splits are loaded whole (4 bytes x 40 per row, plus ~26 x 12 bytes per row for the
sparse matrix): fine up to a few million rows; for Criteo Kaggle use max_train_rows (first rows).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ..base.config import Config
from ..run.resolve.configure import compose_config
from ..workload.data.blocks import split_segments
from ..workload.data.segment import Segment
from ..workload.data.criteo import CriteoFormatError, from_block, read_meta
from .cli import require_extra

DEFAULT_CS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
SOLVERS = ("liblinear", "saga")
AUTO_FOLDS_ROWS = 1_000_000  # folds=0: 5-fold choice of C below this many training rows, else the tail slice



def compose(directory: str, overrides: Sequence[str]) -> Config:
    """The trainer's validated config for `data=criteo data.dir=DIR <overrides>` (hydra.* ignored):
    the baseline and the trainer runs of the tools read the same rows."""
    return compose_config(["data=criteo", f"data.dir={directory}"] +
                          [o for o in overrides if not o.lstrip("+~").startswith("hydra.")])

@dataclass
class Split:
    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, F] float32
    ids: np.ndarray  # [n, T] int64, folded into the trainer's table sizes

    @property
    def rows(self) -> int:
        return int(self.labels.size)

    def head(self, n: int) -> "Split":
        return Split(self.labels[:n], self.dense[:n], self.ids[:n])


def read_split(segs: Sequence[Segment], num_dense: int, rows: Sequence[int]) -> Split:
    """The rows of these segments, in order (memmap decoding; ids mod the trainer's table rows)."""
    parts = [from_block(np.load(s.file, mmap_mode="r")[s.lo:s.hi], num_dense) for s in segs]
    if not parts:
        t = len(rows)
        return Split(np.zeros(0, np.float32), np.zeros((0, num_dense), np.float32), np.zeros((0, t), np.int64))
    labels, dense, ids = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return Split(labels, dense, np.remainder(ids, np.asarray(rows, np.int64)[None, :]))


def stored_rows(c: Config) -> list[int]:
    """The tables' rows as prepared (meta.json), under the data.max_table_rows cap: the baseline
    one-hot encodes the ids as stored, without the trainer's data.min_count vocabulary (an L2
    penalty already keeps a rarely seen column's weight near 0)."""
    cap = c.data.max_table_rows
    return [min(int(n), cap) if cap > 0 else int(n) for n in read_meta(c.data.dir)["table_rows"]]


def load_splits(c: Config, max_train_rows: int = 0) -> tuple[Split, Split]:
    """(train, eval) of the composed trainer config c (data=criteo), the trainer's split rule."""
    if c.data.name != "criteo":
        raise CriteoFormatError(f"the baseline needs data=criteo, got data={c.data.name}")
    meta = read_meta(c.data.dir)
    train_segs, eval_segs = split_segments(meta, c.data.dir, c.data)
    rows = stored_rows(c)
    train = read_split(train_segs, c.data.num_dense, rows)
    if max_train_rows > 0:
        train = train.head(max_train_rows)
    return train, read_split(eval_segs, c.data.num_dense, rows)


class Features:
    """Split -> scipy CSR: the standardised dense values, then a one-hot column per (table, id) seen
    in the split the features were built on. A one-hot column never seen in training has a zero
    gradient, so its L2-regularised weight is exactly 0: dropping it gives the same model as the
    full one-hot over sum(table rows) columns (26M with 1M-row tables) at the size of the data."""

    def __init__(self, train: Split, rows: Sequence[int]) -> None:
        f = train.dense.shape[1]
        self.mean = train.dense.mean(axis=0) if train.rows else np.zeros(f, np.float32)
        std = train.dense.std(axis=0) if train.rows else np.ones(f, np.float32)
        self.std = np.where(std > 0, std, 1.0)
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(rows, np.int64))[:-1]])
        self.seen = np.unique(self._keys(train))  # sorted (table offset + id) values of the training rows
        self.width = int(f + self.seen.size)

    def _keys(self, s: Split) -> np.ndarray:
        return self.offsets[None, :] + s.ids

    def __call__(self, s: Split):
        from scipy import sparse

        n, f = s.dense.shape
        keys = self._keys(s).ravel()
        pos = np.searchsorted(self.seen, keys).clip(max=max(self.seen.size - 1, 0))
        hit = (self.seen[pos] == keys) if self.seen.size else np.zeros(keys.size, bool)
        row = np.repeat(np.arange(n), s.ids.shape[1])[hit]
        dense = sparse.csr_matrix(((s.dense - self.mean) / self.std).astype(np.float64))
        onehot = sparse.csr_matrix((np.ones(row.size), (row, pos[hit])), shape=(n, self.seen.size))
        return sparse.hstack([dense, onehot], format="csr")


def _fit(x, y: np.ndarray, c: float, solver: str, seed: int):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, solver=solver, max_iter=1000, tol=1e-4, random_state=seed).fit(x, y)


def _score(model, x, y: np.ndarray) -> tuple[Optional[float], Optional[float]]:
    from ..run.evaluation.metrics import auc_logloss

    return auc_logloss(model.decision_function(x), y)


def _folds(n: int, folds: int, val_fraction: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """(fit rows, validation rows) of the training split: K contiguous folds, or (K = 1) its tail."""
    if folds == 1:
        n_fit = n - int(np.ceil(val_fraction * n))
        return [(np.arange(n_fit), np.arange(n_fit, n))]
    cuts = [n * k // folds for k in range(folds + 1)]
    return [(np.r_[0:lo, hi:n], np.arange(lo, hi)) for lo, hi in zip(cuts[:-1], cuts[1:])]


def _take(s: Split, idx: np.ndarray) -> Split:
    return Split(s.labels[idx], s.dense[idx], s.ids[idx])


def choose_c(train: Split, rows: Sequence[int], cs: Sequence[float], folds: int, val_fraction: float,
             solver: str, seed: int) -> tuple[float, dict[str, float]]:
    """The C of best mean validation AUC over folds of the TRAIN split (ties: the smaller C)."""
    scores: dict[str, list[float]] = {repr(c): [] for c in cs}
    for fit_idx, val_idx in _folds(train.rows, folds, val_fraction):
        fit, val = _take(train, fit_idx), _take(train, val_idx)
        if len(np.unique(fit.labels)) < 2 or len(np.unique(val.labels)) < 2:
            raise CriteoFormatError(f"a validation fold of the training split ({val.rows} rows) lacks one "
                                    f"of the labels: use fewer --folds or pass one C")
        feats = Features(fit, rows)
        xf, xv = feats(fit), feats(val)
        for c in cs:
            scores[repr(c)].append(_score(_fit(xf, fit.labels, c, solver, seed), xv, val.labels)[0])
    mean = {k: float(np.mean(v)) for k, v in scores.items()}
    return max(cs, key=lambda c: (mean[repr(c)], -c)), mean


def run_baseline(c: Config, cs: Sequence[float] = DEFAULT_CS, folds: int = 0, val_fraction: float = 0.1,
                 solver: str = "liblinear", max_train_rows: int = 0) -> dict[str, Any]:
    """Fit and score the baseline; the result is the script's JSON line. folds: K >= 2 contiguous
    folds of the train split to choose C, 1 = its last val_fraction, 0 = auto (5 folds below
    AUTO_FOLDS_ROWS training rows, else the tail slice). Needs the `baseline` extra (scikit-learn)."""
    require_extra("baseline", "the logistic-regression baseline")
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: must be one of {', '.join(SOLVERS)}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
    if not cs or min(cs) <= 0:
        raise ValueError(f"C values {list(cs)}: need at least one, all > 0")
    if folds < 0:
        raise ValueError(f"folds={folds}: must be >= 0 (0 = auto)")
    t0 = time.perf_counter()
    train, evals = load_splits(c, max_train_rows)
    if train.rows < 2 or len(np.unique(train.labels)) < 2:
        raise CriteoFormatError(f"data.dir={c.data.dir!r}: the training split ({train.rows} rows) "
                                f"needs both labels")
    if evals.rows == 0:
        raise CriteoFormatError(f"data.dir={c.data.dir!r}: the eval split is empty")
    rows = stored_rows(c)
    folds = folds or (5 if train.rows < AUTO_FOLDS_ROWS else 1)
    val_auc: dict[str, float] = {}
    if len(cs) > 1:
        best, val_auc = choose_c(train, rows, cs, folds, val_fraction, solver, c.data.seed)
    else:
        best, folds = cs[0], 0
    feats = Features(train, rows)
    model = _fit(feats(train), train.labels, best, solver, c.data.seed)
    auc, ll = _score(model, feats(evals), evals.labels)
    return {"model": "logistic_regression", "train_rows": train.rows, "eval_rows": evals.rows,
            "eval_auc": auc, "eval_logloss": ll, "C": best, "solver": solver, "folds": folds,
            "val_auc": val_auc, "features": feats.width, "seconds": round(time.perf_counter() - t0, 3)}
