"""DenseStep: the dense half of a training step, replayed from one CUDA graph (train.cuda_graph=dense;
PaddedStep, train.cuda_graph=on at W > 1, builds on it).

Why: at small batches the GPU step is launch-bound (benchmarks/reports/2026-11-26-gpu-step.md:
~1,000 aten ops for ~1 ms of GPU work at 2,048 samples). The dense half (the model's forward under
autocast, the loss, the backward to every dense parameter and to the pooled rows) has shapes fixed
by the config, so it can be captured once and replayed as one launch; the sparse half (lookup
plans, unique ids, the rows' update) has sizes that depend on the ids and stays eager.

How: the step is split where the two halves meet. The pooled rows enter the dense half as a
leaf (`pooled.detach()` that takes a gradient); the dense half returns the loss, the dense
gradients and the pooled rows' gradient (torch.autograd.grad: fresh outputs, nothing
accumulated); the pipeline then sends that gradient into the embedding's backward
(`rows_backward`, this strategy's backward stage) after its non-finite check, exactly where the
one-piece backward would have reached it. The rest is EagerStep's (step.py: the sparse half
eager), and the order and the step's end are TrainPipeline's (pipeline.py). On a CPU there is no
graph: `on` runs the same split step eagerly, and it equals the one-piece step (`off`) bit for
bit (tests/unit/test_dense_step.py), which is what makes the graph a replay of the same arithmetic on
CUDA.

On CUDA (`on`): the first call warms the function up on a side stream (twice, discarded: a pure
function of its inputs, the parameters untouched) and captures it into a torch.cuda.CUDAGraph
over static input buffers (the batch's dense features, the pooled rows, the labels); every call
copies its inputs into them and replays. The outputs are the graph's own tensors, overwritten by
the next replay: every use of them is queued on the stream before it. A batch of another shape
runs eagerly (the graph is for the config's local batch). Autocast runs with its weight cache off
during capture (as torch.cuda.graphs asks). The parameters must keep their storage (optimizers,
checkpoint loads and snapshots copy into them in place; nothing in the trainer replaces them).
Not with fp16 (the loss scale changes between steps): refused at config time.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..sparse.embedding import HybridEmbedding
from .precision import DensePrecision
from .eager import EagerStep, StepContext, dense_loss

__all__ = ["DenseStep"]

_WARMUP = 2  # side-stream runs before the capture (cuBLAS handles, autocast, allocator pools)


class DenseStep(EagerStep):
    """The strategy of train.cuda_graph=dense: EagerStep whose forward is
    forward_backward(dense, pooled, labels) -> (loss, dense grads, pooled rows' grad) and whose
    backward is rows_backward (see the module docstring). Captured on CUDA; eager elsewhere."""

    def __init__(self, emb: HybridEmbedding, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 opt: torch.optim.Optimizer, precision: DensePrecision, global_batch: int,
                 device: torch.device) -> None:
        super().__init__(emb, model, params, opt, precision, global_batch)
        self.autocast = precision.autocast
        self.capture = device.type == "cuda"
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_in: tuple[torch.Tensor, ...] = ()
        self.static_out: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor] | None = None
        self.replays = 0  # steps replayed from the graph (summary.json)
        # train.cuda_graph=on where the sparse side has no fixed-shape mode yet: why (summary.json)
        self.dense_only: Optional[str] = None
        self.eager_steps = 0  # steps run eagerly (no graph, or a batch of another shape)

    def forward(self, ctx: StepContext) -> None:
        batch = ctx.flight.batch
        ctx.loss, ctx.grads, ctx.rows_grad = self.forward_backward(batch.dense, ctx.pooled, batch.labels)

    def backward(self, ctx: StepContext) -> None:
        self.rows_backward(ctx.pooled, ctx.rows_grad)

    def _compute(self, dense: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor,
                 cache: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The dense half on a leaf `rows`: (loss, grads of self.params, grad of rows)."""
        loss = dense_loss(self.model, self.autocast(cache=cache), dense, rows, labels, self.global_batch)
        got = torch.autograd.grad(loss, [*self.params, rows], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(got[:-1], self.params)]
        return loss.detach(), grads, got[-1] if got[-1] is not None else torch.zeros_like(rows)

    def forward_backward(self, dense: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor
                         ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(loss, dense gradients, the pooled rows' gradient) of this batch; `pooled` itself
        is not differentiated here (rows_backward does that)."""
        other_shape = self.graph is not None and \
            tuple(t.shape for t in (dense, pooled, labels)) != tuple(t.shape for t in self.static_in)
        if not self.capture or other_shape:
            self.eager_steps += 1
            return self._compute(dense, pooled.detach().requires_grad_(), labels)
        if self.graph is None:
            self._capture(dense, pooled, labels)
        with torch.no_grad():  # the static rows are a leaf that takes a gradient
            for buf, src in zip(self.static_in, (dense, pooled.detach(), labels)):
                buf.copy_(src)
        self.graph.replay()
        self.replays += 1
        return self.static_out

    @staticmethod
    def rows_backward(pooled: torch.Tensor, grad: torch.Tensor) -> None:
        """The embedding's half of the backward: the pooled rows' gradient into their lookup."""
        if pooled.requires_grad:
            pooled.backward(grad)

    def _capture(self, dense: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor) -> None:
        self.static_in = (dense.clone(), pooled.detach().clone().requires_grad_(), labels.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                self._compute(*self.static_in, cache=False)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self._compute(*self.static_in, cache=False)

    def summary(self) -> dict[str, Any]:
        out = {"captured": self.graph is not None, "replays": self.replays, "eager_steps": self.eager_steps,
               "scope": "dense"}
        if self.dense_only is not None:
            out["dense_only"] = self.dense_only
        return out
