"""Words for what the trainer says on stderr: sizes (fmt_bytes), and one line for long work that is
otherwise silent (a checkpoint's save or load of a large shard, a disk store's initial rows): what
took how long, once it is done, when it took at least SLOW_S seconds (short work says nothing)."""
from __future__ import annotations

import sys
import time
from typing import Callable

SLOW_S = 10.0


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def say_if_slow(since: float, what: Callable[[float], str], speak: bool = True) -> None:
    """Work that began at time.monotonic() `since` is done: when it took >= SLOW_S seconds and
    `speak`, print `[trainer] what(seconds)`."""
    took = time.monotonic() - since
    if speak and took >= SLOW_S:
        print(f"[trainer] {what(took)}", file=sys.stderr, flush=True)
