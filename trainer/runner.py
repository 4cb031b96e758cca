"""run(cfg): the training job, identical on every rank, callable from tests and from Hydra.

The loop lives here: one step (lookup, forward, backward, embedding push + owner update, dense
allreduce + step), evaluation, and the checkpoint glue. What a rank holds is assembled by build.py
(dense model + optimizer, the sparse side); what the run reports is report.py.

With a validation split (data.val_fraction > 0) the evaluations every train.eval_every steps (and
after the last step) run on it, feed early stopping (train.early_stop, best.py) and keep the best
model in memory; the final evaluation on the test split runs on the restored best model.
The learning rates follow lr.py's schedule, set before every step.

The local loss is sum(BCE over the local slice) / global batch, so gradients summed over ranks equal
the gradient of the single-process reference's mean loss over the global batch (docs/design.md, section 2).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import kernels

from .best import BestSnapshot, EarlyStopping
from .build import TrainingError, build_dense, build_sparse, device_of, phase, sparse_lr
from .checkpoint import CheckpointError, Checkpointer, rng_state, set_rng_state
from .checkpoint import latest as latest_checkpoint
from .checkpoint import load as load_checkpoint
from .checkpoint import resolve as resolve_checkpoint
from .comm import CollectiveError, Collectives, make_collectives
from .config import Config, auto_threads, local_batch_size, validate_world
from .configure import apply_data_steps, load_config, recipe_of
from .data import make_data
from .lr import LrSchedule
from .metrics import auc_logloss
from .report import Reporter

__all__ = ["RunResult", "Trainer", "TrainingError", "run"]


@dataclass
class RunResult:
    summary: dict[str, Any]
    rank: int
    losses: list[float]  # global mean training loss of every step
    state: dict[str, Any] | None = None  # {"dense": state_dict, "tables": [Tensor [rows_t, d]]}


def run(cfg: Any, out_dir: str | None = None, return_state: bool = False,
        comm: Collectives | None = None) -> RunResult:
    """Train with `cfg` (Hydra DictConfig or Config); write metrics and summary.json to out_dir."""
    config = load_config(cfg)
    own = comm is None
    if comm is None:
        comm = make_collectives(config.comm.backend, config.comm.timeout_s, config.comm.dist_backend)
    trainer = None
    try:
        trainer = Trainer(config, comm, out_dir)
        return trainer.fit(return_state)
    except CollectiveError as exc:  # a peer died or stalled: say where we were and how to go on
        raise CollectiveError(f"{exc}\n{_failure_hint(config, comm, trainer)}") from exc
    finally:
        if own:
            comm.close()


def _failure_hint(c: Config, comm: Collectives, trainer: "Trainer | None") -> str:
    """Where this rank stopped and which checkpoint a relaunch with resume=auto continues from."""
    where = f"at step {trainer.current_step} of {c.train.steps}" if trainer and trainer.current_step \
        is not None else "outside the training loop"
    root = trainer.ckpt_dir if trainer is not None else c.checkpoint.dir
    last = latest_checkpoint(root) if root else None
    resume = (f"continues from the newest complete checkpoint ({last})" if last else
              "finds no complete checkpoint yet and starts over (checkpoint.every=N saves every N steps)")
    return (f"rank {comm.rank}/{comm.size} stopped {where}: a worker died or stalled (comm.timeout_s="
            f"{c.comm.timeout_s:g}). Relaunch the same command with checkpoint.resume=auto: it {resume}.")


class Trainer:
    """One rank's training loop over the parts build.py assembles."""

    def __init__(self, c: Config, comm: Collectives, out_dir: str | None) -> None:
        validate_world(c, comm.size)
        self.c, self.comm = c, comm
        self.rank, self.world = comm.rank, comm.size
        torch.set_num_threads(auto_threads(c))
        self.device = device_of(c)
        kernels.configure(c.kernels.backend, self.device)
        self.out_dir = self._agree_out_dir(out_dir)
        self.data = make_data(c, self.rank, self.world)
        apply_data_steps(c, self.world)  # data.epochs -> train.steps, now that W is known
        self.global_batch = local_batch_size(c, self.world) * self.world
        self.sparse = build_sparse(c, comm, self.data, self.global_batch, self.device)
        self.emb, self.feed = self.sparse.emb, self.sparse.feed
        self.model, self.params, self.opt = build_dense(c, comm, self.sparse.sharding.num_tables, self.device)
        self.report = Reporter(c, comm, self.sparse, self.data, self.global_batch, self.out_dir)
        self.losses: list[float] = []
        self.alltoalls = {"hot": 0, "cold": 0}  # alltoall calls of this rank in hot / other steps
        self.evals: list[dict[str, Any]] = []
        self.ckpt_dir = c.checkpoint.dir or (os.path.join(self.out_dir, "checkpoints")
                                             if self.out_dir else None)  # None: no checkpoints
        self.checkpointer = (Checkpointer(comm, self.ckpt_dir, c.checkpoint.keep_last)
                             if self.ckpt_dir and c.checkpoint.enabled else None)
        self.last_checkpoint: str | None = None
        self.current_step: int | None = None  # the step in progress (failure reports)
        self.resumed_from: str | None = None
        self.lr = LrSchedule(c.optim, c.train.steps, self.opt, self.emb, sparse_lr(c))
        self.val_rows = int(getattr(self.data, "val_rows", 0))  # validation split (0: none)
        self.early = EarlyStopping(c.train.early_stop.patience, c.train.early_stop.min_delta)
        self.start_step = self._resume()
        self.best = (BestSnapshot(self.model, self.emb, fresh=self.resumed_from is None)
                     if self.val_rows and c.train.early_stop.restore_best else None)
        self.recipe = recipe_of(c)
        if self.rank == 0 and self.recipe.name != "none":
            print(self.recipe.line(c), file=sys.stderr)

    def _agree_out_dir(self, out_dir: str | None) -> str | None:
        """Every rank writes into rank 0's output directory (Hydra dirs may differ by a second)."""
        with phase(self.comm, "other"):
            agreed = self.comm.broadcast_object(out_dir)
        if agreed is not None and self.rank == 0:
            os.makedirs(agreed, exist_ok=True)
        return agreed

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Forward, backward, embedding push + owner update, dense allreduce + step. Collective."""
        batch, info = self.feed.step(step) if self.feed is not None else (self.data.train_batch(step), None)
        calls = self._alltoall_calls()
        value = self._step(batch.to(self.device), info, step)
        self.alltoalls["hot" if info is not None and info.hot else "cold"] += self._alltoall_calls() - calls
        return value

    def _alltoall_calls(self) -> int:
        calls = self.comm.counter.calls
        return calls.get("alltoall", 0) + calls.get("alltoall_splits", 0)

    def _step(self, batch: Any, info: Any, step: int) -> float:
        """One step; returns the global loss. train.nonfinite=stop: the loss travels with the dense
        gradients and a non-finite one raises (the run stops, no checkpoint is written after it).
        skip: the global loss is reduced first (one extra 4-byte allreduce) and, when it is not
        finite, every rank drops the step before anything changed (embedding.discard)."""
        self.model.train()
        pooled = self.emb.lookup(batch, train=True, info=info)
        logits = self.model(batch.dense, pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / self.global_batch
        extra = [loss.detach().reshape(1)]
        if self.c.train.nonfinite == "skip":
            value = float(self.comm.allreduce(extra.pop(), op="sum", kind="dense").item())
            if not math.isfinite(value):
                self.emb.discard()
                return value
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.emb.apply_gradients()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        reduced = self.comm.grouped_allreduce(grads + extra, op="sum", kind="dense")
        for p, g in zip(self.params, reduced):
            p.grad = g
        self.opt.step()
        if extra:
            value = float(reduced[-1].item())
            if not math.isfinite(value):
                raise TrainingError(f"loss is {value} at step {step}; stopping (lower optim.lr? "
                                    "train.nonfinite=skip drops such batches)")
        return value

    def _after_skip(self, step: int) -> None:
        """Step `step` was skipped (non-finite loss): warn; stop after train.max_skips in a row."""
        run = next((i for i, v in enumerate(reversed(self.losses)) if math.isfinite(v)), len(self.losses))
        if self.rank == 0:
            print(f"[trainer] step {step}: loss is {self.losses[-1]}; batch skipped, no update "
                  f"({run} in a row)", file=sys.stderr)
        if run >= self.c.train.max_skips:
            raise TrainingError(f"loss is {self.losses[-1]} at step {step}: {run} consecutive steps "
                                f"had a non-finite loss (train.max_skips={self.c.train.max_skips}); stopping")

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """Exact AUC / logloss over the whole eval split ("test"; "val": the validation split),
        gathered from every rank. Collective. Cached updates are flushed first, so eval reads
        exactly what the owners hold."""
        self.emb.flush()
        self.model.eval()
        logits, labels = [], []
        with phase(self.comm, "eval"):
            for batch in self.data.eval_batches(split):
                batch = batch.to(self.device)
                pooled = self.emb.lookup(batch, train=False)
                logits.append(self.model(batch.dense, pooled).float().cpu())
                labels.append(batch.labels.cpu())
            local = torch.stack([torch.cat(logits), torch.cat(labels)], dim=1) if logits \
                else torch.zeros(0, 2)
            both = self.comm.allgather(local, kind="meta").numpy()
        auc, ll = auc_logloss(both[:, 0], both[:, 1])
        return {"eval_auc": auc, "eval_logloss": ll, "eval_samples": int(both.shape[0])}

    def _eval_now(self, step: int, split: str = "test") -> dict[str, Any]:
        ev = self.evaluate(split)
        rec = {"step": step, **ev} if split == "test" else {"step": step, "split": split, **ev}
        self.evals.append(rec)
        self.report.eval(rec)
        return ev

    def _validate(self, step: int) -> None:
        """A validation evaluation after `step` steps: early stopping's bookkeeping, and a snapshot
        of the model when it is a new best. Collective (every rank takes the same decision)."""
        ev = self._eval_now(step, "val")
        if self.early.update(step, ev) and self.best is not None:
            self.best.take(step)
        if self.early.stop and self.rank == 0:
            print(f"[trainer] early stop after step {step}: validation AUC has not improved on "
                  f"{self.early.best_auc:.4f} (step {self.early.best_step}) for {self.early.since} "
                  f"evaluations (train.early_stop.patience={self.early.patience})", file=sys.stderr)

    def _restore_best(self, end: int) -> dict[str, Any]:
        """Put the best validation model back for the final test evaluation (if another model
        was trained after it); returns summary.json's early-stopping fields."""
        e = self.early
        restored = False
        if self.best is not None and self.best.step is not None and self.best.step != end:
            with phase(self.comm, "other"):
                self.best.restore(self.comm)
            restored = True
        elif self.best is not None and self.best.step is None and e.best_step is not None and e.best_step != end \
                and self.rank == 0:
            print(f"[trainer] warning: the best validation model (step {e.best_step}) was trained before "
                  "the resume and is not in memory: the test evaluation uses the last model", file=sys.stderr)
        best = e.best or {}
        return {"best_step": e.best_step, "val_auc": best.get("eval_auc"), "val_logloss": best.get("eval_logloss"),
                "val_samples": best.get("eval_samples", 0),
                "early_stop": {"patience": e.patience, "min_delta": e.min_delta, "stopped_early": e.stop,
                               "stopped_at": e.stopped_at, "evaluated_model_step": e.best_step if restored or (
                                   e.best_step == end) else end, "restored": restored,
                               "snapshot_rows": self.best.held_rows if self.best is not None else 0}}

    # ---- the loop --------------------------------------------------------------------------
    def fit(self, return_state: bool = False) -> RunResult:
        c, report = self.c, self.report
        report.start(self.start_step)
        train_time, window_t, window_start = 0.0, time.perf_counter(), self.start_step
        end = self.early.stopped_at if self.early.stop else c.train.steps  # the step training stops at
        try:
            for step in range(self.start_step, end):
                self.current_step = step
                self.lr.apply(step)
                t0 = time.perf_counter()
                self.losses.append(self.train_step(step))
                train_time += time.perf_counter() - t0
                if not math.isfinite(self.losses[-1]):
                    self._after_skip(step)
                report.progress(self.losses[-1])
                done = step + 1
                if done % c.train.log_every == 0 or done == c.train.steps:
                    now = time.perf_counter()
                    report.step(step, self.losses[-1],
                                (done - window_start) * self.global_batch / max(now - window_t, 1e-9))
                    window_t, window_start = now, done
                if self.val_rows and ((c.train.eval_every and done % c.train.eval_every == 0)
                                      or done == c.train.steps):
                    self._validate(done)  # the last step's model is a candidate too
                    if self.early.stop:
                        end = done
                elif c.train.eval_every and done % c.train.eval_every == 0 and done < c.train.steps:
                    self._eval_now(done)
                if self._save_due(done) and done < end:
                    self.save_checkpoint(done)
                if done == end:
                    break
            if self.checkpointer is not None and self.start_step < end:
                self.save_checkpoint(end)
            extra = self._restore_best(end) if self.val_rows else {}
            final_eval = self._eval_now(end)
            summary = report.summary(train_time, final_eval, self.losses, self.evals, self.start_step,
                                     self.resumed_from, self.last_checkpoint, self.alltoalls,
                                     steps=end, extra={**extra, "recipe": self.recipe.describe(c)})
            state = self._gather_state() if return_state else None
        finally:
            report.close()
        return RunResult(summary, self.rank, list(self.losses), state)

    def _gather_state(self) -> dict[str, Any]:
        with phase(self.comm, "other"):
            tables = self.emb.full_tables()
        dense = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        audit = self.emb.audit.result() if self.emb.audit is not None else None
        return {"dense": dense, "tables": tables, "audit": audit}

    # ---- checkpoints -----------------------------------------------------------------------
    def _schema(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be loaded into this run (checkpoint.SCHEMA_KEYS)."""
        c = self.c
        return {"table_rows": list(self.sparse.sharding.table_rows), "dim": c.model.embedding_dim,
                "model": c.model.name, "optim_sparse": c.optim.sparse, "optim_dense": c.optim.dense}

    def save_checkpoint(self, step: int) -> str:
        """Flush the caches, then write checkpoint `step` (after `step` steps). Collective.
        Rank 0 adds the dense model + optimizer, the step (= data position: batches are a function
        of the step), RNG states, the loss history and evals so far."""
        with phase(self.comm, "train"):  # the flush's pushes are training traffic, saved or not
            self.emb.flush()
        with phase(self.comm, "other"):
            state = None
            if self.rank == 0:
                state = {"step": step, "data_position": step,
                         "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                         "optimizer": self.opt.state_dict(), "rng": rng_state(self.device),
                         "losses": list(self.losses), "evals": list(self.evals),
                         "early_stop": self.early.state()}
            self.last_checkpoint = self.checkpointer.save(
                step, self.emb.store, state, {**self._schema(), "config": asdict(self.c)})
        return self.last_checkpoint

    def _resume(self) -> int:
        """Load checkpoint.resume (if any) into this rank; returns the step to continue from."""
        with phase(self.comm, "other"):
            path = resolve_checkpoint(self.comm, self.c.checkpoint.resume, self.ckpt_dir)
            if path is None:
                return 0
            state = load_checkpoint(self.comm, path, self.emb.store, self._schema())
            if self.emb.replica is not None:
                self.emb.replica.load_from_owners(self.comm, self.emb.store)
        step = int(state["step"])
        if step > self.c.train.steps:
            raise CheckpointError(f"checkpoint {path} is at step {step}, "
                                  f"beyond train.steps={self.c.train.steps}")
        try:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: dense state does not fit this model: {exc}") from exc
        set_rng_state(state["rng"], self.device)
        self.losses, self.evals = list(state["losses"]), list(state["evals"])
        self.early.load(state.get("early_stop"))  # a stopped run stays stopped; patience goes on
        self.emb.step = step - 1  # the cache's clock (LRU ages, audit) continues too
        self.resumed_from = path
        return step

    def _save_due(self, done: int) -> bool:
        every = self.c.checkpoint.every
        return (self.checkpointer is not None and every > 0 and done % every == 0
                and done < self.c.train.steps)
