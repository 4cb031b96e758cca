"""Owner-side sparse optimizers: the state (Adagrad accumulators) and hyper-parameters of the
owner's rows; the update itself is ``kernels.row_update``.

Why owner-side: a row's optimizer state lives with its only writable copy, so applying the gradient
summed over all workers once per step keeps the state exact, the same as the single-process
reference. Why no formula here: the fused scatter + optimizer kernels (Triton on CUDA tensors, the
pure-torch reference on CPU, chosen by the kernels dispatch) hold the one implementation of each
optimizer (torch.optim's formulas, lr_decay = 0); this class only owns the state tensors and the
hyper-parameters: `lr` (the learning-rate schedule, trainer/lr.py, sets it before every step) and
`weight_decay` (coupled L2, applied by the kernel once per updated row).
"""
from __future__ import annotations

import torch

import kernels
from kernels.reference import OPTIMIZERS


class SparseOptimizer:
    """Optimizer of `weight` [R, d]: state "sum" [R, d] (adagrad), [R] (rowwise_adagrad) or none
    (sgd), starting at `init` (initial_accumulator_value)."""

    def __init__(self, name: str, weight: torch.Tensor, lr: float, eps: float,
                 init: float = 0.0, weight_decay: float = 0.0) -> None:
        if name not in OPTIMIZERS:
            raise ValueError(f"optim.sparse={name!r} is not one of {sorted(OPTIMIZERS)}")
        self.name, self.weight, self.lr, self.eps, self.init = name, weight, lr, eps, init
        self.weight_decay = weight_decay
        self.state: torch.Tensor | None = None
        if name == "adagrad":
            self.state = torch.full_like(weight, init)
        elif name == "rowwise_adagrad":
            self.state = torch.full((weight.shape[0],), init, dtype=weight.dtype,
                                    device=weight.device)

    def step(self, idx: torch.Tensor, grad: torch.Tensor, unique: bool = False) -> None:
        """Rows idx [n] of weight (repeats allowed unless unique) take grad [n, d], summed per row."""
        kernels.row_update(self.weight, idx, grad, optimizer=self.name, lr=self.lr, eps=self.eps,
                           state=self.state, unique=unique, weight_decay=self.weight_decay)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.state is None else {"sum": self.state}

    def like(self, weight: torch.Tensor) -> "SparseOptimizer":
        """The same optimizer (name, hyper-parameters, fresh state) over another row set: a replica
        of hot rows, a holder's lent rows."""
        return SparseOptimizer(self.name, weight, self.lr, self.eps, self.init, self.weight_decay)


def make_sparse_optimizer(name: str, weight: torch.Tensor, lr: float, eps: float,
                          init: float = 0.0, weight_decay: float = 0.0) -> SparseOptimizer:
    return SparseOptimizer(name, weight, lr, eps, init, weight_decay)
