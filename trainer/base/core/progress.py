"""Words for what the trainer says on stderr: sizes (fmt_bytes), one line for long work that is
otherwise silent (a checkpoint's save or load of a large shard, a disk store's initial rows): what
took how long, once it is done, when it took at least SLOW_S seconds (short work says nothing), and
the progress bar of long work that counts its way (Bar: the training steps, prepare's input bytes)."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

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


class Bar:
    """A tqdm progress bar on stderr, or nothing at all when not `enabled` (tqdm is then not even
    imported): update, note and close do what a bar would, or nothing / print."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "it", unit_scale: bool = False,
                 initial: int = 0) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                            file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int, postfix: Optional[dict[str, Any]] = None) -> None:
        """n more done; postfix: the values shown after the bar (left as they were when None)."""
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(**postfix)

    def note(self, text: str) -> None:
        """A line on stderr above the bar (printed as is without one)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
