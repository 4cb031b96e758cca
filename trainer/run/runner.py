"""run(cfg): the training job, identical on every rank, callable from tests and from Hydra.

The Trainer drives the loop: it asks for one step at a time and decides when to evaluate, stop
early and save. Everything else is an object it asks: what a rank holds is assembled by build.py
(dense model + optimizer, the sparse side); a step (its order, its state, the steps in flight and
the next step's input side, the eager or graph strategy) is trainer/step/pipeline.py's
(TrainPipeline.progress); evaluations by evaluation/evaluator.py (Evaluator); saves, resume and
the rescue of a failed save by checkpoint/ (CheckpointManager); what the run reports by report/;
the advice after a lost worker by run/relaunch.py. A Trainer is a context manager: leaving its
`with` block releases the checkpoint directory.

With a validation split (data.val_fraction > 0) the evaluations every train.eval_every steps (and
after the last step) run on it, feed early stopping (train.early_stop, best.py) and keep the best
model in memory; the final evaluation on the test split runs on the restored best model.
The learning rates follow train/lr.py's schedule, set by the pipeline before every step.

The local loss is sum(BCE over the local slice) / global batch, so gradients summed over ranks equal
the gradient of the single-process reference's mean loss over the global batch (docs/design.md, section 2).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import kernels

from .evaluation.best import BestSnapshot, EarlyStopping, restore_best
from .build import build_dense, build_sparse, device_of, sparse_lr
from ..base.core.errors import ResumeAdvised, TrainingError, phase
from ..base.core.stop import StopRequested
from .checkpoint import CheckpointError, CheckpointManager
from ..base.comm import CollectiveError, Collectives, make_collectives
from ..base.config import Config, auto_threads, local_batch_size, validate_world
from .resolve.configure import load_config
from ..workload.data import make_data
from .evaluation.evaluator import EvalInterrupted, Evaluator
from ..step.lr import LrSchedule
from .resolve.memplan import check_memory
from .outdir import HeldDir, claim_out_dir, probe_dir
from ..step.pipeline import TrainPipeline
from ..step.precision import DensePrecision
from .resolve.recipes import announce_recipe, apply_data_steps, recipe_of
from .relaunch import Position, continue_hint, failure_hint
from .report import Reporter, dynamic_summary
from .signals import NOT_EVALUATED, SIGNALS, Stop, agree, announce, stopped_at_start, why_not_saved

__all__ = ["RunResult", "Trainer", "TrainingError", "run"]


@dataclass
class RunResult:
    summary: dict[str, Any]
    rank: int
    losses: list[float]  # global mean training loss of every step
    # return_state: {"dense": state_dict, "tables": [Tensor [rows_t, d]], "table_ids", "audit",
    # "eval_rows": the last test evaluation's [n, 2] (logit, label) rows, in the ranks' gathered order}
    state: dict[str, Any] | None = None


def run(cfg: Any, out_dir: str | None = None, return_state: bool = False,
        comm: Collectives | None = None, record: dict[str, str] | None = None) -> RunResult:
    """Train with `cfg` (Hydra DictConfig or Config); write metrics and summary.json to out_dir.
    The run holds out_dir from start to end (outdir.claim_out_dir: another run there is refused
    before anything is written or built) and first writes `record` there (path -> text: Hydra's
    .hydra files, outdir.hydra_record)."""
    with SIGNALS.watching():  # SIGTERM / SIGINT / SIGUSR1: every rank stops at the next step boundary
        return _run(cfg, out_dir, return_state, comm, record)


def _run(cfg: Any, out_dir: str | None, return_state: bool, comm: Collectives | None,
         record: dict[str, str] | None) -> RunResult:
    config = load_config(cfg)
    own = comm is None
    if comm is None:
        comm = make_collectives(config.comm.backend, config.comm.timeout_s, config.comm.dist_backend,
                                config.train.device)
    trainer, held = None, HeldDir(None)
    try:
        held = claim_out_dir(comm, out_dir, record, config.checkpoint.lock_lease_s)
        out_dir = held.path  # rank 0's, on every rank
        recipe = announce_recipe(config, comm)  # once, for one model or an ensemble
        if config.train.ensemble > 1:  # K members, each a Trainer (ensemble.py does not import this module)
            from .evaluation.ensemble import run_ensemble
            summary, losses, state = run_ensemble(config, comm, out_dir, Trainer, recipe, return_state)
            if summary.get("stopped"):  # a member stopped on a signal: resume=auto continues the ensemble
                announce(summary, comm, "auto", config.checkpoint.dir, out_dir,
                         f" (ensemble member {summary['stopped']['member']})")
            return RunResult(summary, comm.rank, losses, state)
        with Trainer(config, comm, out_dir) as trainer:
            result = trainer.fit(return_state)
        if result.summary.get("stopped"):  # a stop signal: rank 0 says where and how to go on
            at = trainer.position()
            announce(result.summary, comm, at.last, at.ckpt_dir, at.out_dir)
        return result
    except StopRequested as exc:  # a stop signal ended a long start-up phase: nothing trained
        return RunResult(stopped_at_start(comm, SIGNALS, str(exc), out_dir), comm.rank, [], None)
    except CollectiveError as exc:  # a peer died or stalled: say where we were and how to go on
        at = trainer.position() if trainer is not None else None
        raise CollectiveError(f"{exc}\n{failure_hint(config, comm, at, out_dir)}") from exc
    except ResumeAdvised as exc:  # the store's disk full or damaged: which checkpoint continues the run
        at = trainer.position() if trainer is not None else None
        raise TrainingError(f"{exc}. {continue_hint(config, comm, at, out_dir)}") from exc
    finally:
        held.release()
        if own:
            comm.close()


def agree_out_dir(comm: Collectives, out_dir: str | None) -> str | None:
    """Every rank writes into rank 0's output directory (Hydra dirs may differ by a second). Rank 0
    creates it and writes a probe file there first; every rank gets the verdict with the directory,
    so an unwritable one stops every rank now, not at the first metrics line or at summary.json
    after the whole training. Collective."""
    with phase(comm, "other"):
        return comm.root_decides(lambda: probe_dir(out_dir), TrainingError)


class Trainer:
    """One rank's training loop over the parts build.py assembles. `with Trainer(...) as t:
    t.fit()` releases the checkpoint directory at the end (close())."""

    def __init__(self, c: Config, comm: Collectives, out_dir: str | None) -> None:
        validate_world(c, comm.size)
        self.c, self.comm = c, comm
        self.rank, self.world = comm.rank, comm.size
        torch.set_num_threads(auto_threads(c))
        self.device = device_of(c)
        kernels.configure(c.kernels.backend, self.device)
        # the directories first (rank 0 checks, every rank learns the outcome), so an unwritable
        # output dir or a checkpoint.dir in use stops the run before the data and the sparse side
        # (placement planning) are built
        self.out_dir = agree_out_dir(comm, out_dir)
        self.checkpoints = CheckpointManager(c, comm, self.out_dir)
        try:
            self._build(c, comm)
        except BaseException:
            self.close()  # no `with` block holds this Trainer yet
            raise

    def _build(self, c: Config, comm: Collectives) -> None:
        self.data = make_data(c, self.rank, self.world)
        apply_data_steps(c, self.world)  # data.epochs -> train.steps, now that W is known
        self.global_batch = local_batch_size(c, self.world) * self.world
        self.memory = check_memory(c, comm, self.device)  # before the sparse side allocates
        resuming = self.checkpoints.resume_path() is not None  # collective: rank 0 decides
        self.sparse = build_sparse(c, comm, self.data, self.global_batch, self.device, resuming,
                                   interrupt=SIGNALS.requested)
        self.emb, self.feed = self.sparse.emb, self.sparse.feed
        self.model, self.params, self.opt = build_dense(c, comm, self.sparse.sharding.num_tables, self.device)
        self.checkpoints.check_space(self.emb, self.params)  # before hours of training, not at the first save
        self.precision = DensePrecision(c, self.device)  # train.precision: autocast, fp16's loss scaler
        self.lr = LrSchedule(c.optim, c.train.steps, self.opt, self.emb, sparse_lr(c))
        self.report = Reporter(c, comm, self.sparse, self.data, self.global_batch, self.out_dir)
        self.pipeline = TrainPipeline(c, comm, self.sparse, self.data, self.device, self.checkpoints.due,
                                      model=self.model, params=self.params, opt=self.opt, precision=self.precision,
                                      lr=self.lr, global_batch=self.global_batch)
        self.losses: list[float] = []
        self.evals: list[dict[str, Any]] = []
        self.val_rows = int(self.data.val_rows)  # validation split (0: none)
        self.evaluator = Evaluator(comm, self.model, self.emb, self.data, self.device, self.precision.autocast)
        self.evaluator.interrupt = SIGNALS.requested  # a stop request ends an evaluation
        self.early = EarlyStopping(c.train.early_stop.patience, c.train.early_stop.min_delta,
                                   c.train.early_stop.min_evals)
        self.start_step = self.checkpoints.resume(self, interrupt=SIGNALS.requested)
        self.emb.store.release()
        self.best = (BestSnapshot(self.model, self.emb, fresh=self.checkpoints.resumed_from is None,
                                  mode=c.train.early_stop.snapshot, directory=self.out_dir)
                     if self.val_rows and c.train.early_stop.restore_best else None)
        self.recipe = recipe_of(c)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release checkpoint.dir (its lock) and the best snapshot's rows; idempotent."""
        self.checkpoints.close()
        if getattr(self, "best", None) is not None:
            self.best.close()
        sparse = getattr(self, "sparse", None)
        if sparse is not None and sparse.emb.store.tier is not None:  # embedding.store=disk: the run's files
            sparse.emb.store.tier.close()

    def position(self) -> Position:
        """Where this run stands (the advice after a lost worker, relaunch.failure_hint)."""
        k = self.checkpoints
        return Position(self.pipeline.step, self.out_dir, k.root, k.last or k.resumed_from)

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Step `step` (TrainPipeline.progress: lookup, forward, backward, embedding push + owner
        update, dense allreduce + step); returns its global loss. Collective."""
        return self.pipeline.progress(step)

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
    def _eval_now(self, step: int, split: str = "test") -> dict[str, Any]:
        """An evaluation after `step` steps, recorded (summary, metrics.jsonl). Collective."""
        ev = self.evaluator.evaluate(split)
        self.emb.store.release()
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
            self.emb.store.release()
        if self.early.stop and self.rank == 0:
            print(f"[trainer] early stop after step {step}: validation AUC has not improved on "
                  f"{self.early.best_auc:.4f} (step {self.early.best_step}) for {self.early.since} "
                  f"evaluations (train.early_stop.patience={self.early.patience})", file=sys.stderr)

    # ---- the loop --------------------------------------------------------------------------
    def fit(self, return_state: bool = False) -> RunResult:
        c, report, k = self.c, self.report, self.checkpoints
        report.start(self.start_step, k.resumed_from, k.resumed_world)
        train_time, window_t, window_start = 0.0, time.perf_counter(), self.start_step
        end = self.early.stopped_at if self.early.stop else c.train.steps  # the step training stops at
        try:
            for step in range(self.start_step, end):
                t0 = time.perf_counter()
                self.losses.append(self.train_step(step))
                train_time += time.perf_counter() - t0
                if not math.isfinite(self.losses[-1]):
                    self._after_skip(step)
                report.progress(self.losses[-1])
                done = step + 1
                if done % c.train.log_every == 0 or done == c.train.steps or SIGNALS.agreed:
                    now = time.perf_counter()
                    report.step(step, self.losses[-1],
                                (done - window_start) * self.global_batch / max(now - window_t, 1e-9))
                    window_t, window_start = now, done
                if SIGNALS.agreed:  # a rank received SIGTERM / SIGINT / SIGUSR1: every rank stops here
                    return self._stop(done, train_time, return_state)
                try:
                    if self.val_rows and ((c.train.eval_every and done % c.train.eval_every == 0)
                                          or done == c.train.steps):
                        self._validate(done)  # the last step's model is a candidate too
                        if self.early.stop:
                            end = done
                    elif c.train.eval_every and done % c.train.eval_every == 0 and done < c.train.steps:
                        self._eval_now(done)
                except EvalInterrupted:  # a stop request during the evaluation: dropped, the step saved
                    return self._stop(done, train_time, return_state)
                if k.due(done) and done < end:
                    self._save(done, train_time)
                if done == end:
                    break
            self.pipeline.drop_prepared()  # an early stop leaves the step prepared ahead unrun
            if k.enabled and self.start_step < end:
                self._save(end, train_time)
            # dynamic tables: summary.json's `dynamic` block is the pool as trained, not as restored
            trained = dynamic_summary(self.comm, self.emb.store) if self.val_rows and self.emb.store.dynamic else None
            extra = restore_best(self.best, self.early, self.comm, end) if self.val_rows else {}
            if trained is not None:
                extra["dynamic"] = trained
            try:
                extra["calibration"] = self.evaluator.calibrate() if c.train.calibrate and self.val_rows else None
                final_eval = self._eval_now(end)
            except EvalInterrupted:  # the run is trained and saved: it stops unevaluated (resume evaluates it)
                return self._stop(end, train_time, return_state)
            summary = report.summary(train_time, final_eval, self.losses, self.evals, self.start_step,
                                     k.resumed_from, k.last, self.pipeline.alltoalls, end_step=end,
                                     extra={**extra, **self._described()})
            state = self._gather_state() if return_state else None
        finally:
            report.close()
        return RunResult(summary, self.rank, list(self.losses), state)

    def _described(self) -> dict[str, Any]:
        return {"device": self.device.type, "transport": self.comm.transport,
                "recipe": self.recipe.describe(self.c, self.world), "settled_rows": self.pipeline.settled,
                "precision": self.precision.summary(),
                "cuda_graph": self.pipeline.graph_summary(),
                "store": self.emb.store.store_record(),
                "memory_plan": self.memory.record()}

    def _stop(self, done: int, train_time: float, return_state: bool) -> RunResult:
        """A rank received a stop signal and every rank learnt it in step `done` (trainer/run/signals.py):
        the step prepared ahead is dropped, `done` saved (train.on_signal=save; a failed save ends
        as in _save), summary.json written with `stopped` and without an evaluation (a huge model's
        can outlast a scheduler's grace time), checkpoint.dir released; run() then says so. Collective."""
        k, stop = self.checkpoints, agree(self.comm, SIGNALS, done)
        self.pipeline.drop_prepared()
        stop.continue_from, stop.why_none = k.last or k.resumed_from, why_not_saved(self.c, k.enabled)
        if stop.why_none is None and k.last is not None and k.last_step == done:
            stop.saved(k.last)  # saved already (a stop during the evaluation after that save)
        elif stop.why_none is None:
            self._save(done, train_time, stop)
            stop.saved(k.last)
        summary = self.report.summary(train_time, NOT_EVALUATED, self.losses, self.evals, self.start_step,
                                      k.resumed_from, k.last, self.pipeline.alltoalls, end_step=done,
                                      extra={"stopped": stop.record(), **self._described()})
        state = self._gather_state() if return_state else None
        self.report.close()
        self.close()
        return RunResult(summary, self.rank, list(self.losses), state)

    def _gather_state(self) -> dict[str, Any]:
        ids = None
        with phase(self.comm, "other"):
            if self.emb.store.dynamic:  # per table: the admitted ids (sorted) and their rows
                ids, tables = self.emb.dynamic_tables()
            else:
                tables = self.emb.full_tables()
        dense = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        audit = self.emb.audit.result() if self.emb.audit is not None else None
        return {"dense": dense, "tables": tables, "table_ids": ids, "audit": audit,
                "eval_rows": self.evaluator.test_rows}

    def _save(self, step: int, train_time: float, stop: Stop | None = None) -> None:
        """Checkpoint `step` (CheckpointManager.save). When the save fails (on any rank: every
        rank gets the CheckpointError), the model trained so far is still in memory and is not
        thrown away: the manager saves it elsewhere if it can (rescue), then it is evaluated at
        `step` (not after a stop signal: `stop`) and summary.json written with `checkpoint_error`;
        the run ends with the rescue's CheckpointError (exit 2), which carries the summary. Collective."""
        try:
            with SIGNALS.saving():
                self.checkpoints.save(step, self)
            self.emb.store.release()
            return
        except CheckpointError as exc:
            self.pipeline.drop_prepared()
            with SIGNALS.saving():
                rescue = self.checkpoints.rescue(step, exc, self)
            if stop is not None:
                stop.saved(rescue.fallback)
        done = [e for e in self.evals[-1:] if e["step"] == step and "split" not in e]  # tested at this step already
        final_eval = NOT_EVALUATED if stop is not None else done[0] if done else self._eval_now(step)
        summary, written = None, os.path.join(self.out_dir, "summary.json") if self.out_dir else None
        try:
            summary = self.report.summary(train_time, final_eval, self.losses, self.evals, self.start_step,
                                          self.checkpoints.resumed_from, self.checkpoints.last,
                                          self.pipeline.alltoalls, end_step=step, checkpoint_error=rescue.record(),
                                          extra={"stopped": stop.record()} if stop is not None else None)
        except OSError as write_error:  # rank 0: summary.json too (it went to stdout)
            written = f"stdout (summary.json cannot be written: {write_error})"
        how = "evaluated" if stop is None else f"stopped on {stop.signal}, not evaluated"
        note = f"; {how}, summary: {written} (checkpoint_error)" if written else f"; {how}"
        raise rescue.error(note, summary) from rescue.cause
