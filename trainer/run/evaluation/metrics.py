"""Evaluation metrics: exact AUC and log loss, temperature scaling. (What a run writes is
trainer/run/report/'s.)

Why one module: every accuracy claim the project makes comes out of here, computed the same way
for every backend and world size.
"""
from __future__ import annotations

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
