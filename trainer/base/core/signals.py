"""This process's stop signals (SIGTERM, SIGINT, SIGUSR1) and its exit note: what the step, the
loop and the entry point share, below all of them.

The handler only records a signal (SignalWatch); the step carries the flag in its loss reduction so
every rank learns it in the same step (trainer/run/signals.py has the whole protocol: the stop, the
save, the relaunch line). record_exit notes the status this trainer process exits with for a job
wrapper (trainer/run/job.py sets TRAINER_EXIT_DIR); it is async-signal-safe, since the handler of a
second signal calls it before os._exit.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

__all__ = ["EXIT_DIR_ENV", "REPEAT_S", "SIGNALS", "STOP_SIGNALS", "SignalWatch", "record_exit"]

EXIT_DIR_ENV = "TRAINER_EXIT_DIR"  # where a job wrapper collects its trainer processes' statuses


def record_exit(status: int) -> None:
    """This trainer process exits with `status`: note it in TRAINER_EXIT_DIR (when a job wrapper set
    it). Async-signal-safe (os.open / os.write only): also called from a signal handler."""
    where = os.environ.get(EXIT_DIR_ENV)
    if not where:
        return
    try:
        fd = os.open(os.path.join(where, f"{socket.gethostname()}-{os.getpid()}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, str(int(status)).encode())
        finally:
            os.close(fd)
    except OSError:
        pass


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_S = 1.0  # the same signal again within this many seconds is the same request


class SignalWatch:
    """This process's stop signals: the first one received, and whether a rank had one at the last
    step boundary (`agreed`, the same on every rank)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None  # the first signal's number
        self.agreed = False
        self._at = 0.0
        self._depth = 0
        self._saving = 0  # > 0 while a checkpoint is being written (saving())
        self._deferred: Optional[int] = None  # a second signal that came during a save
        self._previous: dict[int, Any] = {}

    @contextmanager
    def watching(self) -> Iterator["SignalWatch"]:
        """Handle the stop signals in this block (runner.run), then put the previous handlers back."""
        outer = self._depth == 0
        if outer:
            self.received, self.agreed, self._deferred = None, False, None
            if threading.current_thread() is threading.main_thread():
                self._previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
                for s in STOP_SIGNALS:
                    signal.signal(s, self._handle)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if outer:
                for s, handler in self._previous.items():
                    signal.signal(s, handler if handler is not None else signal.SIG_DFL)
                self._previous = {}
                self.received, self.agreed = None, False

    def requested(self) -> bool:
        """Whether this process has received a stop signal (what a long phase asks between its
        pieces: an evaluation batch, a profile's chunk, a resume's read)."""
        return self.received is not None

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint is being written in this block: a second signal lets it finish."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._at = signum, now
            return
        if signum == self.received and now - self._at < REPEAT_S:
            return
        name = signal.Signals(signum).name
        if self._saving and not (signum == signal.SIGINT and _from_terminal()):
            if self._deferred is None:
                self._deferred = signum
                os.write(2, f"[trainer] second signal ({name}) during a checkpoint save: the save goes on, then "
                            "the run stops (Ctrl-C twice from a terminal exits at once)\n".encode())
            return
        os.write(2, f"[trainer] second signal ({name}): exiting now (status {128 + signum}); the "
                    "checkpoint being written, if any, is abandoned, the earlier ones are intact\n".encode())
        record_exit(128 + signum)
        os._exit(128 + signum)

    def carry(self, loss: torch.Tensor, world: int) -> torch.Tensor:
        """What the step's loss reduction sums: the local loss [1], with W > 1 followed by this
        rank's flag (1: it has received a stop signal)."""
        loss = loss.detach().reshape(1)
        return loss if world == 1 else torch.cat([loss, loss.new_tensor([float(self.received is not None)])])

    def take(self, reduced: torch.Tensor, world: int) -> float:
        """The global loss from the reduced carry(); notes whether a rank had a signal (agreed)."""
        return self.take_values(reduced, world)[0]

    def take_values(self, reduced: torch.Tensor, world: int) -> list[float]:
        """take() of a reduced carry() that has more elements after it (fp16's overflow count,
        trainer/step/precision.py): [global loss, those elements], in one read."""
        values = reduced.tolist()
        self.agreed = values[1] > 0 if world > 1 else self.received is not None
        return [float(values[0]), *values[2 if world > 1 else 1:]]


def _from_terminal() -> bool:
    """Whether this process reads a terminal (a SIGINT is then a user's Ctrl-C)."""
    try:
        return os.isatty(0)
    except (OSError, ValueError):
        return False


SIGNALS = SignalWatch()  # this process's (runner.run installs it)
