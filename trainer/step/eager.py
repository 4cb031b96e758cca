"""A training step's state, and how a step computes: the strategies of TrainPipeline (pipeline.py).

The pipeline owns the order of a step (TrainPipeline.progress) and its end; a strategy only
computes the stages the pipeline calls, in this order, on the step's StepContext:

  lookup       the batch's rows (before the next step is prepared during this one)
  forward      the loss; the graphs also give the dense gradients with it
  carry        values that ride the loss's one read (the whole step: the ids past its capacity)
  check        those values, read back
  backward     the rest of the backward, after train.nonfinite=skip's check of the loss
  update_rows  the rows' update begun (the row gradients leave); returns what completes it (the
               owners' update, while the dense allreduce travels), or None when the rows are updated
               already (the whole step's function did it)
  discard      the step dropped on every rank (a non-finite loss, an fp16 overflow): undo its lookup

The strategies (train.cuda_graph and W choose one, TrainPipeline._choose):
- EagerStep (here; cuda_graph=off): HybridEmbedding's lookup, the model's forward under
  train.precision, loss.backward(), HybridEmbedding's update, op by op;
- DenseStep (dense_step.py; cuda_graph=dense): EagerStep with the dense half (forward, loss,
  backward to the parameters and the pooled rows) as one function, replayed from a CUDA graph;
- WholeStep (whole_step.py; cuda_graph=on at W = 1): the whole step, from the ids to the updated
  rows, as one function of fixed shapes, replayed from a CUDA graph;
- PaddedStep (padded_step.py; cuda_graph=on at W > 1): DenseStep whose sparse half has fixed shapes
  too, the alltoalls padded to blocks per owner.
The sparse half is the embedding's in every strategy: HybridEmbedding's exact-size mode (EagerStep,
DenseStep) or its fixed-shape mode (trainer/sparse/embedding/fixed/shapes.py: WholeStep, PaddedStep); no
strategy holds a lookup plan or a collective of its own.
On a CPU the graphs' functions run eagerly and equal EagerStep bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from ..sparse.embedding import HybridEmbedding, InFlightStep
from .precision import DensePrecision

__all__ = ["EagerStep", "StepContext", "StepStrategy", "dense_loss"]


def dense_loss(model: torch.nn.Module, autocast: ContextManager, dense: torch.Tensor, rows: torch.Tensor,
               labels: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The training loss of this rank's batch: the model's forward under `autocast`, BCE summed
    and divided by the global batch (so the ranks' losses add up to the global mean). The one
    expression of both steps, split or not: the same values either way."""
    with autocast:
        logits = model(dense, rows)
    return F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="sum") / global_batch


@dataclass
class StepContext:
    """One step's state from its start to its end (TorchRec's TrainPipelineContext): what the
    stages hand each other. The sparse side's part is the InFlightStep (trainer/sparse/embedding/types.py:
    batch, plan, the begun read, the workspace), which the embedding module takes as it is."""

    flight: InFlightStep
    pooled: Optional[torch.Tensor] = None  # the lookup's rows for the model, [B, T, d]
    inputs: Any = None  # WholeStep: its function's padded inputs (dense, ids, lengths, labels)
    loss: Optional[torch.Tensor] = None  # this rank's loss
    grads: list[torch.Tensor] = field(default_factory=list)  # the dense gradients, in the parameters' order
    rows_grad: Optional[torch.Tensor] = None  # DenseStep: the pooled rows' gradient, for their lookup
    count: Optional[torch.Tensor] = None  # WholeStep: the batch's unique ids (on the device)
    again: bool = False  # a fixed-shape step that overflowed its capacity: trained again in exact sizes

    @property
    def step(self) -> int:
        return self.flight.step


class StepStrategy:
    """How a step computes (see the module docstring); the defaults are the stages a strategy
    has nothing to do in."""

    plans_ahead = True  # the step prepared ahead gets its lookup plan and its begun read
    may_overflow = False  # a fixed-shape step below its bound, now or once measured (whole_step.CapacityCheck)
    overflows_now = False  # ... below it now: the loss's read carries the excess

    def lookup(self, ctx: StepContext) -> None:
        raise NotImplementedError

    def forward(self, ctx: StepContext) -> None:
        raise NotImplementedError

    def carry(self, ctx: StepContext, carry: torch.Tensor) -> torch.Tensor:
        return carry

    def check(self, ctx: StepContext, values: list[float]) -> None:
        """`values`: what carry() added, reduced over the ranks and read with the loss."""

    def backward(self, ctx: StepContext) -> None:
        pass

    def update_rows(self, ctx: StepContext) -> Optional[Callable[[], None]]:
        return None

    def discard(self, ctx: StepContext) -> None:
        pass

    def summary(self) -> Optional[dict[str, Any]]:
        """summary.json's `cuda_graph` (None: no graph)."""
        return None


class EagerStep(StepStrategy):
    """train.cuda_graph=off: the step op by op (see the module docstring)."""

    def __init__(self, emb: HybridEmbedding, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 opt: torch.optim.Optimizer, precision: DensePrecision, global_batch: int) -> None:
        self.emb, self.model, self.params, self.opt = emb, model, params, opt
        self.precision, self.global_batch = precision, global_batch

    def lookup(self, ctx: StepContext) -> None:
        ctx.pooled = self.emb.lookup(ctx.flight)

    def forward(self, ctx: StepContext) -> None:
        batch = ctx.flight.batch
        ctx.loss = dense_loss(self.model, self.precision.autocast(), batch.dense, ctx.pooled, batch.labels,
                              self.global_batch)

    def backward(self, ctx: StepContext) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.precision.backward(ctx.loss)
        ctx.grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def update_rows(self, ctx: StepContext) -> Optional[Callable[[], None]]:
        return self.emb.begin_update(ctx.flight)

    def discard(self, ctx: StepContext) -> None:
        self.emb.discard(ctx.flight)
