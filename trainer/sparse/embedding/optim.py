"""Owner-side sparse optimizers: the state (Adagrad accumulators) and hyper-parameters of the
owner's rows; the update itself is ``kernels.row_update``.

Why owner-side: a row's optimizer state lives with its only writable copy, so applying the gradient
summed over all workers once per step keeps the state exact, the same as the single-process
reference. Why no formula here: the fused scatter + optimizer kernels (Triton on CUDA tensors, the
pure-torch reference on CPU, chosen by the kernels dispatch) hold the one implementation of each
optimizer (torch.optim's formulas, lr_decay = 0); this class only owns the state tensors and the
hyper-parameters: `lr` (the learning-rate schedule, trainer/step/lr.py, sets it before every step) and
`weight_decay` (coupled L2, applied by the kernel once per updated row).

Half-precision rows (embedding.dtype=fp16|bf16): the state stays float32 whatever the rows' type
(an accumulator of squared gradients in fp16 would lose every small term), and the kernel updates
each row in fp32 and writes it back by the run's `Rounding` (embedding.rounding): stochastic,
keyed by (seed, the training step, the row's flat id), or to nearest. Every copy of a row that
runs the real optimizer (its owner, a replica of a hot row, a worker it is lent to) shares the
run's Rounding and keys the row by the same flat id, so all of them round it alike, at any W.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import kernels
from kernels import HALF_DTYPES, OPTIMIZERS

ROUNDINGS = ("stochastic", "nearest")  # embedding.rounding

RowKeys = Callable[[torch.Tensor], torch.Tensor]  # storage rows [n] -> their flat ids [n]
Alloc = Callable[[tuple, torch.dtype, float], torch.Tensor]  # (shape, dtype, fill) -> a tensor of the state


class Rounding:
    """How updated half-precision rows are written back, shared by every optimizer of a run.

    rule: "stochastic" (kernels/rounding.py) or "nearest"; seed: the run's (train.seed); step: the
    training step whose updates are being applied, set by the sparse side's clock
    (HybridEmbedding.clock; a flush's updates take the last step's), so a row's random bits are a
    function of (seed, step, row) only: reproducible, and the same at any W and on a resume.
    on_device(device): the salt of the step also lives in a device value, refreshed whenever the
    step is set, and the kernels read it there (a captured step: one graph for every step)."""

    def __init__(self, rule: str = "stochastic", seed: int = 0) -> None:
        if rule not in ROUNDINGS:
            raise ValueError(f"embedding.rounding={rule!r} is not one of {', '.join(ROUNDINGS)}")
        self.rule, self.seed = rule, seed
        self.salt: Optional[torch.Tensor] = None  # [1] int64: the step's salt on the device (on_device)
        self.step = 0

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        if self.salt is not None:
            self.salt.fill_(kernels.salt_of(self.seed, step))  # a fill: no copy from the host

    def on_device(self, device: torch.device) -> None:
        """Keep the step's salt in a device value the kernels read (set before each step, outside
        any graph); the random bits are the same as from the host's salt."""
        if self.rule == "stochastic" and self.salt is None:
            self.salt = torch.zeros(1, dtype=torch.int64, device=device)
            self.step = self._step

    def at(self, keys: torch.Tensor) -> Optional[kernels.StochasticRounding]:
        """The kernel's rounding of rows with flat ids `keys` at the current step (None: nearest)."""
        if self.rule != "stochastic":
            return None
        return kernels.StochasticRounding(self.salt if self.salt is not None else
                                          kernels.salt_of(self.seed, self.step), keys)


class SparseOptimizer:
    """Optimizer of `weight` [R, d]: state "sum" [R, d] (adagrad), [R] (rowwise_adagrad) or none
    (sgd), float32, starting at `init` (initial_accumulator_value). With half-precision weight,
    `row_keys` (storage rows -> flat ids) and `rounding` say how updated rows are written back
    (neither given: to nearest)."""

    def __init__(self, name: str, weight: torch.Tensor, lr: float, eps: float,
                 init: float = 0.0, weight_decay: float = 0.0, row_keys: Optional[RowKeys] = None,
                 rounding: Optional[Rounding] = None, alloc: Optional[Alloc] = None) -> None:
        """alloc(shape, dtype, fill): where the state lives (default: torch.full in the weight's
        memory; embedding.store=disk: a file of the shard's, embedding/tier.py)."""
        if name not in OPTIMIZERS:
            raise ValueError(f"optim.sparse={name!r} is not one of {sorted(OPTIMIZERS)}")
        self.name, self.weight, self.lr, self.eps, self.init = name, weight, lr, eps, init
        # a captured step's rate (trainer/step/whole_step.py): one fp32 value on the weight's device that
        # the update kernel reads there; its owner fills it with `lr` before every step
        self.lr_on_device: Optional[torch.Tensor] = None
        self.weight_decay = weight_decay
        self.row_keys, self.rounding = row_keys, rounding
        state_dtype = kernels.reference.accumulation_dtype(weight.dtype)  # fp32 (fp64 stays fp64)
        self.state: torch.Tensor | None = None
        full = alloc or (lambda shape, dtype, fill: torch.full(shape, fill, dtype=dtype, device=weight.device))
        if name == "adagrad":
            self.state = full(tuple(weight.shape), state_dtype, init)
        elif name == "rowwise_adagrad":
            self.state = full((weight.shape[0],), state_dtype, init)

    def step(self, idx: torch.Tensor, grad: torch.Tensor, unique: bool = False,
             mask: Optional[torch.Tensor] = None) -> None:
        """Rows idx [n] of weight (repeats allowed unless unique) take grad [n, d], summed per row;
        mask [n] (unique only): rows where it is False are left as they are."""
        lr = self.lr if self.lr_on_device is None else self.lr_on_device
        kernels.row_update(self.weight, idx, grad, optimizer=self.name, lr=lr, eps=self.eps,
                           state=self.state, unique=unique, weight_decay=self.weight_decay,
                           rounding=self._rounding(idx), mask=mask)

    def _rounding(self, idx: torch.Tensor) -> Optional[kernels.StochasticRounding]:
        if self.weight.dtype not in HALF_DTYPES or self.rounding is None or self.row_keys is None:
            return None
        return self.rounding.at(self.row_keys(idx))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.state is None else {"sum": self.state}

    def like(self, weight: torch.Tensor, row_keys: Optional[RowKeys] = None) -> "SparseOptimizer":
        """The same optimizer (name, hyper-parameters, the run's rounding; fresh state) over another
        row set: a replica of hot rows, a holder's lent rows (row_keys: their slots -> flat ids)."""
        return SparseOptimizer(self.name, weight, self.lr, self.eps, self.init, self.weight_decay,
                               row_keys, self.rounding)


def make_sparse_optimizer(name: str, weight: torch.Tensor, lr: float, eps: float,
                          init: float = 0.0, weight_decay: float = 0.0,
                          row_keys: Optional[RowKeys] = None,
                          rounding: Optional[Rounding] = None, alloc: Optional[Alloc] = None) -> SparseOptimizer:
    return SparseOptimizer(name, weight, lr, eps, init, weight_decay, row_keys, rounding, alloc)
