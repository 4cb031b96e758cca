"""One exit status for a whole job, launcher included: `python -m trainer.run.job -- COMMAND ...`.

Why: a requeue script (Slurm's, a Kubernetes Job's, a shell loop) must tell "preempted: start me
again with checkpoint.resume=auto" from "failed: do not". Each trainer process exits with its own
status (0, 2 for bad input, 128 + a stop signal, 3 for a lost worker), but torchrun and horovodrun
exit 1 for any of those, with tracebacks of their own (SignalException, ChildFailedError). This
wrapper runs COMMAND (a launcher, or `python -m trainer` itself) with TRAINER_EXIT_DIR set: every
trainer process writes its status there as it exits (record_exit), and the wrapper exits with the
job's:

    0    complete (every process that ran ended with 0)
    143  preempted and resumable: a stop signal (SIGTERM, SIGINT, SIGUSR1) stopped the run; its
         checkpoint is where summary.json's `stopped` says; run the same command with
         checkpoint.resume=auto (one line says so)
    2    bad config or input: running it again will fail the same way
    3    a worker was lost (the survivors printed the newest checkpoint and the relaunch command)
    1    any other failure (the launcher's own output is shown in full)

`--lost-worker-exit N` (before the `--`) exits N instead of 3 for a lost worker: Kubeflow's
`restartPolicy: ExitCode` restarts a pod that exits 128-255 and fails the job for 1-127, and a lost
worker is worth a restart (deploy/k8s/ uses 203: 200 + 3, no signal's number).

The signals the wrapper receives (TERM, INT, USR1) go to COMMAND, in a form it handles: a launcher
(torchrun, horovodrun) gets USR1 as TERM (torchrun has no USR1 handler: it would die and leave its
workers running; on TERM it stops its workers, which save and exit as on USR1). COMMAND runs in a
process group of its own; when it has ended, a process of that group still running (a worker its
launcher left behind) gets STRAGGLER_GRACE_S (30 s; `--grace S` before the `--`) to end, then TERM,
then KILL, said in one line: the wrapper never exits leaving a worker behind. The launcher's own tracebacks and
failure tables are held back and shown only for status 1; the trainer's lines pass through as they
come. A process on another host writes into that host's TRAINER_EXIT_DIR (the same path, if it
exists there), so the status counts the processes on this host and, on a shared file system, all.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable, Optional, TextIO

from ..base.core import procs
from ..base.core.signals import EXIT_DIR_ENV

PREEMPTED = 143
LAUNCHERS = ("torchrun", "horovodrun", "torch.distributed.run", "torch.distributed.launch")
STRAGGLER_GRACE_S = 30.0  # a worker that outlives its launcher: this long to end (its save), then TERM, KILL
STOP_STATUSES = (128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGUSR1)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
OUTCOMES = {0: "complete", PREEMPTED: "preempted", 2: "bad config or input", 3: "a worker was lost", 1: "failed"}
# the launchers' own lines: held back unless the job failed for another reason
_LAUNCHER_EXCEPTION = re.compile(r"(ChildFailedError|SignalException|horovod|Horovod detected)")
_LAUNCHER_LINE = re.compile(r"(torch\.distributed\.elastic|torch/distributed/|^Process \d+ exit with status code|"
                            r"^Terminating remaining workers|Sending process \d+ closing signal|"
                            r"^W\d{4} .*(api|elastic)|^\*{10,}|^Setting OMP_NUM_THREADS)")


def job_status(statuses: Iterable[int], launcher: int) -> int:
    """The job's status (module docstring) from its processes' and the launcher's."""
    got = list(statuses)
    if not got:  # no trainer process got to its end (the launcher failed first, or was killed)
        return 0 if launcher == 0 else (PREEMPTED if launcher in STOP_STATUSES or -launcher in FORWARDED else 1)
    if 2 in got:
        return 2
    if any(s in STOP_STATUSES for s in got):
        return PREEMPTED
    if 3 in got:
        return 3
    return 0 if all(s == 0 for s in got) and launcher in (0, *STOP_STATUSES, *(-s for s in FORWARDED)) else 1


class LauncherFilter:
    """Passes the command's stderr through line by line, holding back the launcher's own lines:
    its tracebacks (with ChildFailedError's failure table) and its status chatter."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.held: list[str] = []
        self._block: Optional[list[str]] = None  # a traceback being read
        self._table = 0  # ChildFailedError's table: the '====' lines still to swallow

    def feed(self, line: str) -> None:
        if self._table:
            self.held.append(line)
            if line.startswith("===="):
                self._table -= 1
            return
        if self._block is not None:
            self._block.append(line)
            if line[:1].isspace() or not line.strip() or line.startswith(("Traceback (", "During handling",
                                                                           "The above exception")):
                return
            block, self._block = self._block, None  # the exception's line ends the traceback
            if _LAUNCHER_EXCEPTION.search(line):
                self.held.extend(block)
                self._table = 2 if "ChildFailedError" in line else 0
            else:
                self._write(block)
            return
        if line.startswith("Traceback (most recent call last):"):
            self._block = [line]
        elif _LAUNCHER_LINE.search(line):
            self.held.append(line)
        else:
            self._write([line])

    def close(self, show_held: bool) -> None:
        if self._block:
            self.held.extend(self._block)
            self._block = None
        if show_held:
            self._write(self.held)

    def _write(self, lines: list[str]) -> None:
        self.out.write("".join(lines))
        self.out.flush()


def _feed(stream: TextIO, filt: LauncherFilter) -> None:
    for line in stream:
        filt.feed(line)


def is_launcher(args: list[str]) -> bool:
    """COMMAND starts a launcher (torchrun, horovodrun; as a program, a script run by python, or
    `python -m torch.distributed.run`)."""
    return any(os.path.basename(a) in LAUNCHERS or a in LAUNCHERS for a in args[:3])


def forwarded(signum: int, launcher: bool) -> int:
    """The signal COMMAND gets for `signum` (module docstring): USR1 as TERM to a launcher."""
    return signal.SIGTERM if launcher and signum == signal.SIGUSR1 else signum


def stop_stragglers(pgid: int, grace: float = STRAGGLER_GRACE_S) -> int:
    """After COMMAND ended: the processes of its group still running get `grace` seconds to end,
    then TERM, then KILL (one line says so); returns how many there were."""
    left = procs.group(pgid)
    if not left:
        return 0
    end = time.monotonic() + grace
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = procs.group(pgid)
    if not left:
        return 0
    print(f"[job] {len(left)} process(es) outlived the launcher ({', '.join(map(str, left))}): stopping them",
          file=sys.stderr)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while procs.group(pgid) and time.monotonic() < end:
            time.sleep(0.1)
        if not procs.group(pgid):
            break
    return len(left)


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    lost_worker, grace = 3, STRAGGLER_GRACE_S
    while args[:1] and args[0].split("=", 1)[0] in ("--lost-worker-exit", "--grace"):
        opt = args.pop(0)
        name = opt.split("=", 1)[0]
        value = opt.split("=", 1)[1] if "=" in opt else (args.pop(0) if args else "")
        if name == "--grace":
            try:
                grace = float(value)
                if not grace >= 0:
                    raise ValueError
            except ValueError:
                print(f"error: --grace {value}: must be seconds >= 0", file=sys.stderr)
                return 2
            continue
        if not value.isdigit() or not 3 <= int(value) <= 255 or int(value) == PREEMPTED:
            print(f"error: --lost-worker-exit {value}: must be an exit status from 3 to 255, not 143", file=sys.stderr)
            return 2
        lost_worker = int(value)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr if not args else sys.stdout)
        return 0 if args else 2
    with tempfile.TemporaryDirectory(prefix="trainer-exit-") as where:
        try:
            proc = subprocess.Popen(args, env={**os.environ, EXIT_DIR_ENV: where}, stderr=subprocess.PIPE,
                                    text=True, bufsize=1, errors="replace", process_group=0)
        except OSError as exc:
            print(f"error: {args[0]}: cannot be run ({exc.strerror or exc})", file=sys.stderr)
            return 2
        launched = is_launcher(args)
        for s in FORWARDED:
            signal.signal(s, lambda signum, frame: proc.send_signal(forwarded(signum, launched)))
        filt = LauncherFilter(sys.stderr)
        assert proc.stderr is not None
        # read on a thread: a worker its launcher left behind holds the pipe open, and the wrapper
        # must see the launcher end to stop it (stop_stragglers), not wait for the pipe's end
        reader = threading.Thread(target=_feed, args=(proc.stderr, filt), daemon=True)
        reader.start()
        launcher = proc.wait()
        stop_stragglers(proc.pid, grace)
        reader.join(timeout=30)
        statuses = []
        for name in os.listdir(where):
            try:
                statuses.append(int(open(os.path.join(where, name)).read().strip()))
            except (OSError, ValueError):
                pass
    status = job_status(statuses, launcher)
    filt.close(show_held=status == 1)
    code = lost_worker if status == 3 else status
    what = OUTCOMES[status] if status in OUTCOMES else "failed"
    then = {PREEMPTED: "; resumable: run the same command with checkpoint.resume=auto",
            3: "; resumable: see the relaunch command above"}.get(status, "")
    print(f"[job] {what} (exit {code}; {len(statuses)} trainer process(es) ended: "
          f"{', '.join(str(s) for s in sorted(statuses)) or 'none'}; launcher {launcher}){then}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
