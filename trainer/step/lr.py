"""Learning-rate warmup and decay for the dense optimizer and every sparse optimizer instance.

The schedule is a pure function of the step (lr_factor), so every rank, every world size and a
resumed run set the same rates, and the run stays exact at BSP. Shape (the MLPerf DLRM recipe's,
with a warmup that never trains a step at lr 0):

- warmup (optim.warmup_steps = w > 0): factor (k + 1) / (w + 1) at step k < w, a linear ramp that
  reaches 1 at step w. It equals torch.optim.lr_scheduler.LinearLR(start_factor=1 / (w + 1),
  total_iters=w);
- polynomial decay (optim.decay=poly): from step s (optim.decay_start; -1 = w) over n steps
  (optim.decay_steps; 0 = until train.steps), factor (1 - (k - s) / n) ** p (optim.decay_power,
  MLPerf's 2), 0 after its end. It equals torch.optim.lr_scheduler.PolynomialLR(total_iters=n,
  power=p) started at step s. With n = train.steps - s the last step still trains at (1 / n) ** p.
- otherwise 1.

Every sparse optimizer is scheduled with the same factor: the owners' (ShardStore), the replica of
hot rows (placement), the rows lent to a holder (Herald), and the HET cache's local rule for cached
copies (cache.local_lr), so a row moves at the same rate wherever it is updated.
"""
from __future__ import annotations

from typing import Any

import torch

from ..base.config import OptimConfig


def lr_factor(step: int, o: OptimConfig, total_steps: int) -> float:
    """The multiplier of both learning rates at 0-based step `step` of a `total_steps` run."""
    w = o.warmup_steps or 0
    if step < w:
        return (step + 1) / (w + 1)
    if o.decay == "poly":
        start = o.decay_start if o.decay_start >= 0 else w
        n = o.decay_steps or (total_steps - start)
        if step >= start and n > 0:
            return max(0.0, 1.0 - min(step - start, n) / n) ** o.decay_power
    return 1.0


def scheduled(o: OptimConfig) -> bool:
    """Whether any step runs at a factor other than 1."""
    return bool(o.warmup_steps) or o.decay == "poly"


class LrSchedule:
    """Sets the dense optimizer's and every sparse optimizer's learning rate before a step."""

    def __init__(self, o: OptimConfig, total_steps: int, dense: torch.optim.Optimizer, emb: Any,
                 sparse_lr: float) -> None:
        self.o, self.total = o, total_steps
        self.active = scheduled(o)
        self.dense = dense
        self.dense_base = [g["lr"] for g in dense.param_groups]
        self.sparse_base = sparse_lr
        self.sparse = sparse_optimizers(emb)
        self.cache = emb.cache  # HET: cached copies are updated locally at cache.local_lr
        self.factor = 1.0

    def apply(self, step: int) -> float:
        """Set every rate for step `step`; returns the factor."""
        if not self.active:
            return 1.0
        f = self.factor = lr_factor(step, self.o, self.total)
        for g, base in zip(self.dense.param_groups, self.dense_base):
            g["lr"] = base * f
        for opt in self.sparse:
            opt.lr = self.sparse_base * f
        if self.cache is not None:
            self.cache.local_lr = self.sparse_base * f
        return f


def sparse_optimizers(emb: Any) -> list:
    """Every SparseOptimizer of a HybridEmbedding: the owner's, the replica's, a holder's lent rows'."""
    out = [emb.store.optimizer]
    if emb.replica is not None:
        out.append(emb.replica.optimizer)
    lent = getattr(emb.remote, "lent", None)  # Herald's rows lent to this worker
    if lent is not None:
        out.append(lent.optimizer)
    return out
