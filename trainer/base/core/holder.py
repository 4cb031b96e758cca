"""A file that names its holder (a directory's lock.json, a store folder's owner.json): read back,
how long ago it was last written, and kept fresh by a daemon thread while its holder lives.

Why one module: the directory lock (trainer/run/checkpoint/lock.py) and the disk store's scratch
folders (trainer/sparse/embedding/store/tier/scratch.py) both name a process in a file and both
judge a holder they cannot see (another host, another container) by a lease: alive while it
refreshes its file. The identity written and whether it runs are procs.py's (identity, alive,
is_me)."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["age", "keep_fresh", "mtime", "read_holder"]


def read_holder(path: str) -> Optional[dict[str, Any]]:
    """The holder a file names (a JSON object), or None: gone, being written, or not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mtime(path: str) -> Optional[float]:
    """When the file was last written or refreshed (None: it is gone)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def age(path: str) -> Optional[float]:
    """Seconds since the file was last written or refreshed (None: it is gone)."""
    t = mtime(path)
    return None if t is None else max(0.0, time.time() - t)


def keep_fresh(path: str, every: float, still_held: Callable[[], bool] = lambda: True) -> threading.Event:
    """A daemon thread touches `path` every `every` seconds while still_held() and the file can be
    touched; set the event returned to stop it."""
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(every):
            if not still_held():
                return
            try:
                os.utime(path)
            except OSError:
                return
    threading.Thread(target=refresh, name=f"holder {path}", daemon=True).start()
    return stop
