"""Files written whole or not at all: the one way the package replaces a file.

Why: a reader (a resumed run, a sweep's report, a second preparation pass) must never find half a
file, and a full disk must not be filled further by what failed. So every file is written to a
temporary file beside it (`<path>.tmp.<pid>`: one per process, on the same file system) that is
renamed over the path once complete (os.replace, atomic on POSIX); on any failure the temporary
file is removed and the path is left as it was. Users: summary.json (report/writers.py), a sweep's
summary.json (run/multirun.py), Criteo preparation's blocks, vocabulary counts and progress marks
(data/prepare.py), metrics.jsonl cut back after a resume (report/writers.py).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import IO, Any, Iterator

import numpy as np


@contextmanager
def replacing(path: str, mode: str = "w", fsync: bool = False) -> Iterator[IO[Any]]:
    """A file opened for writing (`mode`: "w" or "wb") whose content replaces `path` when the
    block ends without an exception (fsync: flushed to the disk first); when it raises, the
    temporary file is removed, `path` is untouched and the exception goes on."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # no half-written temporary file left behind (it may be what filled the disk)
            os.unlink(tmp)
        except OSError:
            pass
        raise


def jsonable(x: Any) -> Any:
    """json.dump's `default`: numpy integers and floats as Python numbers."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def write_json_atomic(path: str, obj: Any, indent: int = 2) -> None:
    """Write obj as JSON (indented, a final newline; numpy numbers as numbers) to path, whole or
    not at all (replacing)."""
    with replacing(path) as f:
        json.dump(obj, f, indent=indent, default=jsonable)
        f.write("\n")
