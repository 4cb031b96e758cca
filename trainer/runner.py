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
import re
import shlex
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import kernels

from .best import BestSnapshot, EarlyStopping
from .build import TrainingError, build_dense, build_sparse, device_of, phase, sparse_lr
from . import procs
from .checkpoint import CheckpointError, Checkpointer, rng_state, set_rng_state
from .checkpoint import latest as latest_checkpoint
from .checkpoint import load as load_checkpoint
from .checkpoint import resolve as resolve_checkpoint
from .checkpoint import step_dir
from .comm import CollectiveError, Collectives, make_collectives
from .config import Config, auto_threads, local_batch_size, validate_world
from .configure import load_config
from .data import make_data
from .device import to_device
from .lr import LrSchedule
from .metrics import auc_logloss, fit_temperature
from .recipes import apply_data_steps, recipe_of
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
        if config.train.bag > 1:  # K members, each a Trainer (bag.py does not import this module)
            from .bag import run_bag
            summary, losses, state = run_bag(config, comm, out_dir, Trainer, return_state)
            return RunResult(summary, comm.rank, losses, state)
        trainer = Trainer(config, comm, out_dir)
        return trainer.fit(return_state)
    except CollectiveError as exc:  # a peer died or stalled: say where we were and how to go on
        raise CollectiveError(f"{exc}\n{_failure_hint(config, comm, trainer, out_dir)}") from exc
    finally:
        if trainer is not None and trainer.checkpointer is not None:
            trainer.checkpointer.close()  # release checkpoint.dir's lock
        if own:
            comm.close()


def _failure_hint(c: Config, comm: Collectives, trainer: "Trainer | None", out_dir: str | None) -> str:
    """Where this rank stopped, the checkpoint to continue from, and the command that does it.

    Not "the same command with resume=auto": with the default output dir that relaunch gets a new
    timestamped dir (and a new checkpoint dir in it) and starts over. The printed command is this
    job's own command line with checkpoint.resume, checkpoint.dir and hydra.run.dir set to the
    absolute places of this run (see relaunch_command)."""
    where = f"at step {trainer.current_step} of {c.train.steps}" if trainer and trainer.current_step \
        is not None else "outside the training loop"
    head = (f"rank {comm.rank}/{comm.size} stopped {where}: a worker died or stalled (comm.timeout_s="
            f"{c.comm.timeout_s:g}).")
    try:
        out = trainer.out_dir if trainer is not None else out_dir  # this rank's, before agreeing
        root = trainer.ckpt_dir if trainer is not None else (c.checkpoint.dir or (
            os.path.join(out, "checkpoints") if out else None))
        # this run's newest save, else the checkpoint it started from; never an older job's save
        # that happens to lie in checkpoint.dir (a fresh run did not ask to continue that one)
        last = (trainer.last_checkpoint or trainer.resumed_from) if trainer is not None else (
            c.checkpoint.resume if c.checkpoint.resume not in (None, "auto") else None)
        if last is None and trainer is None and c.checkpoint.resume == "auto":
            last = latest_checkpoint(root)
        command = relaunch_command(last, root, out, size=comm.size)
    except Exception as exc:  # noqa: BLE001 - the hint must never hide the failure itself
        return f"{head} (no relaunch command: {type(exc).__name__}: {exc})"
    if last is not None:
        what = f"The newest complete checkpoint of this run is {os.path.abspath(last)}; to continue from it, run:"
    else:
        what = ("No checkpoint of this run is complete yet (checkpoint.every=N saves every N steps); "
                "to run it again from the start in the same directories, run:")
    return f"{head} {what}\n    {command}"


RELAUNCH_KEYS = ("checkpoint.resume", "checkpoint.dir", "hydra.run.dir")  # replaced in the command


def relaunch_command(resume: str | None, ckpt_dir: str | None, out_dir: str | None, size: int = 1) -> str:
    """A shell command that continues this job: `cd <launch dir> && <launcher and trainer command>`
    with every checkpoint.resume / checkpoint.dir / hydra.run.dir argument replaced by the absolute
    checkpoint to resume (none: start over), checkpoint dir and output dir of this run.

    The launcher's command line is the nearest ancestor process whose arguments end with this
    process's own (`-m trainer ARGS`): torchrun starts its workers as children, horovodrun through a
    shell. Without one (W = 1, or workers started on another host) it is this process's command.
    A job of a Hydra sweep (-m) is relaunched alone, with its own override values."""
    own = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    args = sys.argv[1:]
    n = len(own) - len(args)
    if own[n:] != args:  # not a command line this function understands: python plus sys.argv
        own, n = [sys.executable] + sys.argv, 1
    entry = own[n - 2:n] if n >= 3 and own[n - 2] == "-m" else own[n - 1:n]
    prefix, cwd = own[:n], os.getcwd()
    if size > 1:
        found = _launcher(entry + args)
        if found is not None:
            cmdline, cwd = found
            prefix = cmdline[:len(cmdline) - len(args)]
    job = _job_args(args)
    job = [a for a in job if _override_key(a) not in RELAUNCH_KEYS]
    if resume is not None:
        job.append(f"checkpoint.resume={_hydra_value(os.path.abspath(resume))}")
    if ckpt_dir is not None:
        job.append(f"checkpoint.dir={_hydra_value(os.path.abspath(ckpt_dir))}")
    if out_dir is not None:
        job.append(f"hydra.run.dir={_hydra_value(os.path.abspath(out_dir))}")
    return f"cd {shlex.quote(cwd)} && {shlex.join(prefix + job)}"


def _override_key(arg: str) -> str | None:
    """The key of a Hydra override argument (`+key=v`, `++key=v`, `~key`), None for a flag."""
    if arg.startswith("-"):
        return None
    body = arg.lstrip("+~")
    key = body.split("=", 1)[0] if "=" in body else (body if arg.startswith("~") else None)
    return key.strip() if key else None


def _job_args(args: list[str]) -> list[str]:
    """This job's trainer arguments; for a job of a Hydra sweep (-m), the sweep's overrides are
    replaced by this job's own values and -m is dropped."""
    if "-m" not in args and "--multirun" not in args:
        return list(args)
    from hydra.core.hydra_config import HydraConfig  # a sweep only exists under Hydra
    if not HydraConfig.initialized():
        return list(args)
    task = list(HydraConfig.get().overrides.task)

    def kept(arg: str) -> bool:  # flags and Hydra's own keys stay; the sweep's go
        key = _override_key(arg)
        return arg not in ("-m", "--multirun") and (
            key is None or key.startswith("hydra") and not key.startswith(("hydra.sweep", "hydra.mode")))

    return [a for a in args if kept(a)] + task


_PLAIN = re.compile(r"^[A-Za-z0-9_\-/.+@%]+$")


def _hydra_value(value: str) -> str:
    """value as a Hydra override value: plain paths as they are, others single-quoted (Hydra's
    rules inside quotes: a quote is escaped, and so is each backslash just before a quote; ${ is
    escaped so that it is not read as an interpolation)."""
    if _PLAIN.match(value):
        return value
    quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    quoted = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted)  # before the closing quote
    quoted = quoted.replace("${", "\\${")  # a literal ${, not an interpolation
    return f"'{quoted}'"


def _launcher(tail: list[str]) -> tuple[list[str], str] | None:
    """(command line, working dir) of the nearest ancestor whose command line ends with tail."""
    pid = os.getppid()
    for _ in range(8):
        if pid <= 1:
            return None
        cmdline, st, where = procs.cmdline(pid), procs.stat(pid), procs.cwd(pid)
        if cmdline is None or st is None or where is None:
            return None
        if len(cmdline) > len(tail) and cmdline[len(cmdline) - len(tail):] == tail:
            return cmdline, where
        pid = st.ppid
    return None


def _probe_dir(path: str) -> str | None:
    """Why the output dir `path` cannot be used (created, written), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"output dir {path} cannot be created ({exc.strerror or exc}); choose another hydra.run.dir"
    probe = os.path.join(path, f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return (f"output dir {path} is not writable ({exc.strerror or exc}): metrics.jsonl and "
                "summary.json could not be written there; choose another hydra.run.dir")
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


class Trainer:
    """One rank's training loop over the parts build.py assembles."""

    def __init__(self, c: Config, comm: Collectives, out_dir: str | None, announce: bool = True) -> None:
        validate_world(c, comm.size)
        self.announce = announce  # print the recipe line (a bag's later members do not)
        self.c, self.comm = c, comm
        self.rank, self.world = comm.rank, comm.size
        torch.set_num_threads(auto_threads(c))
        self.device = device_of(c)
        kernels.configure(c.kernels.backend, self.device)
        # the directories first (rank 0 checks, every rank learns the outcome), so an unwritable
        # output dir or a checkpoint.dir in use stops the run before the data and the sparse side
        # (placement planning) are built
        self.out_dir = self._agree_out_dir(out_dir)
        self.ckpt_dir = c.checkpoint.dir or (os.path.join(self.out_dir, "checkpoints")
                                             if self.out_dir else None)  # None: no checkpoints
        self.checkpointer = (Checkpointer(comm, self.ckpt_dir, c.checkpoint.keep_last)
                             if self.ckpt_dir and c.checkpoint.enabled else None)
        try:
            self._build(c, comm)
        except BaseException:
            if self.checkpointer is not None:  # run() never gets this Trainer to release it
                self.checkpointer.close()
            raise

    def _build(self, c: Config, comm: Collectives) -> None:
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
        self.last_checkpoint: str | None = None
        self.current_step: int | None = None  # the step in progress (failure reports)
        self.resumed_from: str | None = None
        self.pipeline = c.train.pipeline
        # train.pipeline=ids: the settled rows travel early where bytes cost time, between hosts
        # (on one host the extra round trip measured more than the rows it moves ahead)
        self.settled = self.pipeline == "ids" and (c.comm.settled_rows == "always" or (
            c.comm.settled_rows == "auto" and comm.spans_hosts))
        self._next: tuple[int, tuple[Any, Any], Any] | None = None  # the step prepared ahead
        self._prefetch_calls = 0  # alltoalls made for the step prepared ahead
        self.lr = LrSchedule(c.optim, c.train.steps, self.opt, self.emb, sparse_lr(c))
        self.val_rows = int(getattr(self.data, "val_rows", 0))  # validation split (0: none)
        self.temperature = 1.0  # logit scale of evaluations (train.calibrate sets it before the final one)
        self.test_rows: np.ndarray | None = None  # [n, 2] (logit x temperature, label) of the last test evaluation
        self.early = EarlyStopping(c.train.early_stop.patience, c.train.early_stop.min_delta,
                                   c.train.early_stop.min_evals)
        self.start_step = self._resume()
        self.best = (BestSnapshot(self.model, self.emb, fresh=self.resumed_from is None)
                     if self.val_rows and c.train.early_stop.restore_best else None)
        self.recipe = recipe_of(c)
        if self.rank == 0 and self.recipe.name != "none" and self.announce:
            print(self.recipe.line(c), file=sys.stderr)

    def _agree_out_dir(self, out_dir: str | None) -> str | None:
        """Every rank writes into rank 0's output directory (Hydra dirs may differ by a second).
        Rank 0 creates it and writes a probe file there first; every rank gets the verdict with
        the directory, so an unwritable one stops every rank now, not at the first metrics line or
        at summary.json after the whole training."""
        problem = _probe_dir(out_dir) if out_dir is not None and self.rank == 0 else None
        with phase(self.comm, "other"):
            agreed, problem = self.comm.broadcast_object((out_dir, problem))
        if problem is not None:
            raise TrainingError(problem)
        return agreed

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Forward, backward, embedding push + owner update, dense allreduce + step. Collective."""
        prep = self._next if self._next is not None and self._next[0] == step else None
        self._next = None
        batch, info = prep[1] if prep is not None else self._batch(step)
        # alltoalls of this step: its own, with those its prefetch made during the step before,
        # without those it makes for the next one (train.pipeline)
        carried, self._prefetch_calls = (self._prefetch_calls if prep is not None else 0), 0
        calls = self._alltoall_calls()
        value = self._step(batch, info, step, prep[2] if prep is not None else None)
        made = self._alltoall_calls() - calls - self._prefetch_calls + carried
        self.alltoalls["hot" if info is not None and info.hot else "cold"] += made
        return value

    def _batch(self, step: int) -> tuple[Any, Any]:
        """(this rank's batch on the device, the GlobalStep or None) of `step`. Both copies are
        asynchronous (pinned host memory, trainer/device.py); with train.pipeline the next step's
        batch is made during this step, so its copy overlaps this step's work."""
        batch, info = self.feed.step(step) if self.feed is not None else (self.data.train_batch(step), None)
        if info is not None and info.hot_slots is not None:
            info = replace(info, hot_slots=to_device(info.hot_slots, self.device))
        return batch.to(self.device), info

    def _ahead(self, step: int) -> bool:
        """Whether step+1 is prepared during step `step` (train.pipeline; Herald plans its sync
        step by step against its flushes: no early planning)."""
        return self.pipeline != "off" and step + 1 < self.c.train.steps and self.sparse.herald is None

    def _prefetch(self, step: int) -> None:
        """train.pipeline: build step+1's batch and plan and send its id requests now, so they
        travel while this step computes (the requests depend on no update: exact); with ids, the
        owners also send the rows of step+1 that this step does not update (exact too); with
        rows, they answer all of step+1's reads now (within the pull bound). A bad batch (a data
        error, out-of-range ids) stops the run here, after this step's lookup and before any of
        its updates. (Made at the start of the step instead, the batch measured 6% slower on
        localhost.)"""
        if not self._ahead(step):
            return
        calls = self._alltoall_calls()
        batch, info = self._batch(step + 1)
        self._next = (step + 1, (batch, info), self.emb.prepare(batch, info))
        if self.settled:  # the rows this step leaves alone travel during its compute
            self.emb.serve_settled(self._next[2])
        elif self.pipeline == "rows" and not self._flush_after(step):
            # the owners answer step+1's reads now, before this step's updates (one step staler,
            # within the pull bound counting this in-flight step), so the version replies and
            # rows travel during forward and backward
            self.emb.serve(self._next[2])
        self._prefetch_calls = self._alltoall_calls() - calls  # step+1's (train_step counts them there)

    def _flush_after(self, step: int) -> bool:
        """Whether a flush (eval, checkpoint, the end) follows step `step`: train.pipeline=rows
        answers the reads after it, not before."""
        done = step + 1
        return bool(self._save_due(done) or done == self.c.train.steps
                    or (self.c.train.eval_every and done % self.c.train.eval_every == 0))

    def _drop_prepared(self) -> None:
        """The step prepared ahead (train.pipeline) will not run (early stop, failed save)."""
        if self._next is not None:
            self.emb.cancel(self._next[2])
            self._next = None

    def _alltoall_calls(self) -> int:
        calls = self.comm.counter.calls
        return calls.get("alltoall", 0) + calls.get("alltoall_splits", 0)

    def _step(self, batch: Any, info: Any, step: int, prep: Any = None) -> float:
        """One step; returns the global loss. train.nonfinite=stop: the loss travels with the dense
        gradients and a non-finite one raises (the run stops, no checkpoint is written after it).
        skip: the global loss is reduced first (one extra 4-byte allreduce) and, when it is not
        finite, every rank drops the step before anything changed (embedding.discard).
        train.pipeline != off: the next step is prepared during this one (_prefetch), and the dense
        allreduce starts behind the embedding gradient push and travels while the owners update."""
        self.model.train()
        if prep is not None:
            pooled = self.emb.lookup(batch, train=True, prepared=prep)
        else:
            pooled = self.emb.lookup(batch, train=True, info=info)
        self._prefetch(step)
        logits = self.model(batch.dense, pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / self.global_batch
        extra = [loss.detach().reshape(1)]
        if self.c.train.nonfinite == "skip":
            value = float(self.comm.allreduce(extra.pop(), op="sum", kind="dense").item())
            if not math.isfinite(value):
                self.emb.discard()
                if self._next is not None:  # its cache lookups predate the rollback: begin again
                    self.emb.cancel(self._next[2])
                    self._next = (self._next[0], self._next[1], self.emb.prepare(*self._next[1]))
                return value
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.pipeline == "off":
            self.emb.apply_gradients()
            reduced = self.comm.grouped_allreduce(grads + extra, op="sum", kind="dense")
        else:  # the row gradients leave first, the dense allreduce behind them while owners update
            dense = []
            self.emb.apply_gradients(between=lambda: dense.append(
                self.comm.grouped_allreduce_async(grads + extra, op="sum", kind="dense")))
            reduced = dense[0].wait()
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
        both = self._predict(split)
        scaled = np.stack([both[:, 0] * self.temperature, both[:, 1]], axis=1)
        if split == "test":
            self.test_rows = scaled  # the last test evaluation's (calibrated logit, label) rows: train.bag
        auc, ll = auc_logloss(scaled[:, 0], scaled[:, 1])
        return {"eval_auc": auc, "eval_logloss": ll, "eval_samples": int(both.shape[0])}

    @torch.no_grad()
    def _predict(self, split: str) -> np.ndarray:
        """[n, 2] (logit, label) of every row of the split, gathered from every rank. Collective."""
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
            return self.comm.allgather(local, kind="meta").numpy()

    def _calibrate(self) -> dict[str, Any]:
        """train.calibrate: fit the temperature of the final model's logits on the validation split
        (metrics.fit_temperature); the final test evaluation applies it. Collective: every rank
        gathers the same rows and fits the same T. Returns summary.json's `calibration`."""
        both = self._predict("val")
        t, before, after = fit_temperature(both[:, 0], both[:, 1])
        self.temperature = t
        if self.rank == 0:
            print(f"[trainer] calibration: logit temperature {t:.4g} fitted on {both.shape[0]} validation rows "
                  f"(their logloss {before:.4f} -> {after:.4f}); train.calibrate=false turns it off", file=sys.stderr)
        return {"temperature": t, "val_logloss_before": before, "val_logloss_after": after,
                "val_samples": int(both.shape[0])}

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
        report.start(self.start_step, self.resumed_from)
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
                    self._save_or_stop(done, train_time)
                if done == end:
                    break
            self._drop_prepared()  # an early stop leaves the step prepared ahead unrun
            if self.checkpointer is not None and self.start_step < end:
                self._save_or_stop(end, train_time)
            extra = self._restore_best(end) if self.val_rows else {}
            extra["calibration"] = self._calibrate() if c.train.calibrate and self.val_rows else None
            final_eval = self._eval_now(end)
            summary = report.summary(train_time, final_eval, self.losses, self.evals, self.start_step,
                                     self.resumed_from, self.last_checkpoint, self.alltoalls,
                                     end_step=end, extra={**extra, "recipe": self.recipe.describe(c),
                                                          "settled_rows": self.settled})
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

    def save_checkpoint(self, step: int, into: Checkpointer | None = None) -> str:
        """Flush the caches, then write checkpoint `step` (after `step` steps) with `into` (default:
        the run's checkpointer). Collective. Rank 0 adds the dense model + optimizer, the step
        (= data position: batches are a function of the step), RNG states, the loss history and
        evals so far."""
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
            saver = into or self.checkpointer
            try:
                self.last_checkpoint = saver.save(step, self.emb.store, state,
                                                  {**self._schema(), "config": asdict(self.c)})
            except CollectiveError:
                # rank 0 may have put this save in place before a peer was lost in its closing
                # broadcast: it is complete on disk, so the failure message names it
                if saver.completed == step_dir(saver.root, step):
                    self.last_checkpoint = saver.completed
                raise
        return self.last_checkpoint

    def _save_or_stop(self, step: int, train_time: float) -> None:
        """save_checkpoint(step); when the save fails (on any rank: every rank gets the
        CheckpointError), the model trained so far is still in memory and is not thrown away:
        _rescue saves it elsewhere if it can, evaluates it and writes the summary, then raises."""
        try:
            self.save_checkpoint(step)
        except CheckpointError as exc:
            self._rescue(step, exc, train_time)

    def _rescue(self, step: int, exc: CheckpointError, train_time: float) -> None:
        """After the failed save of `step`: a fallback save into the output dir's checkpoints/ when
        that is another directory than checkpoint.dir, then the evaluation at `step` and
        summary.json with `checkpoint_error` (where the model could not go, where it went).
        Always raises CheckpointError (exit 2) saying both; it carries the summary. Collective."""
        self._drop_prepared()
        failed = os.path.abspath(self.ckpt_dir)
        alt = os.path.abspath(os.path.join(self.out_dir, "checkpoints")) if self.out_dir else None
        fallback, fallback_error = None, None
        if alt is None:
            fallback_error = "no other place to save it: the run has no output dir"
        elif os.path.realpath(alt) == os.path.realpath(failed):
            fallback_error = "no other place to save it: the output dir's checkpoints/ is checkpoint.dir itself"
        else:
            backup = None
            try:
                backup = Checkpointer(self.comm, alt, 0)  # its own lock; keeps what it has
                fallback = self.save_checkpoint(step, into=backup)
            except CheckpointError as again:
                fallback_error = f"the fallback save into the output dir {alt} failed too: {again}"
            finally:
                if backup is not None:
                    backup.close()
        if fallback is not None:
            where = (f"the model trained so far (step {step}) was saved instead to {fallback} (continue "
                     f"with checkpoint.resume={fallback} and a checkpoint.dir with space)")
        else:
            where = f"the model of step {step} was not saved anywhere ({fallback_error})"
        error = {"step": step, "checkpoint_dir": failed, "error": str(exc), "fallback": fallback,
                 "fallback_error": fallback_error}
        done = [e for e in self.evals[-1:] if e["step"] == step and "split" not in e]  # tested at this step already
        final_eval = done[0] if done else self._eval_now(step)
        summary_path = os.path.join(self.out_dir, "summary.json") if self.out_dir else None
        summary, written = None, summary_path
        try:
            summary = self.report.summary(train_time, final_eval, self.losses, self.evals, self.start_step,
                                          self.resumed_from, self.last_checkpoint,
                                          self.alltoalls, end_step=step, checkpoint_error=error)
        except OSError as write_error:  # rank 0: summary.json too (it went to stdout)
            written = f"stdout (summary.json cannot be written: {write_error})"
        note = f"; evaluated, summary: {written} (checkpoint_error)" if written else "; evaluated"
        raised = CheckpointError(f"{exc}; {where}{note}")
        raised.summary = summary  # type: ignore[attr-defined]
        raise raised from exc

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
