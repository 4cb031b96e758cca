"""PaddedStep: the W > 1 training step with every tensor between its collectives at a fixed shape
(train.cuda_graph=on at W > 1).

Why: the eager W > 1 step sizes its alltoalls by the batch (plan_lookup reads the unique ids per
owner back to the host: the split sizes) and every tensor after them by the same counts, so no
part of the sparse half can be replayed from a CUDA graph, and the host waits for the device
once a step before it can queue the exchange. Here each rank asks every owner for its rows in a
block of C slots fixed by the config (embedding/padded.py: padded_request), so every alltoall
has the split sizes [C] x W, known before the step, and every tensor has a size set by the
config. Nothing is read back (the unique count and the ids past a block's capacity stay on the
device until the loss's one read).

The step, in the stages of TrainPipeline (pipeline.py, step.py):
  lookup       the request [W x C] (ids the batch holds of owner w in block w, ascending, then
               padding) -> alltoall of ids -> each owner reads the [W x C] rows asked of it
               (padding: any row) -> alltoall of rows -> the workspace [W x C, d] (this rank's own
               block taken from its own read, unrounded by the wire, as the eager step does) ->
               the pooled gather
  forward      the dense half (DenseStep's function: replayed from its CUDA graph on a GPU)
  backward     the pooled rows' gradient into the workspace
  update_rows  the workspace's gradient leaves ([W x C, d], alltoall); the function it returns
               sums what each owner received per row (padded_combine: K = min(W x C, its rows)
               slots, never exceeded; the own block first, then the peers in rank order, the
               eager step's order, so the sums are the same numbers) and updates them masked
               (ShardStore.apply_masked, versions advanced by the updates folded in)
A dropped step (train.nonfinite=skip) changed nothing: the update is the last stage.

Equal results: the same rows, the same sums in the same order, the same optimizer arithmetic as
train.cuda_graph=off at the same W, bit for bit on a CPU (tests/distributed/test_padded_step.py).

Cost: the wire carries W x C slots each way, not the batch's unique ids: C is by default the
bound (per table the fewer of local batch x max bag and the rows rank 0 owns), which no batch
exceeds; train.unique_capacity sets a smaller block (less wire, memory and work), and a batch
that asks one owner for more stops the run naming the key. train.cuda_graph=dense keeps the
eager sparse half (no padding) with the dense half replayed.

Refused (config time, as at W = 1): what cannot be padded yet (dynamic tables, a cache, a
placement, Herald, stochastic rounding of half rows, the audit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import kernels

from ..base.comm import Collectives
from ..base.config import Config
from ..workload.data.batch import Batch
from ..sparse.embedding import HybridEmbedding
from ..sparse.embedding.exchange import wire_dtype
from ..sparse.embedding.padded import BagPadding, PaddedRequest, padded_combine, padded_request, unique_capacity
from .dense_step import DenseStep
from .precision import DensePrecision
from .eager import StepContext
from .whole_step import CapacityCheck

__all__ = ["PaddedStep"]


@dataclass
class _Lookup:
    """What a padded lookup leaves for the step's update: the request, the storage rows peers
    asked this rank for ([W x C], by peer) and the workspace leaf."""

    request: PaddedRequest
    served: torch.Tensor
    ws: torch.Tensor


class PaddedStep(CapacityCheck, DenseStep):
    """The strategy of train.cuda_graph=on at W > 1 (see the module docstring)."""

    plans_ahead = False  # the step prepared ahead is its batch only (its lookup pads its own plan)

    def __init__(self, c: Config, comm: Collectives, emb: HybridEmbedding, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, precision: DensePrecision,
                 global_batch: int, device: torch.device) -> None:
        DenseStep.__init__(self, emb, model, params, opt, precision, global_batch, device)
        self.comm, self.store, self.sharding = comm, emb.store, emb.sharding
        self.padding = BagPadding(self.sharding, c.data.min_bag, c.data.max_bag)
        w, local, rows = comm.size, global_batch // comm.size, self.sharding.table_rows
        self.bound = unique_capacity(local, c.data.max_bag, rows, world=w)  # never exceeded
        self.capacity = unique_capacity(local, c.data.max_bag, rows, c.train.unique_capacity, world=w)
        self.splits = [self.capacity] * w
        self.row_dtype = emb.exchange.row_dtype
        self.id_dtype = wire_dtype(self.sharding.local_rows + 1)
        r, c_ = comm.rank, self.capacity
        self.own = slice(r * c_, (r + 1) * c_)
        # the owner's entries in the eager step's order: its own block, then the peers' by rank
        blocks = [r] + [p for p in range(w) if p != r]
        self.order = torch.cat([torch.arange(b * c_, (b + 1) * c_) for b in blocks]).to(self.store.device)

    def excess(self, ctx: StepContext) -> torch.Tensor:
        return ctx.inputs.request.excess

    # ---- the stages ------------------------------------------------------------------------
    def lookup(self, ctx: StepContext) -> None:
        self.store.rounding.step = ctx.step
        dense, values, lengths, labels = self.padding.inputs(ctx.flight.batch)
        ids = Batch(dense, values, lengths, labels)
        req = padded_request(self.sharding, self.sharding.global_ids(values, ids.table_index()), self.capacity,
                             self.padding.sentinel)
        served, _ = self.comm.alltoall(req.ids.to(self.id_dtype), self.splits, kind="ids", recv_splits=self.splits)
        served = served.long()
        stored = self._read(served)  # as stored; its own block is what this rank asked itself for
        got, _ = self.comm.alltoall(stored.to(self.row_dtype), self.splits, kind="rows", recv_splits=self.splits)
        ws = got.to(self.store.compute_dtype)
        ws[self.own] = stored[self.own].to(ws.dtype)  # as the eager step: not through the wire
        ws.requires_grad_()
        pooled = kernels.pooled_gather(ws, req.inverse, ids.offsets(), ids.num_tables, mode=self.emb.pooling)
        ctx.pooled = pooled[:labels.shape[0]] if self.padding.ragged else pooled  # the padding's extra sample
        ctx.inputs = _Lookup(req, served, ws)
        own = req.valid[self.own].sum()
        self.emb.stats.record_on_device(int(ctx.flight.batch.values.numel()), req.count, req.count - own)
        self.note_used(req.largest)

    def _read(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows of storage rows idx, padding slots (local_rows) reading the last row."""
        return self.store.local_rows(idx.clamp(max=self.sharding.local_rows - 1))

    def update_rows(self, ctx: StepContext) -> Optional[Callable[[], None]]:
        """The workspace's gradient leaves; the function returned sums and applies what this rank
        receives as owner (module docstring)."""
        look: _Lookup = ctx.inputs
        grad = look.ws.grad if look.ws.grad is not None else torch.zeros_like(look.ws)
        handle = self.comm.alltoall_async(grad.to(self.row_dtype), self.splits, kind="grads",
                                          recv_splits=self.splits)
        step = ctx.step

        def finish() -> None:
            got = handle.wait()[0].to(grad.dtype)
            got[self.own] = grad[self.own]  # its own gradients as they are, as the eager step
            combine = padded_combine(look.served.index_select(0, self.order), self.sharding.local_rows)
            self.store.rounding.step = step
            self.store.apply_masked(combine.rows, combine.sums(got.index_select(0, self.order)), combine.valid,
                                    counts=combine.counts)
        return finish

    def discard(self, ctx: StepContext) -> None:
        """Nothing changed before the update: the step's workspace is simply dropped."""
        ctx.inputs = None

    def most_used(self) -> int:
        """The most slots any rank's step asked one owner for (an allgather: summary() is called
        by every rank)."""
        mine = torch.tensor([CapacityCheck.most_used(self)], dtype=torch.int64)
        return int(self.comm.allgather(mine, kind="meta").max())

    def summary(self) -> dict[str, Any]:
        return {**DenseStep.summary(self), "scope": "step", **self.capacity_summary()}
