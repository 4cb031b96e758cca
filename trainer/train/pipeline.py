"""StepPipeline: the training steps in flight, and the next step's input side made ahead.

Why an object of its own (like TorchRec's TrainPipelineSparseDist, which owns the next batch's
input distribution): with train.pipeline (default `ids`) two steps are in flight at once. During
step i's forward and backward, step i+1's batch is made and copied to the device, its lookup plan
made and its id requests sent; with `ids` and the ranks on several hosts the owners also send the
rows of step i+1 that step i's update leaves unchanged (comm.settled_rows), with `rows` all of
them (one step staler, within the pull bound). Only work that depends on no update of step i moves
into step i, so the run stays exact (docs/design.md, section 4).

This object holds both steps as InFlightStep objects (trainer/embedding/types.py): `current`, the
step being trained, and `next`, the step prepared ahead. They carry everything a step holds between
calls (batch, plan, the remote protocol's begun read and read, the workspace); HybridEmbedding and
the remote-row protocols take them as arguments and keep no step of their own. The Trainer asks
for a step (start), trains it (HybridEmbedding.lookup, prefetch, apply_gradients or discard) and
hands it back (finish).

It also keeps the alltoall count per step (summary.json's alltoall calls per hot / cold step): a
step's calls are the collectives counter's difference over the step, minus those made for the
next step during it, plus those made for it during the step before.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..comm import Collectives
from ..config import Config
from ..core.device import to_device
from ..core.errors import TrainingError
from ..embedding import InFlightStep
from ..run.signals import SIGNALS
from .step import dense_loss

if TYPE_CHECKING:  # the sparse side, as build.py assembles it (a type only: build is above this layer)
    from ..build import Sparse

__all__ = ["StepOrder", "StepPipeline"]


class StepPipeline:
    """This rank's steps in flight (see the module docstring). `saves_after(done)`: whether a
    checkpoint follows `done` steps (a flush: train.pipeline=rows answers no read across it)."""

    def __init__(self, c: Config, comm: Collectives, sparse: Sparse, data: Any, device: torch.device,
                 saves_after: Callable[[int], bool], plans: bool = True) -> None:
        """plans=False: the step prepared ahead is its batch only (a step that makes its own
        fixed-size plan, trainer/train/whole_step.py)."""
        self.c, self.comm, self.data, self.device = c, comm, data, device
        self.plans = plans
        self.emb, self.feed = sparse.emb, sparse.feed
        self.saves_after = saves_after
        self.mode = c.train.pipeline  # off | ids | rows
        # Herald plans its sync step by step against its flushes: nothing is planned early
        self.overlaps = self.mode != "off" and sparse.herald is None
        # train.pipeline=ids: the settled rows travel early where bytes cost time, between hosts
        # (on one host the extra round trip measured more than the rows it moves ahead)
        # (not with dynamic tables: step i+1's admissions must not run before step i's update)
        self.settled = self.mode == "ids" and not self.emb.store.dynamic and (
            c.comm.settled_rows == "always" or (c.comm.settled_rows == "auto" and comm.spans_hosts))
        self.current: Optional[InFlightStep] = None  # the step being trained
        self.next: Optional[InFlightStep] = None  # the step prepared ahead
        self.alltoalls = {"hot": 0, "cold": 0}  # alltoall calls of this rank in hot / other steps
        self._calls_at_start = 0

    def batch(self, step: int) -> tuple[Any, Any]:
        """(this rank's batch on the device, the GlobalStep or None) of `step`. Both copies are
        asynchronous (pinned host memory, trainer/core/device.py); with train.pipeline the next step's
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
        """The current step was discarded (train.nonfinite=skip): the step prepared ahead looked
        the cache up before the rollback, so its read begins again. Collective."""
        ahead = self.next
        if ahead is not None:
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


class StepOrder:
    """The order of one step (mixed into runner.Trainer)."""

    def _step(self, flight: InFlightStep) -> float:
        """One step; returns the global loss. train.nonfinite=stop: the loss travels with the dense
        gradients and a non-finite one raises (the run stops, no checkpoint is written after it).
        skip: the global loss is reduced first (one extra allreduce of 4 bytes, 8 with W > 1) and,
        when it is not finite, every rank drops the step before anything changed (embedding.discard).
        Either reduction also carries the stop signals' flag (trainer/run/signals.py).
        train.precision: the model's forward under autocast; fp16 scales the loss, and one
        reduction after backward (with the loss in stop mode) tells every rank whether any
        gradient overflowed: then every rank drops the step (trainer/train/precision.py).
        train.pipeline != off: the next step is prepared during this one (StepPipeline.prefetch),
        and the dense allreduce starts behind the embedding gradient push and travels while the
        owners update."""
        if self.whole_step is not None:  # train.cuda_graph=on at W = 1: fixed shapes (trainer/train/whole_step.py)
            return self.whole_step.train(flight, self._check_loss)
        self.model.train()
        batch = flight.batch
        pooled = self.emb.lookup(flight)
        self.steps.prefetch(flight.step)
        split = self.dense_step  # train.cuda_graph=on: the dense half in one piece (trainer/train/dense_step.py)
        if split is not None:
            loss, grads, rows_grad = split.forward_backward(batch.dense, pooled, batch.labels)
        else:
            loss = dense_loss(self.model, self.precision.autocast(), batch.dense, pooled, batch.labels,
                              self.global_batch)
        extra = [SIGNALS.carry(loss, self.world)]  # with a stop signal's flag (trainer/run/signals.py)
        if self.c.train.nonfinite == "skip":
            value = SIGNALS.take(self.comm.allreduce(extra.pop(), op="sum", kind="dense"), self.world)
            if not math.isfinite(value):
                self.emb.discard(flight)
                self.steps.restart_next()  # its cache lookups predate the rollback
                return value
        if split is not None:
            split.rows_backward(pooled, rows_grad)
        else:
            self.opt.zero_grad(set_to_none=False)
            self.precision.backward(loss)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.precision.scaler is not None:  # fp16: unscaled, and every rank's overflow known
            taken, overflow = self.precision.agree(self.comm, grads, flight.ws.grad,
                                                   extra.pop() if extra else None, flight.step)
            if taken is not None:  # stop mode: the loss came with the overflow flags
                value = taken
                self._check_loss(value, flight.step)
            if overflow:
                self.emb.discard(flight)
                self.steps.restart_next()
                return value
        if self.steps.mode == "off":
            self.emb.apply_gradients(flight)
            reduced = self.comm.grouped_allreduce(grads + extra, op="sum", kind="dense")
        else:  # the row gradients leave first, the dense allreduce behind them while owners update
            dense = []
            self.emb.apply_gradients(flight, between=lambda: dense.append(
                self.comm.grouped_allreduce_async(grads + extra, op="sum", kind="dense")))
            reduced = dense[0].wait()
        for p, g in zip(self.params, reduced):
            p.grad = g
        self.opt.step()
        if extra:
            value = SIGNALS.take(reduced[-1], self.world)
            self._check_loss(value, flight.step)
        return value

    @staticmethod
    def _check_loss(value: float, step: int) -> None:
        """train.nonfinite=stop: a non-finite global loss stops the run."""
        if not math.isfinite(value):
            raise TrainingError(f"loss is {value} at step {step}; stopping (lower optim.lr? "
                                "train.nonfinite=skip drops such batches)")
