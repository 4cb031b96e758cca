"""Owner-side sparse optimizers: one update per touched row per step, on the summed gradient.

Why owner-side: a row's optimizer state (Adagrad accumulators) lives with its only writable copy,
so applying the gradient summed over all workers once per step keeps the state exact, the same as
the single-process reference. Formulas follow torch.optim.Adagrad (lr_decay = 0) with the
accumulator starting at `init` (initial_accumulator_value).
"""
from __future__ import annotations

import torch


class SparseOptimizer:
    """Updates rows `idx` (unique: gather, update, scatter back) of `weight` [R, d] with
    gradients `grad` [len(idx), d]."""

    name = "base"

    def __init__(self, weight: torch.Tensor, lr: float, eps: float, init: float = 0.0) -> None:
        self.weight, self.lr, self.eps, self.init = weight, lr, eps, init

    def step(self, idx: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def _write(self, idx: torch.Tensor, step: torch.Tensor) -> None:
        """weight[idx] -= lr * step for distinct idx (select + copy: index_add_ is ~4x slower
        on CPU for scattered rows of a large table)."""
        self.weight.index_copy_(0, idx, self.weight.index_select(0, idx) - self.lr * step)


class SparseSGD(SparseOptimizer):
    name = "sgd"

    def step(self, idx, grad):
        self._write(idx, grad)


class SparseAdagrad(SparseOptimizer):
    """Element-wise Adagrad: state += g^2; w -= lr * g / (sqrt(state) + eps)."""

    name = "adagrad"

    def __init__(self, weight, lr, eps, init=0.0):
        super().__init__(weight, lr, eps, init)
        self.state = torch.full_like(weight, init)

    def step(self, idx, grad):
        s = self.state.index_select(0, idx) + grad * grad
        self.state.index_copy_(0, idx, s)
        self._write(idx, grad / (s.sqrt() + self.eps))

    def state_tensors(self):
        return {"sum": self.state}


class SparseRowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad (FBGEMM's): one accumulator per row, state += mean(g^2)."""

    name = "rowwise_adagrad"

    def __init__(self, weight, lr, eps, init=0.0):
        super().__init__(weight, lr, eps, init)
        self.state = torch.full((weight.shape[0],), init, dtype=weight.dtype, device=weight.device)

    def step(self, idx, grad):
        s = self.state.index_select(0, idx) + (grad * grad).mean(1)
        self.state.index_copy_(0, idx, s)
        self._write(idx, grad / (s.sqrt() + self.eps)[:, None])

    def state_tensors(self):
        return {"sum": self.state}


SPARSE_OPTIMIZERS = {c.name: c for c in (SparseSGD, SparseAdagrad, SparseRowWiseAdagrad)}


def make_sparse_optimizer(name: str, weight: torch.Tensor, lr: float, eps: float,
                          init: float = 0.0) -> SparseOptimizer:
    try:
        return SPARSE_OPTIMIZERS[name](weight, lr, eps, init)
    except KeyError:
        raise ValueError(f"optim.sparse={name!r} is not one of {sorted(SPARSE_OPTIMIZERS)}") from None
