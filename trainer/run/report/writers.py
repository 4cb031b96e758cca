"""Writing a run's files: metrics.jsonl (one JSON record per line, never ending a run), summary.json
(whole or not at all, else on stdout), and the log cut back to a resumed step. Whole files are
written by trainer/base/core/atomic.py, the package's one way to replace a file."""
from __future__ import annotations

import json
import sys
from typing import Any

from ...base.core.atomic import jsonable, replacing, write_json_atomic


class JsonlWriter:
    """Appends one JSON object per line; a no-op when path is None (non-zero ranks, tests).

    A log must never end a run: when a write fails (a full disk, a quota, an I/O error) the file is
    cut back to its last complete line, one warning goes to stderr, and later records are counted
    as lost instead of written; report() says so for the summary. Each record is written with
    one unbuffered write loop, so a failure cannot leave half a line in a buffer for the next one."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.written = 0  # records in the file
        self.lost = 0  # records not written after a failure
        self.error: str | None = None
        self._f = None
        if path:
            try:
                self._f = open(path, "ab", buffering=0)
            except OSError as exc:
                self._fail(exc, None)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is None:
            self.lost += 1
            return
        line = (json.dumps(record, default=jsonable) + "\n").encode()
        end = self._f.tell()
        try:
            view = memoryview(line)
            while view:
                view = view[self._f.write(view):]
        except OSError as exc:
            self.lost += 1
            self._fail(exc, end)
            return
        self.written += 1

    def _fail(self, exc: OSError, end: int | None) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        if self._f is not None and end is not None:
            try:
                self._f.truncate(end)  # no partial line (also frees what it held)
            except OSError:
                pass
        self._close()
        print(f"[trainer] warning: cannot write {self.path} ({self.error}); training goes on without "
              "its per-step log (the summary counts the records lost)", file=sys.stderr)

    def report(self) -> dict[str, Any] | None:
        """For summary.json: None when every record was written (or there is no log)."""
        if self.error is None:
            return None
        return {"path": self.path, "error": self.error, "records_written": self.written,
                "records_lost": self.lost}

    def _close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        self._close()


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """core.atomic.write_json_atomic for summary.json; when the disk refuses it, the summary goes to stdout
    (one JSON line, so the results of the run are not lost) before the error is raised."""
    try:
        write_json_atomic(path, summary)
    except OSError as exc:
        print(f"[trainer] warning: cannot write {path} ({exc}); the summary follows on stdout",
              file=sys.stderr)
        print(json.dumps(summary, default=jsonable), flush=True)
        raise


def keep_records_until(path: str, step: int) -> int:
    """Rewrite the metrics log `path` keeping only the records of steps <= step (step lines, evals
    and earlier resume lines; lines without a step too), atomically (core/atomic.py: a temporary
    file in the same directory, fsynced, renamed over the log). Lines that are not whole JSON
    records (cut by a kill) go too. Returns how many lines were dropped. A log that cannot be rewritten (a full disk)
    stays as it is, with a warning; the resume line written next still marks where the resumed
    run's records begin. Rank 0 only, before the log is opened for appending."""

    def wanted(line: bytes) -> bool:
        try:
            rec = json.loads(line)
        except ValueError:
            return False
        at = rec.get("step") if isinstance(rec, dict) else None
        return not isinstance(at, (int, float)) or at <= step

    try:
        with open(path, "rb") as f:  # a first pass reads only: most resumes have nothing to drop
            dropped = sum(1 for line in f if not (line.endswith(b"\n") and wanted(line)))
    except FileNotFoundError:
        return 0
    except OSError as exc:
        print(f"[trainer] warning: cannot read {path} ({exc}); records after step {step} from the "
              "interrupted run may repeat", file=sys.stderr)
        return 0
    if dropped == 0:
        return 0
    try:
        with open(path, "rb") as src, replacing(path, "wb", fsync=True) as dst:
            for line in src:
                if line.endswith(b"\n") and wanted(line):
                    dst.write(line)
    except OSError as exc:
        print(f"[trainer] warning: cannot rewrite {path} ({exc}); its {dropped} records after step "
              f"{step} from the interrupted run stay, before the resume line", file=sys.stderr)
        return 0
    return dropped
