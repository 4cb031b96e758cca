"""After a lost worker: where this rank stopped, and the one command that continues the job.

When a peer dies or stalls, every surviving rank fails in a collective (CollectiveError, exit 3).
The message it prints is only useful with a way to go on, so runner.run() appends failure_hint():
the step reached, the newest complete checkpoint of this run, and a shell command that continues
from it in the same directories. Not "the same command with checkpoint.resume=auto": with the
default output dir that relaunch gets a new timestamped dir (and a new checkpoint dir in it) and
starts over. The command is this job's own, found by looking at the processes above this one
(trainer/base/core/procs.py reads /proc): torchrun starts its workers as children, horovodrun through a
shell, and the nearest ancestor whose arguments end with ours is the launcher to run again, from
its own working directory. Its checkpoint.resume, checkpoint.dir and hydra.run.dir arguments are
replaced by the absolute places of this run, quoted for the shell and for Hydra's parser.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

from ..base.core import procs
from .checkpoint import latest as latest_checkpoint
from ..base.comm import Collectives
from ..base.config import Config

__all__ = ["RELAUNCH_KEYS", "Position", "continue_hint", "failure_hint", "relaunch_command"]


@dataclass
class Position:
    """Where a run stands (Trainer.position): what the advice after a lost worker names."""

    step: Optional[int]  # the step in progress (None: outside the training loop)
    out_dir: Optional[str]  # the output dir every rank agreed on
    ckpt_dir: Optional[str]  # checkpoint.dir in force (None: no checkpoints)
    last: Optional[str]  # this run's newest complete save, else the checkpoint it resumed from


def failure_hint(c: Config, comm: Collectives, at: Optional[Position], out_dir: Optional[str]) -> str:
    """Where this rank stopped, the checkpoint to continue from, and the command that does it.
    at: the run's position, None when no Trainer was built (then it is read from the config and
    out_dir, this rank's own output dir before the ranks agreed on one)."""
    where = f"at step {at.step} of {c.train.steps}" if at is not None and at.step is not None \
        else "outside the training loop"
    head = (f"rank {comm.rank}/{comm.size} stopped {where}: a worker died or stalled (comm.timeout_s="
            f"{c.comm.timeout_s:g}).")
    return f"{head} {continue_hint(c, comm, at, out_dir, sep=COMMAND_LINE)}"


def continue_hint(c: Config, comm: Collectives, at: Optional[Position], out_dir: Optional[str],
                  sep: str = " ") -> str:
    """The newest complete checkpoint of this run (or that there is none) and the command that
    continues from it (after `sep`); at / out_dir as failure_hint's."""
    try:
        if at is not None:
            out, root, last = at.out_dir, at.ckpt_dir, at.last
        else:
            out = out_dir
            root = c.checkpoint.dir or (os.path.join(out, "checkpoints") if out else None)
            # the checkpoint it started from; never an older job's save that happens to lie in
            # checkpoint.dir (a fresh run did not ask to continue that one)
            last = c.checkpoint.resume if c.checkpoint.resume not in (None, "auto") else None
            if last is None and c.checkpoint.resume == "auto":
                last = latest_checkpoint(root)
        command = relaunch_command(last, root, out, size=comm.size)
    except Exception as exc:  # noqa: BLE001 - the hint must never hide the failure itself
        return f"(no relaunch command: {type(exc).__name__}: {exc})"
    if last is not None:
        what = f"The newest complete checkpoint of this run is {os.path.abspath(last)}; to continue from it, run:"
    else:
        what = ("No checkpoint of this run is complete yet (checkpoint.every=N saves every N steps); "
                "to run it again from the start in the same directories, run:")
    return f"{what}{sep}{command}"


COMMAND_LINE = "\n    "  # the command on its own indented line, after a lost worker (copied from a log)
RELAUNCH_KEYS = ("checkpoint.resume", "checkpoint.dir", "hydra.run.dir")  # replaced in the command


def relaunch_command(resume: str | None, ckpt_dir: str | None, out_dir: str | None, size: int = 1) -> str:
    """A shell command that continues this job: `cd <launch dir> && <launcher and trainer command>`
    with every checkpoint.resume / checkpoint.dir / hydra.run.dir argument replaced by the absolute
    checkpoint to resume (none: start over; "auto": the newest one), checkpoint dir and output dir.

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
    if resume is not None:  # "auto": the newest save in checkpoint.dir (an ensemble's members)
        job.append(f"checkpoint.resume={'auto' if resume == 'auto' else _hydra_value(os.path.abspath(resume))}")
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
