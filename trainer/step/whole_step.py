"""WholeStep: the whole W = 1 training step as one function of fixed shapes (train.cuda_graph=on).

Why: at W = 1 DenseStep (dense_step.py) leaves the sparse half eager, because its sizes depend
on the ids: the lookup plan reads the batch's unique count back every step and sizes the
workspace, its gradient and the owner update by it (benchmarks/reports/2026-11-26-gpu-step.md:
those launches and that read are what the GPU waits for). Here the plan is padded to a capacity
fixed by the config (the embedding's fixed-shape mode, trainer/sparse/embedding/fixed/shapes.py), so
everything from the batch's ids to the updated rows is one function whose every tensor has a size
set by the config, which reads nothing back: the lookup plan, the workspace gathered from the
shard (and the replica, with a placement), the pooled gather, the model's forward under autocast,
the loss, the backward to the dense parameters and to the workspace, and the owner's masked update
of the rows (FixedShapes.whole_rows / whole_update: this module holds no sparse arithmetic). It returns the loss and the dense
gradients; it is a strategy of TrainPipeline (pipeline.py, the stages in step.py), whose end of a
step follows as for the eager step: the dense allreduce (a copy at W = 1), the dense optimizer's
step and the loss's one read.

The capacity: by default the bound (per table the fewer of local batch x max bag and its rows),
which no batch exceeds; train.unique_capacity sets a smaller one (less memory and work: the
padding is most of the slots when bags are multi-hot). A batch past it changes nothing (the
update's mask holds count <= capacity, a device value) and its excess rides the loss's read (no
other read): TrainPipeline then trains that step again through the exact-size sparse half
(summary.json's cuda_graph.overflow_steps counts them), so any capacity is exact and a small
one costs only the rare step run twice.

Ragged bags (data.min_bag < data.max_bag) make the batch's own id count vary: the ids are
padded to local batch x tables x max bag, the padding entries in one extra bag of an extra
sample (dropped from the pooled rows before the model), their ids the sentinel the plan leaves
out. Bags of one fixed length need no padding.

train.nonfinite=skip: the update's mask also holds "the loss is finite" (a device value), so a
non-finite step changes no row without the host deciding first (nothing to discard); the dense
step is skipped after the loss is read, as in the eager step. Equal results: on a CPU this runs
eagerly and equals train.cuda_graph=off bit for bit (tests/unit/test_whole_step.py).

On CUDA: the function is captured into one torch.cuda.CUDAGraph over static inputs (dense,
padded ids, lengths, labels) and replayed. The warm-up runs before the capture (side stream,
twice) mask every row: the update kernels run and touch nothing. The sparse optimizer's rate:
with the Triton kernels it is a device value the update kernel reads (SparseOptimizer.lr_on_device,
filled before every step, outside the graph), so one graph serves a warmup and a decay too. With
kernels.backend=reference the rate is a constant of the captured arithmetic: the graph is captured
for one rate, a step whose rate differs from the step before runs eagerly, and the first two
steps at a new constant rate capture it again. A batch of another shape runs eagerly.
Not this step at W = 1: what has no fixed-shape mode yet (dynamic tables, the audit;
fixed/shapes.py without_fixed_shapes, docs/gpu.md) trains with the dense half captured and the sparse
half in exact sizes (TrainPipeline chooses DenseStep and says so). A cache and the consistency
bounds, Herald, stochastic rounding of half rows run here: every row is local at W = 1, no cache is
built and nothing is lent (as with cuda_graph=off).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch

import kernels

from ..base.comm import Collectives
from ..base.config import Config
from .dense_step import _WARMUP
from ..sparse.embedding import HybridEmbedding
from ..sparse.embedding.fixed.shapes import FixedShapes
from .eager import StepContext, StepStrategy, dense_loss

__all__ = ["CapacityCheck", "WholeStep"]

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class CapacityCheck(StepStrategy):
    """The end of a step padded to a capacity (WholeStep, PaddedStep; the capacity and its
    statistics are the fixed-shape mode's, `sparse`): the unique ids past it (excess(ctx), on the
    device) ride the loss's read, summed over the ranks; a step past it is trained again in exact
    sizes (TrainPipeline)."""

    sparse: FixedShapes

    @property
    def capacity(self) -> int:
        return self.sparse.capacity

    @property
    def bound(self) -> int:
        return self.sparse.bound

    def excess(self, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def capacity_summary(self) -> dict[str, Any]:
        """summary.json's view of the capacity (FixedShapes.summary). Collective at W > 1."""
        return self.sparse.capacity_summary()

    @property
    def overflows_now(self) -> bool:
        return self.sparse.can_overflow

    def carry(self, ctx: StepContext, carry: torch.Tensor) -> torch.Tensor:
        """The unique ids past the capacity ride the loss's read."""
        if self.overflows_now:
            carry = torch.cat([carry, self.excess(ctx).to(carry.dtype).reshape(1)])
        return carry

    @property
    def may_overflow(self) -> bool:
        """A capacity below the bound, now or once measured: a batch may need more slots
        (TrainPipeline then trains the step again in exact sizes; this step's updates were
        masked off on the device)."""
        follows = self.sparse.het is not None and self.sparse.rule != "bound"  # the HET blocks (fixed/het.py)
        return self.sparse.can_overflow or self.sparse.measuring or follows

    def check(self, ctx: StepContext, values: list[float]) -> None:
        """A batch past train.unique_capacity on any rank (values[0]: the ids past it, summed over
        the ranks): the step is trained again in exact sizes (ctx.again; nothing changed)."""
        if values and values[0] > 0:
            ctx.again = True


class WholeStep(CapacityCheck):
    """The strategy of train.cuda_graph=on at W = 1: one step's function of fixed shapes (see the
    module docstring); the step prepared ahead is its batch only (no plan: this step pads its own)."""

    plans_ahead = False

    def __init__(self, c: Config, comm: Collectives, emb: HybridEmbedding, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], autocast: Callable[..., ContextManager], global_batch: int,
                 device: torch.device) -> None:
        self.emb, self.store = emb, emb.store
        self.model, self.params, self.autocast = model, params, autocast
        self.global_batch = global_batch
        self.sparse = FixedShapes(emb, c.data.min_bag, c.data.max_bag, global_batch // comm.size,
                                  c.train.unique_capacity, c.train.capacity_margin)
        self.skip = c.train.nonfinite == "skip"
        self.capture = device.type == "cuda"
        # the rate read on the device (Triton's update kernel): one graph for every rate
        self.rate = (torch.zeros(1, dtype=torch.float32, device=device)
                     if self.capture and kernels.use_triton(device) else None)
        self.store.optimizer.lr_on_device = self.rate
        # half rows rounded stochastically: the step's salt is a device value (one graph, every step)
        self.store.rounding.on_device(device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_lr: Optional[float] = None
        self.last_lr: Optional[float] = None
        self.static_in: tuple[torch.Tensor, ...] = ()
        self.static_out: Any = None
        self.replays = 0  # steps replayed from the graph (summary.json)
        self.eager_steps = 0  # steps run eagerly (a CPU, a changing rate, a batch of another shape)

    # ---- the stages (step.py) -------------------------------------------------------------
    def lookup(self, ctx: StepContext) -> None:
        """The padded inputs of the step's function (the lookup is inside it)."""
        self.emb.clock(ctx.step)
        if self.sparse.begin_step():  # the capacity measured: the plan's shapes change (once)
            self.graph = None
        ctx.inputs = self.sparse.padding.inputs(ctx.flight.batch)

    def forward(self, ctx: StepContext) -> None:
        """The step's function: the loss, the dense gradients, the rows updated (masked)."""
        ctx.loss, ctx.grads, counts = self._run(ctx.inputs)
        ctx.count = counts[0]  # the plan's unique ids (the capacity's); counts[1] with the replicated ones
        self.emb.stats.record_on_device(int(ctx.flight.batch.values.numel()), counts[1])
        self.sparse.note_used(ctx.count)

    def excess(self, ctx: StepContext) -> torch.Tensor:
        return (ctx.count - self.capacity).clamp(min=0)

    def _compute(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                 labels: torch.Tensor, cache: bool = True, warm: bool = False
                 ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The step's function: (loss, dense gradients, [2] the plan's unique ids and the batch's
        with the replicated rows), the rows updated in place (warm: a warm-up before the capture,
        whose update masks every row)."""
        plan, ws, pooled, touched = self.sparse.whole_rows(dense, values, lengths, labels)
        loss = dense_loss(self.model, self.autocast(cache=cache), dense, pooled, labels, self.global_batch)
        got = torch.autograd.grad(loss, [*self.params, ws], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(got[:-1], self.params)]
        mask = torch.zeros_like(plan.valid) if warm else plan.valid
        # the step changes a row only where its loss is finite (skip) and its plan fits the capacity
        # (below the bound: an overflowing step is trained again in exact sizes, TrainPipeline)
        keep = torch.isfinite(loss) if self.skip else None
        if self.capacity < self.bound:
            fits = plan.count <= self.capacity
            keep = fits if keep is None else keep & fits
        if warm:
            keep = torch.zeros_like(plan.count, dtype=torch.bool)
        if keep is not None:
            mask = mask & keep
        # the padding slots' gradient is zero (no entry points there): where nothing else masks
        # the update it is zero wherever the mask is False
        self.sparse.whole_update(plan, got[-1], ws, mask, zero_outside=keep is None, touched=touched,
                                 finite=keep)
        unique = plan.count if touched is None else plan.count + touched.sum()
        return loss.detach(), grads, torch.stack([plan.count, unique])

    # ---- eager or replayed ---------------------------------------------------------------
    def _run(self, inputs: Inputs) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        if not self.capture:
            self.eager_steps += 1
            return self._compute(*inputs)
        lr: Optional[float] = self.store.optimizer.lr
        if self.rate is not None:  # the kernel reads the rate: every step's rate is the graph's
            self.rate.fill_(lr)
            lr = None
        steady, self.last_lr = lr == self.last_lr, lr
        same_shape = self.graph is None or \
            tuple(t.shape for t in inputs) == tuple(t.shape for t in self.static_in)
        if self.graph is not None and lr != self.graph_lr and steady:
            self.graph = None  # a new constant rate: capture it
        if self.graph is None and steady:
            self._capture(inputs, lr)
        if self.graph is None or lr != self.graph_lr or not same_shape:
            self.eager_steps += 1
            return self._compute(*inputs)
        with torch.no_grad():
            for buf, src in zip(self.static_in, inputs):
                buf.copy_(src)
        self.graph.replay()
        self.replays += 1
        return self.static_out

    def _capture(self, inputs: Inputs, lr: Optional[float]) -> None:
        self.static_in = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                self._compute(*self.static_in, cache=False, warm=True)  # updates no row
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self._compute(*self.static_in, cache=False)
        self.graph_lr = lr

    def summary(self) -> dict[str, Any]:
        return {"captured": self.graph is not None, "replays": self.replays, "eager_steps": self.eager_steps,
                "scope": "step", **self.capacity_summary()}
