"""CheckpointManager: the one place a training run saves, resumes and rescues through.

Why one object: a run's checkpointing has a lifetime (the directory's lock is taken at start-up,
before the data and the sparse side are built, and released when the run ends), a state (the newest
save of this run, the checkpoint it resumed from) and rules that span the package (flush the caches
before a save, check the schema before a load, save elsewhere when a save fails). The Trainer asks
this object and nothing else: `due(step)`, `save(step, run)`, `resume(run)`, `rescue(...)`,
`close()`. What is saved of the run is named by the Checkpointed protocol below, so this module
never imports the Trainer (runner.Trainer satisfies it).

A failed save never throws the trained model away: rescue() writes it into the output dir's
checkpoints/ when that is another directory than checkpoint.dir, and returns a Rescue saying where
it went (or why it could not); the Trainer then evaluates it, writes summary.json with
`checkpoint_error` and raises the Rescue's error (exit 2).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from ..evaluation.best import EarlyStopping
from ...base.core.errors import phase
from ...base.comm import CollectiveError, Collectives
from ...base.config import Config, ConfigError
from ...base.core.disk import free_share
from ...base.core.progress import fmt_bytes
from ...sparse.embedding import HybridEmbedding
from .loader import load, resolve
from .manifest import CheckpointError, read_manifest, step_dir
from .saver import CheckpointWriter
from .state import rng_state, set_rng_state


class Stateful(Protocol):
    """A part whose state a checkpoint keeps when it has one (precision.DensePrecision)."""

    def state_dict(self) -> Optional[dict[str, Any]]: ...

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None: ...


class Checkpointed(Protocol):
    """What a checkpoint saves of a run and puts back (runner.Trainer is one)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    emb: HybridEmbedding
    device: torch.device
    losses: list[float]  # the global loss of every step so far
    evals: list[dict[str, Any]]  # every evaluation record so far
    early: EarlyStopping
    precision: Stateful  # train.precision (trainer/step/precision.py; fp16: its loss scaler is saved)


@dataclass
class Rescue:
    """After a failed save of `step`: where the model trained so far went (fallback), or why it
    could not go anywhere (fallback_error)."""

    step: int
    checkpoint_dir: str  # checkpoint.dir, absolute: where the save failed
    cause: CheckpointError
    fallback: Optional[str] = None
    fallback_error: Optional[str] = None

    def record(self) -> dict[str, Any]:
        """summary.json's `checkpoint_error`."""
        return {"step": self.step, "checkpoint_dir": self.checkpoint_dir, "error": str(self.cause),
                "fallback": self.fallback, "fallback_error": self.fallback_error}

    def error(self, note: str, summary: Optional[dict[str, Any]]) -> CheckpointError:
        """The error that ends the run: the cause, where the model went, then `note` (the summary's
        place); it carries the summary."""
        if self.fallback is not None:
            where = (f"the model trained so far (step {self.step}) was saved instead to {self.fallback} "
                     f"(continue with checkpoint.resume={self.fallback} and a checkpoint.dir with space)")
        else:
            where = f"the model of step {self.step} was not saved anywhere ({self.fallback_error})"
        raised = CheckpointError(f"{self.cause}; {where}{note}")
        raised.summary = summary  # type: ignore[attr-defined]
        return raised


class CheckpointManager:
    """A run's checkpoints: checkpoint.dir (default: <output dir>/checkpoints; None without an
    output dir), its lock, periodic and final saves, resume, and the rescue of a failed save.

    Created at start-up: with checkpoints enabled, rank 0 takes the directory's lock and every
    rank gets the outcome (a directory in use stops every rank now). close() releases it; the
    Trainer's `with` block calls it."""

    def __init__(self, c: Config, comm: Collectives, out_dir: Optional[str]) -> None:
        self.c, self.comm, self.out_dir = c, comm, out_dir
        self.root = c.checkpoint.dir or (os.path.join(out_dir, "checkpoints") if out_dir else None)
        self.saver = (CheckpointWriter(comm, self.root, c.checkpoint.keep_last, c.checkpoint.lock_lease_s)
                      if self.root and c.checkpoint.enabled else None)
        self.last: Optional[str] = None  # this run's newest complete save
        self.last_step: Optional[int] = None  # ... and its step
        self.resumed_from: Optional[str] = None  # the checkpoint this run started from
        self.resumed_world: Optional[int] = None  # the W that saved it
        self._resume_path: Optional[str] = None  # resume_path(), once decided
        self._resolved = False

    @property
    def enabled(self) -> bool:
        """Whether this run writes checkpoints (checkpoint.enabled and a directory to write to)."""
        return self.saver is not None

    def close(self) -> None:
        """Release checkpoint.dir's lock (rank 0); the checkpoints stay. Idempotent."""
        if self.saver is not None:
            self.saver.close()

    def check_space(self, emb: HybridEmbedding, params: list[torch.nn.Parameter]) -> None:
        """checkpoint.space_check: a save needs room for one more checkpoint beside those kept (they
        go only once it is complete): this rank's shard, and on rank 0 the dense model with its
        optimizer; the ranks of a host share its disk. A directory that cannot hold it stops every
        rank now with one line (exit 2), not at the first save hours later. Collective."""
        if not (self.enabled and self.c.checkpoint.space_check):
            return
        store = emb.store
        need = store.sharding.local_rows * store.bytes_per_row()["total"]  # rows, versions, optimizer state
        if self.comm.rank == 0:  # the dense parameters and their optimizer's state (adam: 2 more copies)
            o = self.c.optim
            copies = 3 if o.dense == "adam" else 2 if o.dense == "adagrad" or o.momentum else 1
            need += copies * sum(p.numel() * p.element_size() for p in params)

        def room() -> None:
            share = max(self.comm.local_size or 1, 1)
            free = free_share(self.root, share)
            if need > free:
                of = f" (its disk's free space shared by this host's {share} ranks)" if share > 1 else ""
                raise ConfigError(f"checkpoint.dir {self.root}: rank {self.comm.rank}'s part of a checkpoint "
                                  f"needs about {fmt_bytes(need)}, it has {fmt_bytes(free)} free{of}; free space there, "
                                  "set checkpoint.dir elsewhere or checkpoint.enabled=false "
                                  "(checkpoint.space_check=false starts anyway)")
        self.comm.all_succeed("checkpoint space", room, ConfigError)

    def due(self, done: int) -> bool:
        """Whether a periodic save follows `done` steps (checkpoint.every; the final one is fit's)."""
        every = self.c.checkpoint.every
        return self.enabled and every > 0 and done % every == 0 and done < self.c.train.steps

    def schema(self, run: Checkpointed) -> dict[str, Any]:
        """What a checkpoint must agree on to be loaded into this run (manifest.SCHEMA_KEYS)."""
        c = self.c
        return {"table_rows": list(run.emb.sharding.table_rows), "dim": c.model.embedding_dim,
                "model": c.model.name, "optim_sparse": c.optim.sparse, "optim_dense": c.optim.dense}

    def save(self, step: int, run: Checkpointed, into: Optional[CheckpointWriter] = None) -> str:
        """Flush the caches, then write checkpoint `step` (after `step` steps) with `into` (default:
        this run's checkpointer). Collective. Rank 0 adds the dense model + optimizer, the step
        (= data position: batches are a function of the step), RNG states, the loss history and
        evals so far."""
        with phase(self.comm, "train"):  # the flush's pushes are training traffic, saved or not
            run.emb.flush()
        with phase(self.comm, "other"):
            state = None
            if self.comm.rank == 0:
                state = {"step": step, "data_position": step,
                         "model": {k: v.detach().cpu() for k, v in run.model.state_dict().items()},
                         "optimizer": run.opt.state_dict(), "rng": rng_state(run.device),
                         "losses": list(run.losses), "evals": list(run.evals),
                         "early_stop": run.early.state()}
                if run.precision.state_dict() is not None:  # train.precision=fp16: the loss scaler
                    state["precision"] = run.precision.state_dict()
            saver = into or self.saver
            assert saver is not None, "save() of a run without checkpoints"
            try:
                self.last = saver.save(step, run.emb.store, state, {**self.schema(run), "config": asdict(self.c)})
                self.last_step = step
            except CollectiveError:
                # rank 0 may have put this save in place before a peer was lost in its closing
                # broadcast: it is complete on disk, so the failure message names it
                if saver.completed == step_dir(saver.root, step):
                    self.last = saver.completed
                raise
        return self.last

    def rescue(self, step: int, exc: CheckpointError, run: Checkpointed) -> Rescue:
        """After the failed save of `step` (every rank got the CheckpointError): a fallback save into
        the output dir's checkpoints/ when that is another directory than checkpoint.dir, under its
        own lock (it keeps what it has). Collective."""
        assert self.root is not None
        failed = os.path.abspath(self.root)
        out = Rescue(step, failed, exc)
        alt = os.path.abspath(os.path.join(self.out_dir, "checkpoints")) if self.out_dir else None
        if alt is None:
            out.fallback_error = "no other place to save it: the run has no output dir"
        elif os.path.realpath(alt) == os.path.realpath(failed):
            out.fallback_error = "no other place to save it: the output dir's checkpoints/ is checkpoint.dir itself"
        else:
            backup = None
            try:
                backup = CheckpointWriter(self.comm, alt, 0, self.c.checkpoint.lock_lease_s)
                out.fallback = self.save(step, run, into=backup)
            except CheckpointError as again:
                out.fallback_error = f"the fallback save into the output dir {alt} failed too: {again}"
            finally:
                if backup is not None:
                    backup.close()
        return out

    def resume_path(self) -> Optional[str]:
        """The checkpoint this run will resume from (None: a fresh start), decided once by rank 0
        (loader.resolve; collective the first time)."""
        if not self._resolved:
            self._resume_path, self._resolved = resolve(self.comm, self.c.checkpoint.resume, self.root), True
        return self._resume_path

    def resume(self, run: Checkpointed, interrupt: Optional[Callable[[], bool]] = None) -> int:
        """Load checkpoint.resume (if any) into the run; returns the step to continue from (0: a
        fresh start). Collective. interrupt: asked before each read of the load; a stop request
        there ends the load on every rank (StopRequested: nothing trained, the checkpoint intact)."""
        with phase(self.comm, "other"):
            path = self.resume_path()
            if path is None:
                return 0
            state = load(self.comm, path, run.emb.store, self.schema(run),
                         auto_root=self.root if self.c.checkpoint.resume == "auto" else None,
                         counter={"bytes_read": 0, "interrupt": interrupt})
            if run.emb.replica is not None:
                run.emb.replica.load_from_owners(self.comm, run.emb.store)
        step = int(state["step"])
        if step > self.c.train.steps:
            raise CheckpointError(f"checkpoint {path} is at step {step}, "
                                  f"beyond train.steps={self.c.train.steps}")
        try:
            run.model.load_state_dict(state["model"])
            run.opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: dense state does not fit this model: {exc}") from exc
        set_rng_state(state["rng"], run.device)
        run.losses, run.evals = list(state["losses"]), list(state["evals"])
        run.early.load(state.get("early_stop"))  # a stopped run stays stopped; patience goes on
        run.precision.load_state_dict(state.get("precision"))  # fp16's loss scale goes on (else a fresh one)
        run.emb.clock(step - 1)  # the last step trained (a flush before the next lookup records it)
        self.resumed_from = path
        self.resumed_world = int(read_manifest(path)["world_size"])
        return step
