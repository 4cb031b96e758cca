"""What every component may raise or wrap itself in: the error that stops training, and the phase
a block of collectives is counted under (train / eval / other)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ..comm import Collectives


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, no device, ...); the message names the step."""


@contextmanager
def phase(comm: "Collectives", name: str) -> Iterator[None]:
    """Count the bytes sent inside the block under phase `name` (train / eval / other)."""
    prev, comm.counter.phase = comm.counter.phase, name
    try:
        yield
    finally:
        comm.counter.phase = prev
