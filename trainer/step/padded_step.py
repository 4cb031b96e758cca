"""PaddedStep: the W > 1 training step with every tensor between its collectives at a fixed shape
(train.cuda_graph=on at W > 1): DenseStep (the dense half from one CUDA graph) whose sparse half is
HybridEmbedding's fixed-shape mode (trainer/sparse/embedding/fixed/shapes.py: FixedShapes).

Why: the exact-size W > 1 step sizes its alltoalls by the batch (the unique ids per owner, read
back: the split sizes) and every tensor after them by the same counts, so no part of the sparse
half can be replayed from a CUDA graph, and the host waits for the device once a step before it
can queue the exchange. In fixed shapes each rank asks every owner for its rows in a block of C
slots fixed by the config, so every alltoall has the split sizes [C] x W, known before the step,
and nothing is read back (the unique count and the ids past a block's capacity stay on the
device until the loss's one read). This module holds no plan, collective or owner update: the
stages call the embedding's fixed-shape mode (lookup, begin_update, discard) as EagerStep calls
its exact-size one, and keep the dense half, the capture and the capacity's check.

Equal results: the same rows, the same sums in the same order, the same optimizer arithmetic as
train.cuda_graph=off at the same W, bit for bit on a CPU (tests/distributed/test_padded_step.py).

Cost: the wire carries W x C slots each way, not the batch's unique ids: C is by default the
bound (per table the fewer of local batch x max bag and the rows rank 0 owns), which no batch
exceeds; train.unique_capacity sets a smaller block (less wire, memory and work). A request that
overflows a block on any rank is known to every rank from the ids alltoall (each block carries
its requester's excess), so every owner masks the step's updates off; the excess rides the loss's
read, and TrainPipeline trains that step again in exact sizes (cuda_graph.overflow_steps). train.cuda_graph=dense keeps the
exact-size sparse half (no padding) with the dense half replayed.

Not this step: what has no fixed-shape mode yet (dynamic tables;
fixed/shapes.py without_fixed_shapes, docs/gpu.md) trains with the dense half captured and the
sparse half in exact sizes (TrainPipeline chooses DenseStep and says so).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..base.comm import Collectives
from ..base.config import Config
from ..sparse.embedding import HybridEmbedding
from ..sparse.embedding.fixed.shapes import FixedShapes
from .dense_step import DenseStep
from .precision import DensePrecision
from .eager import StepContext
from .whole_step import CapacityCheck

__all__ = ["PaddedStep"]


class PaddedStep(CapacityCheck, DenseStep):
    """The strategy of train.cuda_graph=on at W > 1 (see the module docstring)."""

    plans_ahead = False  # the step prepared ahead is its batch only (its lookup pads its own plan)

    def __init__(self, c: Config, comm: Collectives, emb: HybridEmbedding, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, precision: DensePrecision,
                 global_batch: int, device: torch.device) -> None:
        DenseStep.__init__(self, emb, model, params, opt, precision, global_batch, device)
        self.comm = comm
        self.sparse = FixedShapes(emb, c.data.min_bag, c.data.max_bag, global_batch // comm.size,
                                  c.train.unique_capacity, c.train.capacity_margin)

    def excess(self, ctx: StepContext) -> torch.Tensor:
        return ctx.inputs

    # ---- the stages ------------------------------------------------------------------------
    def lookup(self, ctx: StepContext) -> None:
        ctx.pooled = self.sparse.lookup(ctx.flight)
        ctx.inputs = self.sparse.excess(ctx.flight)  # rides the loss's read (carry)

    def update_rows(self, ctx: StepContext) -> Optional[Callable[[], None]]:
        """The row gradients leave; the function returned applies what this rank owns."""
        return self.sparse.begin_update(ctx.flight)

    def discard(self, ctx: StepContext) -> None:
        """The step dropped, or trained again (ctx.again): its workspace is let go, and the HET
        cache's changes undone (FixedShapes.discard)."""
        self.sparse.discard(ctx.flight, ctx.again)
        ctx.inputs = None

    def summary(self) -> dict[str, Any]:
        return {**DenseStep.summary(self), "scope": "step", **self.capacity_summary()}
