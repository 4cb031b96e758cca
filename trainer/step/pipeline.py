"""TrainPipeline: one owner of a training step's order, its state and its clock.

progress(step) runs one step of this rank in a fixed order (as TorchRec's
TrainPipelineSparseDist.progress does), for every strategy (step.py: how a step computes, chosen
by train.cuda_graph and W: EagerStep, DenseStep, WholeStep):

  1. the clock: `step` is the step in progress (the rates of lr.py set for it; the failure
     advice's position); the step taken: the one prepared during the step before, else a new one
     with its batch (start). Its state travels in a StepContext (step.py)
  2. lookup (the strategy)
  3. prefetch: the next step's input side, made during this one (see below)
  4. forward (the strategy: the loss; the graphs' dense gradients with it)
  5. the end of a step, written once here (_end): the loss's reduction carries the stop signals'
     flag (trainer/run/signals.py) and the strategy's values. train.nonfinite=stop: it travels
     with the dense gradients and a non-finite loss raises (the run stops, no checkpoint is
     written after it); skip: it is reduced first (one extra allreduce of 4 bytes, 8 with W > 1)
     and, when not finite, every rank drops the step before anything changed. Then the rest of
     the backward (the strategy); fp16: one reduction tells every rank whether any gradient
     overflowed (with the loss in stop mode), and every rank drops the step (precision.py); the
     rows' update with the dense allreduce (train.pipeline != off: the allreduce starts behind the
     row gradients and travels while the owners update); the dense optimizer's step (with
     train.cuda_graph dense / on from its own graph: dense_update.py); the loss read and checked
  6. a fixed-shape step (train.cuda_graph=on) whose batch needed more slots than its capacity on
     some rank (the excess rides the loss's read; the dense step waits for it) changed nothing, and
     is trained again by the exact-size strategy (_again: EagerStep at W = 1, DenseStep above)
  7. finish: the step's alltoalls counted

Why the steps in flight are this object's too (TorchRec's pipeline owns the next batch's input
distribution the same way): with train.pipeline (default `ids`) two steps are in flight at once.
During step i's forward and backward, step i+1's batch is made and copied to the device, its
lookup plan made and its id requests sent; with `ids` and the ranks on several hosts the owners
also send the rows of step i+1 that step i's update leaves unchanged (comm.settled_rows), with
`rows` all of them (one step staler, within the pull bound). Only work that depends on no update
of step i moves into step i, so the run stays exact (docs/design.md, section 4). Both steps are
InFlightStep objects (trainer/sparse/embedding/types.py): `current`, the step being trained, and `next`,
the step prepared ahead; HybridEmbedding and the remote-row protocols take them as arguments and
keep no step of their own. The alltoall count per step (summary.json's alltoall calls per hot /
cold step): the collectives counter's difference over the step, minus the calls made for the next
step during it, plus those made for it during the step before.
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from ..base.comm import Collectives
from ..base.config import Config
from ..base.core.device import to_device
from ..base.core.errors import TrainingError
from ..sparse.embedding import InFlightStep
from ..sparse.embedding.fixed.shapes import without_fixed_shapes
from ..sparse.side import Sparse
from ..workload.data.source import DataSource
from ..base.core.signals import SIGNALS
from .dense_step import DenseStep
from .dense_update import DenseUpdate
from .lr import LrSchedule
from .padded_step import PaddedStep
from .precision import DensePrecision
from .eager import EagerStep, StepContext, StepStrategy
from .whole_step import WholeStep


__all__ = ["TrainPipeline"]


class TrainPipeline:
    """This rank's training steps: progress(step) trains one (see the module docstring).
    `saves_after(done)`: whether a checkpoint follows `done` steps (a flush: train.pipeline=rows
    answers no read across it)."""

    def __init__(self, c: Config, comm: Collectives, sparse: Sparse, data: DataSource, device: torch.device,
                 saves_after: Callable[[int], bool], *, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 opt: torch.optim.Optimizer, precision: DensePrecision, lr: LrSchedule, global_batch: int) -> None:
        self.c, self.comm, self.data, self.device = c, comm, data, device
        self.emb, self.feed = sparse.emb, sparse.feed
        self.model, self.params, self.opt, self.precision, self.lr = model, params, opt, precision, lr
        self.saves_after = saves_after
        self.skip = c.train.nonfinite == "skip"
        self.strategy = self._choose(model, global_batch)
        # a fixed-shape step that overflowed its capacity is trained again by the exact-size one
        self.exact: Optional[StepStrategy] = None
        if self.strategy.may_overflow:
            self.exact = (EagerStep(self.emb, model, self.params, self.opt, self.precision, global_batch)
                          if comm.size == 1 else
                          DenseStep(self.emb, model, self.params, self.opt, self.precision, global_batch, device))
        self.again = 0  # steps trained again (summary.json's cuda_graph.overflow_steps)
        # the dense optimizer's step from its own graph (dense_update.py) where the step is graphed
        self.dense = DenseUpdate(opt, params, device) if c.train.cuda_graph != "off" else None
        self.plans = self.strategy.plans_ahead  # False: the step prepared ahead is its batch only
        self.mode = c.train.pipeline  # off | ids | rows
        # Herald plans its sync step by step against its flushes: nothing is planned early
        self.overlaps = self.mode != "off" and sparse.herald is None
        # train.pipeline=ids: the settled rows travel early where bytes cost time, between hosts
        # (on one host the extra round trip measured more than the rows it moves ahead)
        # (not with dynamic tables: step i+1's admissions must not run before step i's update)
        self.settled = self.mode == "ids" and not self.emb.store.dynamic and (
            c.comm.settled_rows == "always" or (c.comm.settled_rows == "auto" and comm.spans_hosts))
        self.step: Optional[int] = None  # the clock: the step in progress, or the last one begun
        self.current: Optional[InFlightStep] = None  # the step being trained
        self.next: Optional[InFlightStep] = None  # the step prepared ahead
        self.alltoalls = {"hot": 0, "cold": 0}  # alltoall calls of this rank in hot / other steps
        self._calls_at_start = 0

    def _choose(self, model: torch.nn.Module, global_batch: int) -> StepStrategy:
        """train.cuda_graph=on: at W = 1 the whole step (whole_step.py), at W > 1 the step with
        fixed shapes between its collectives (padded_step.py), where the sparse side has a
        fixed-shape mode; where it has none yet (without_fixed_shapes: dynamic tables, the
        audit at W = 1) the dense half captured and the sparse half
        in exact sizes, said once here and in summary.json (cuda_graph.dense_only); dense: the
        dense half from one graph (dense_step.py); off: the eager step (eager.py)."""
        graph = self.c.train.cuda_graph
        why = without_fixed_shapes(self.emb) if graph == "on" else None
        if why is not None:
            if self.comm.rank == 0:
                print(f"[trainer] train.cuda_graph=on: {why}; the dense half is captured and the sparse half "
                      "runs in exact sizes (as train.cuda_graph=dense; docs/gpu.md)", file=sys.stderr)
            step = DenseStep(self.emb, model, self.params, self.opt, self.precision, global_batch, self.device)
            step.dense_only = why
            return step
        if graph == "on" and self.comm.size == 1:
            return WholeStep(self.c, self.comm, self.emb, model, self.params, self.precision.autocast,
                             global_batch, self.device)
        if graph == "on":
            return PaddedStep(self.c, self.comm, self.emb, model, self.params, self.opt, self.precision,
                              global_batch, self.device)
        if graph == "dense":
            return DenseStep(self.emb, model, self.params, self.opt, self.precision, global_batch, self.device)
        return EagerStep(self.emb, model, self.params, self.opt, self.precision, global_batch)

    # ---- one step ------------------------------------------------------------------------
    def progress(self, step: int) -> float:
        """Train step `step` in the module docstring's order; returns its global loss (not finite:
        the step was dropped, nothing changed). Collective."""
        self.step = step
        self.lr.apply(step)
        ctx = StepContext(self.start(step))
        self.model.train()
        counts = self.emb.stats.snapshot() if self.exact is not None else None
        self.strategy.lookup(ctx)
        self.prefetch(step)
        self.strategy.forward(ctx)
        value = self._end(ctx, self.strategy)
        if ctx.again:
            value = self._again(ctx, counts)
        self.finish(ctx.flight)
        return value

    def _again(self, ctx: StepContext, counts: tuple) -> float:
        """Some rank's batch needed more slots than train.unique_capacity: the fixed-shape step
        changed nothing (its updates were masked off on the device, the dense step not taken), and
        every rank trains the step again through the exact-size sparse half (the same batch, the
        same rows: the result is the exact step's). Counted in summary.json (cuda_graph.overflow_steps)."""
        self.again += 1
        self.strategy.discard(ctx)
        self.emb.stats.restore(counts)  # the step's counts are the exact step's
        again = StepContext(ctx.flight)
        self.exact.lookup(again)
        self.exact.forward(again)
        return self._end(again, self.exact)

    def _end(self, ctx: StepContext, strategy: StepStrategy) -> float:
        """The end of every step (the module docstring's 5): returns the global loss."""
        carry = [strategy.carry(ctx, SIGNALS.carry(ctx.loss, self.comm.size))]
        if self.skip:
            value = self._take(self.comm.allreduce(carry.pop(), op="sum", kind="dense"), ctx, strategy)
            if ctx.again:
                return value
            if not math.isfinite(value):
                return self._drop(ctx, value, strategy)
        strategy.backward(ctx)
        if self.precision.scaler is not None:  # fp16: unscaled, and every rank's overflow known
            taken, overflow = self.precision.agree(self.comm, ctx.grads, ctx.flight.ws.grad,
                                                   carry.pop() if carry else None, ctx.step)
            if taken is not None:  # stop mode: the loss came with the overflow flags
                value = taken
                self._check_loss(value, ctx.step)
            if overflow:
                return self._drop(ctx, value, strategy)
        reduced = self._update(ctx, strategy, ctx.grads + carry)
        if carry and strategy.overflows_now:  # the read first: an overflowing step takes no dense step
            value = self._take(reduced[-1], ctx, strategy)
            if ctx.again:
                return value
            self._dense_step(reduced[:len(self.params)])
            self._check_loss(value, ctx.step)
            return value
        self._dense_step(reduced[:len(self.params)])
        if carry:
            value = self._take(reduced[-1], ctx, strategy)
            self._check_loss(value, ctx.step)
        return value

    def _update(self, ctx: StepContext, strategy: StepStrategy, dense: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows' update and the dense allreduce of `dense` (the gradients, then the loss's
        carry in stop mode); returns it reduced. train.pipeline=off, or rows updated already (the
        whole step): one after the other; else the row gradients leave first, the dense allreduce
        behind them, and it travels while the owners update."""
        finish = strategy.update_rows(ctx)
        if finish is not None and self.mode == "off":
            finish()
            finish = None
        if finish is None:
            return self.comm.grouped_allreduce(dense, op="sum", kind="dense")
        pending = self.comm.grouped_allreduce_async(dense, op="sum", kind="dense")
        finish()
        return pending.wait()

    def _dense_step(self, grads: list[torch.Tensor]) -> None:
        """The dense optimizer's step on the reduced gradients: DenseUpdate's (train.cuda_graph
        dense / on: torch.optim's arithmetic from one graph), else torch.optim's own."""
        if self.dense is not None:
            self.dense.step(grads)
            return
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt.step()

    def graph_summary(self) -> Optional[dict[str, Any]]:
        """summary.json's `cuda_graph`: the strategy's, with the dense optimizer's graph."""
        out = self.strategy.summary()
        if out is not None and self.dense is not None:
            out["optimizer"] = self.dense.summary()
        if out is not None and self.exact is not None:
            out["overflow_steps"] = self.again
        return out

    def _take(self, reduced: torch.Tensor, ctx: StepContext, strategy: StepStrategy) -> float:
        """The global loss of a reduced carry, in one read with the stop signals' flag and the
        strategy's values (which it checks)."""
        value, *values = SIGNALS.take_values(reduced, self.comm.size)
        strategy.check(ctx, values)
        return value

    def _drop(self, ctx: StepContext, value: float, strategy: StepStrategy) -> float:
        """Every rank drops the step (a non-finite loss under train.nonfinite=skip, an fp16
        overflow): nothing changed; the step prepared ahead begins its read again."""
        strategy.discard(ctx)
        self.restart_next()  # its cache lookups predate the rollback
        return value

    @staticmethod
    def _check_loss(value: float, step: int) -> None:
        """train.nonfinite=stop: a non-finite global loss stops the run."""
        if not math.isfinite(value):
            raise TrainingError(f"loss is {value} at step {step}; stopping (lower optim.lr? "
                                "train.nonfinite=skip drops such batches)")

    # ---- the steps in flight ---------------------------------------------------------------
    def batch(self, step: int) -> tuple[Any, Any]:
        """(this rank's batch on the device, the GlobalStep or None) of `step`. Both copies are
        asynchronous (pinned host memory, trainer/base/core/device.py); with train.pipeline the next step's
        batch is made during this step, so its copy overlaps this step's work."""
        batch, info = self.feed.step(step) if self.feed is not None else (self.data.train_batch(step), None)
        if info is not None and info.hot_slots is not None:
            info = replace(info, hot_slots=to_device(info.hot_slots, self.device))
        return batch.to(self.device), info

    def start(self, step: int) -> InFlightStep:
        """Step `step`, to be trained now: the one prepared during the step before, else a new
        one with its batch (HybridEmbedding.lookup makes its plan and requests). Collective."""
        ahead, self.next = self.next, None
        if ahead is not None and ahead.step != step:  # the caller skipped a step: its read goes
            self.emb.cancel(ahead)
            ahead = None
        flight = ahead if ahead is not None else InFlightStep(step, *self.batch(step))  # its lookup prepares it
        self._calls_at_start = self._alltoall_calls()
        self.current = flight
        return flight

    def finish(self, flight: InFlightStep) -> None:
        """The step trained (or discarded) in full: count its alltoalls."""
        made = self._alltoall_calls() - self._calls_at_start + flight.alltoalls_ahead
        if self.next is not None:  # the next step's, made during this one: counted there
            made -= self.next.alltoalls_ahead
        self.alltoalls["hot" if flight.info.hot else "cold"] += made
        self.current = None

    def prefetch(self, step: int) -> None:
        """During step `step`, after its lookup: build step+1's batch and plan and send its id
        requests now, so they travel while this step computes (the requests depend on no update:
        exact); with ids, the owners also send the rows of step+1 that this step does not update
        (exact too); with rows, they answer all of step+1's reads now (within the pull bound). A
        bad batch (a data error, out-of-range ids) stops the run here, after this step's lookup
        and before any of its updates. (Made at the start of the step instead, the batch measured
        6% slower on localhost.) Collective."""
        if not (self.overlaps and step + 1 < self.c.train.steps):
            return
        calls = self._alltoall_calls()
        batch, info = self.batch(step + 1)
        self.next = self._prepare(InFlightStep(step + 1, batch, info))
        if self.settled:  # the rows this step leaves alone travel during its compute
            self.emb.serve_settled(self.next, self.current)
        elif self.mode == "rows" and not self._flush_after(step):
            # the owners answer step+1's reads now, before this step's updates (one step staler,
            # within the pull bound counting this in-flight step), so the version replies and
            # rows travel during forward and backward
            self.emb.serve(self.next)
        self.next.alltoalls_ahead = self._alltoall_calls() - calls

    def restart_next(self) -> None:
        """The current step was dropped (_drop): the step prepared ahead looked the cache up before
        the rollback, so its read begins again. Collective."""
        ahead = self.next
        if ahead is not None and self.plans:  # without a plan ahead it looked nothing up
            self.emb.cancel(ahead)
            self.next = self._prepare(InFlightStep(ahead.step, ahead.batch, ahead.info))
            self.next.alltoalls_ahead = ahead.alltoalls_ahead

    def _prepare(self, flight: InFlightStep) -> InFlightStep:
        return self.emb.prepare(flight) if self.plans else flight

    def drop_prepared(self) -> None:
        """The step prepared ahead will not run (early stop, failed save): its begun read is waited
        for and dropped. Collective."""
        if self.next is not None:
            self.emb.cancel(self.next)
            self.next = None

    def _flush_after(self, step: int) -> bool:
        """Whether a flush (eval, checkpoint, the end) follows step `step`: train.pipeline=rows
        answers the reads after it, not before."""
        done = step + 1
        return bool(self.saves_after(done) or done == self.c.train.steps
                    or (self.c.train.eval_every and done % self.c.train.eval_every == 0))

    def _alltoall_calls(self) -> int:
        calls = self.comm.counter.calls
        return calls.get("alltoall", 0) + calls.get("alltoall_splits", 0)
