"""Preemption: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 stop a run at the next step boundary, saved.

Why a flag and not an exception: a scheduler or a user may signal one rank or all of them, at any
point of a step. Raising there would leave the other ranks waiting in the step's collectives and
lose everything since the last checkpoint. The handler only records the signal; the step's loss
reduction carries one element more, 1 on a rank that has received one (with the dense gradients,
or in train.nonfinite=skip's loss allreduce), so every rank learns it in the same step and all stop
after it; W = 1 reads its own flag. Then (runner.Trainer._stop) the run saves that step
(train.on_signal=save), writes summary.json with `stopped`, releases its checkpoint dir; run()
prints one line with the relaunch command (announce) and the process exits with 128 + the signal's
number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1), the status a scheduler reads as "ended by it".

A second signal while a checkpoint is being written lets the save finish (one line says so; the
run then stops as the first signal asked): the grace a scheduler gives between its warning and its
kill (Slurm's --signal=B:USR1@N then TERM at the time limit; Kubernetes' TERM then KILL after
terminationGracePeriodSeconds; torchrun forwarding TERM) is for that save. Only a second SIGINT
from a terminal (stdin is a tty: Ctrl-C twice) exits at once during a save. Outside a save, a
second signal exits at once (os._exit, 128 + its number); a save abandoned that way leaves its
.tmp- directory to the next run, which takes the dead run's lock over; the earlier checkpoints
stay. The same signal again within REPEAT_S of the first counts once: a scheduler that signals
every process of a job and torchrun forwarding it to its workers deliver it twice.

The handlers are in force while runner.run() runs (the main thread only: Python runs handlers
there) and the previous ones are put back after it.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..base.core.errors import phase
from ..base.core.signals import REPEAT_S, SIGNALS, STOP_SIGNALS, SignalWatch
from ..base.comm import Collectives
from ..base.config import Config
from .relaunch import relaunch_command

__all__ = ["NOT_EVALUATED", "REPEAT_S", "SIGNALS", "STOP_SIGNALS", "SignalWatch", "Stop", "agree", "announce",
           "stopped_at_start", "why_not_saved"]

NOT_EVALUATED = {"eval_auc": None, "eval_logloss": None, "eval_samples": 0}  # summary.json after a stop


@dataclass
class Stop:
    """A run stopped by a signal after `step` steps: summary.json's `stopped`."""

    signal: str  # its name, e.g. SIGTERM: the signal of the lowest rank that received one
    rank: int  # that rank
    ranks: list[int]  # every rank that had received one
    step: Optional[int]  # None: stopped during start-up (stopped_at_start), nothing trained
    checkpoint: Optional[str] = None  # saved at the stop (none: train.on_signal=stop, no checkpoints)
    continue_from: Optional[str] = None  # the newest complete checkpoint of the run
    why_none: Optional[str] = None  # why no checkpoint was saved at the stop

    def saved(self, path: Optional[str]) -> None:
        """The checkpoint saved at the stop: `path` (None: the save failed, with no fallback)."""
        self.checkpoint, self.continue_from = path, path or self.continue_from
        self.why_none = None if path else "its save failed: see checkpoint_error"

    @property
    def exit_status(self) -> int:
        return 128 + int(signal.Signals[self.signal])

    def record(self) -> dict[str, Any]:
        return {"reason": "signal", "signal": self.signal, "rank": self.rank, "ranks": self.ranks,
                "step": self.step, "checkpoint": self.checkpoint, "continue_from": self.continue_from,
                "no_checkpoint": self.why_none, "exit_status": self.exit_status}


def stopped_at_start(comm: Collectives, watch: SignalWatch, during: str, out_dir: Optional[str]) -> dict[str, Any]:
    """A stop signal ended start-up in `during` (a long phase: StopRequested): nothing was trained,
    so nothing is saved; rank 0 says so in one line. The run's summary (not written to disk: there
    is nothing to report but this) with `stopped`; the process exits with 128 + the signal."""
    stop = Stop(signal.Signals(watch.received or signal.SIGTERM).name, comm.rank, [comm.rank], None,
                why_none=f"stopped during start-up ({during}): nothing trained")
    if comm.rank == 0:
        print(f"stopped: {stop.signal} received during start-up ({during}): nothing was trained, so nothing was "
              f"saved; the same command starts it again (exit status {stop.exit_status})", file=sys.stderr, flush=True)
    return {"stopped": {**stop.record(), "during": during}, "output_dir": out_dir}


def why_not_saved(c: Config, enabled: bool) -> Optional[str]:
    """Why a stop saves no checkpoint (None: it saves one). enabled: the run has a checkpointer."""
    if c.train.on_signal == "stop":
        return "train.on_signal=stop"
    if not c.checkpoint.enabled:
        return "checkpoint.enabled=false"
    return None if enabled else "the run has no output dir, so no checkpoint dir"


def agree(comm: Collectives, watch: SignalWatch, step: int) -> Stop:
    """Which ranks received which signal (W > 1: one allgather, once per run). Collective."""
    mine = watch.received or 0
    if comm.size > 1:
        with phase(comm, "other"):
            got = [int(x) for x in comm.allgather(torch.tensor([mine], dtype=torch.int64), kind="meta").tolist()]
    else:
        got = [mine]
    ranks = [r for r, s in enumerate(got) if s]
    first = ranks[0] if ranks else comm.rank
    return Stop(signal.Signals(got[first] or signal.SIGTERM).name, first, ranks, step)


def announce(summary: dict[str, Any], comm: Collectives, resume: Optional[str],
             ckpt_dir: Optional[str], out_dir: Optional[str], note: str = "") -> None:
    """Rank 0 prints the one line of a stop (summary["stopped"]: the signal, the step, the
    checkpoint; the summary's place; the command that continues in out_dir, `resume` a checkpoint
    or "auto"); then every rank waits for the others, so that no rank exits (and torchrun stops
    the rest) before rank 0 has said it. Collective."""
    stopped = summary["stopped"]
    if comm.rank == 0:
        try:
            command = relaunch_command(resume, ckpt_dir, out_dir, size=comm.size)
        except Exception as exc:  # noqa: BLE001 - the line must never hide the stop itself
            command = f"(no relaunch command: {type(exc).__name__}: {exc})"
        ranks = stopped["ranks"]
        who = ("" if comm.size == 1 else " by every rank" if len(ranks) == comm.size
               else f" by rank {ranks[0]}" if len(ranks) == 1 else f" by ranks {', '.join(map(str, ranks))}")
        saved = (f"saved checkpoint {os.path.abspath(stopped['checkpoint'])}" if stopped["checkpoint"]
                 else f"no checkpoint saved ({stopped['no_checkpoint']})")
        where = summary.get("output_dir")
        written = f"; summary: {os.path.join(where, 'summary.json')}" if where else ""
        if resume == "auto" or (resume is not None and resume == stopped["checkpoint"]):
            go = "to continue, run:" if resume == "auto" else "to continue from it, run:"
        elif resume is not None:
            go = f"the newest complete checkpoint of this run is {os.path.abspath(resume)}; to continue from it, run:"
        else:
            go = "no checkpoint of this run is complete; to run it again from the start in the same directories, run:"
        steps = summary["config"]["train"]["steps"]
        print(f"stopped: {stopped['signal']} received{who}: training stopped after step {stopped['step']} of {steps}, "
              f"{saved}{note}{written} (exit status {stopped['exit_status']}); {go} {command}",
              file=sys.stderr, flush=True)
    if comm.size > 1:
        comm.barrier()
