"""What every component may raise or wrap itself in: the error that stops training, the phase
a block of collectives is counted under (train / eval / other), and the one line an error is
reported in (`error: ...`, by the command line and every tool)."""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ..comm import Collectives


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, no device, ...); the message names the step."""


class ResumeAdvised(TrainingError):
    """Training cannot go on in this process, but the run continues from its newest checkpoint
    once the cause is fixed (a full or damaged store_dir): the runner appends which checkpoint
    that is and the command that continues from it."""


@contextmanager
def phase(comm: "Collectives", name: str) -> Iterator[None]:
    """Count the bytes sent inside the block under phase `name` (train / eval / other)."""
    prev, comm.counter.phase = comm.counter.phase, name
    try:
        yield
    finally:
        comm.counter.phase = prev


def error_line(exc: BaseException) -> str:
    """The message of exc on one line, as `error: ...` prints it. Hydra's and OmegaConf's messages
    span lines: "Could not override 'x'.\\nTo append to your config use +x=1", a list of the
    available options one per indented line, then the config search path (dropped: it names
    Hydra's own directories). Lines are joined with "; " (" " after a line ending in "." or ":"),
    the items of an indented list with ", ". An override Hydra could not parse comes first
    (`train.steps=[1: no viable alternative at input '[1'; ...`)."""
    out, indented_before = "", False
    for raw in str(exc).splitlines():
        line = raw.strip()
        if not line:
            continue
        if line == "Config search path:":
            break
        indented = raw[:1].isspace()
        if not out:
            out = line
        elif indented and indented_before:
            out += ", " + line
        else:
            out += (" " if out.endswith((".", ":")) else "; ") + line
        indented_before = indented
    out = out or type(exc).__name__
    override = getattr(exc, "override", None)  # hydra.errors.OverrideParseException
    return f"{override}: {out}" if isinstance(override, str) and override not in out else out


_OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "CUDA out of memory", "Cannot allocate memory")


@contextmanager
def allocating(part: str) -> Iterator[None]:
    """Allocation of `part` (a name a user recognises: "the embedding shard's rows and state"): an
    allocator's out-of-memory error becomes one TrainingError line naming the part and the bytes the
    allocator asked for, instead of its traceback (train.memory_check=false skips the plan that
    would have refused the run at start-up)."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        text = str(exc)
        if not isinstance(exc, MemoryError) and not any(s in text for s in _OUT_OF_MEMORY):
            raise
        asked = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGT]i?B)", text)
        size = (f"{int(asked.group(1)):,} bytes" if asked and asked.group(1) else asked.group(2)) if asked \
            else "more memory than is free"
        raise TrainingError(f"out of memory allocating {part}: {size} asked for and not available "
                            "(train.memory_check=true checks the memory plan at start-up and names what does "
                            "not fit; see docs/operations.md)") from None
